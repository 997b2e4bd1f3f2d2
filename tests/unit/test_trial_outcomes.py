"""run_trial's outcomes with a FAKE engine (tests/fakes/trials.py: the fake OpenAI server on
loopback), no vLLM: a measured trial, an engine that does not start, one that dies while it is
measured, and one definition of send lag in the summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from optimizer import trial as trial_mod
from optimizer.errors import EngineError
from optimizer.types import (
    EngineConfig,
    FailureClass,
    RequestRecord,
    Trace,
    TraceRequest,
    TrialSpec,
    TrialStatus,
)
from optimizer.workload.replay import ReplayResult
from tests.fakes.trials import FakeEngine


def _spec(tmp_path: Path, n: int = 12, gap_s: float = 0.05) -> TrialSpec:
    trace = Trace(
        requests=tuple(
            TraceRequest(arrival_s=gap_s * i, input_tokens=8, output_tokens=4) for i in range(n)
        ),
    )
    return TrialSpec(
        number=3,
        engine=EngineConfig(model="fake-model", args={}),
        trace=trace,
        workdir=str(tmp_path / "trial"),
        token_range=(1000, 2000),
        seed=1,
        warmup_requests=2,
        max_send_lag_ms=1000.0,
    )


def _engine_error(cls: FailureClass) -> EngineError:
    return EngineError(
        "failed",
        failure_class=cls,
        explanation="explained",
        log_path="engine.log",
        log_lines=("a line",),
    )


def test_a_served_replay_is_a_complete_measurement(tmp_path: Path) -> None:
    engine = FakeEngine()
    result = trial_mod.run_trial(_spec(tmp_path), engine=engine)
    assert result.status is TrialStatus.COMPLETE, result.message
    assert result.summary["completed"] == 10 and result.summary["error_rate"] == 0.0
    assert engine.stopped
    assert (tmp_path / "trial" / "result.json").is_file()
    assert (tmp_path / "trial" / "records.jsonl.gz").is_file()


def test_an_engine_that_does_not_start_is_a_failure_with_its_class(tmp_path: Path) -> None:
    engine = FakeEngine(fail_start=_engine_error(FailureClass.KV_CACHE_TOO_SMALL))
    result = trial_mod.run_trial(_spec(tmp_path), engine=engine)
    assert result.status is TrialStatus.FAILED
    assert result.failure_class is FailureClass.KV_CACHE_TOO_SMALL
    assert result.log_lines == ("a line",) and engine.stopped


def test_an_engine_that_dies_while_measured_keeps_what_was_measured(tmp_path: Path) -> None:
    engine = FakeEngine(die_after_replay=_engine_error(FailureClass.ENGINE_CRASHED))
    result = trial_mod.run_trial(_spec(tmp_path), engine=engine)
    assert result.status is TrialStatus.FAILED
    assert result.message.startswith("the engine died during the replay")
    assert result.summary["completed"] == 10 and len(result.records) == 12


def _records(lag_s: float) -> tuple[RequestRecord, ...]:
    out = []
    for i in range(20):
        sent = 0.1 * i + lag_s
        out.append(
            RequestRecord(
                index=i,
                scheduled_s=0.1 * i,
                sent_s=sent,
                first_token_s=sent + 0.01,
                chunk_times_s=tuple(sent + 0.01 * (k + 1) for k in range(4)),
                end_s=sent + 0.05,
                input_tokens=8,
                output_tokens=4,
                warmup=i < 2,
            )
        )
    return tuple(out)


def test_summary_send_lag_has_one_definition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary's send-lag figures all come from the same requests and the same rule (they
    once mixed the replayer's P99, which also counts requests it never sent, with summarize's
    maximum, so a P99 could exceed the maximum)."""
    records = _records(lag_s=0.001)

    def fake_replay(*_a: Any, **_kw: Any) -> ReplayResult:
        return ReplayResult(
            records=records,
            duration_s=2.0,
            p99_send_lag_ms=40.0,  # what the replayer judged, with waits of unsent requests
            max_send_lag_ms=45.0,
            max_send_lag_bound_ms=50.0,
            peak_in_flight=1,
            schedule_kept=True,
            stopped_early=False,
        )

    monkeypatch.setattr(trial_mod, "_replay", fake_replay)
    result = trial_mod.run_trial(_spec(tmp_path), engine=FakeEngine())
    s = result.summary
    assert result.status is TrialStatus.COMPLETE
    assert s["p50_send_lag_ms"] <= s["p99_send_lag_ms"] <= s["max_send_lag_ms"]
    assert s["p99_send_lag_ms"] == pytest.approx(1.0, abs=0.01)
    assert s["max_send_lag_ms"] == pytest.approx(1.0, abs=0.01)


def test_a_kv_cache_size_the_engine_did_not_take_is_flagged_not_measured(tmp_path: Path) -> None:
    # The CPU grid of issue 34: kv-cache-memory-bytes 64 MiB, but VLLM_CPU_KVCACHE_SPACE=1 won
    # and the engine reported 1 GiB (262,144 tokens) for every label.
    from dataclasses import replace

    from optimizer.types import MemoryAccount

    spec = _spec(tmp_path)
    spec = replace(spec, engine=EngineConfig(model="m", args={"kv-cache-memory-bytes": 64 << 20}))
    engine = FakeEngine(memory=MemoryAccount(kv_cache_gib=1.0, kv_cache_tokens=262_144))
    result = trial_mod.run_trial(spec, engine=engine)
    assert result.status is TrialStatus.FAILED
    assert result.failure_class is FailureClass.PARAMETER_INACTIVE
    assert "asked for 0.0625 GiB" in result.message and "reports 1 GiB" in result.message
    assert result.summary == {} and not result.records and engine.stopped
    # vLLM prints the size it took rounded to 0.01 GiB: 64 MiB reads 0.06 and acted.
    acted = FakeEngine(memory=MemoryAccount(kv_cache_gib=0.06, kv_cache_tokens=16_384))
    result = trial_mod.run_trial(replace(spec, workdir=str(tmp_path / "t2")), engine=acted)
    assert result.status is TrialStatus.COMPLETE, result.message


def test_the_preroll_is_skipped_without_prefix_caching_and_cut_to_the_kv_cache(
    tmp_path: Path,
) -> None:
    from dataclasses import replace

    from optimizer.types import MemoryAccount

    spec = _spec(tmp_path)
    chains = (
        TraceRequest(-5.0, 64, 1, (1, 2, 3, 4)),
        TraceRequest(-4.0, 48, 1, (9, 10, 11)),
    )
    spec = replace(spec, trace=replace(spec.trace, block_size=16, preroll=chains))
    off, note = trial_mod.bounded_preroll(spec, None, {"enable_prefix_caching": "False"})
    assert off.trace.preroll == () and note == {"preroll_skipped_no_prefix_cache": 1.0}
    same, note = trial_mod.bounded_preroll(spec, MemoryAccount(kv_cache_tokens=10**6), {})
    assert same is spec and note == {}
    cut, note = trial_mod.bounded_preroll(spec, MemoryAccount(kv_cache_tokens=100), {})
    assert [r.prefix_blocks for r in cut.trace.preroll] == [(1, 2, 3, 4)]
    assert note == {"preroll_chains_left_out": 1.0, "preroll_tokens_left_out": 48.0}
    assert cut.trace.requests == spec.trace.requests


def test_a_memory_share_the_engine_did_not_take_is_flagged_not_measured(tmp_path: Path) -> None:
    # gpu-memory-utilization on a server whose KV cache was sized in bytes (on the CPU build by
    # VLLM_CPU_KVCACHE_SPACE): every label would get the same cache.
    from dataclasses import replace

    from optimizer.types import MemoryAccount

    spec = _spec(tmp_path)
    spec = replace(spec, engine=EngineConfig(model="m", args={"gpu-memory-utilization": 0.5}))
    explicit = MemoryAccount(kv_cache_gib=1.0, kv_cache_tokens=262_144, kv_cache_explicit=True)
    engine = FakeEngine(memory=explicit)
    result = trial_mod.run_trial(spec, engine=engine)
    assert result.status is TrialStatus.FAILED
    assert result.failure_class is FailureClass.PARAMETER_INACTIVE
    assert "gpu-memory-utilization 0.5 did not act" in result.message
    assert result.summary == {} and not result.records and engine.stopped
    share = MemoryAccount(kv_cache_gib=3.9, memory_utilization=0.5, kv_cache_explicit=False)
    result = trial_mod.run_trial(
        replace(spec, workdir=str(tmp_path / "t2")), engine=FakeEngine(memory=share)
    )
    assert result.status is TrialStatus.COMPLETE, result.message
