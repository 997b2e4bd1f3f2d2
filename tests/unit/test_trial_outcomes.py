"""run_trial's outcomes with a FAKE engine and a FAKE replay (no vLLM, no network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from optimizer import trial as trial_mod
from optimizer.types import EngineConfig, RequestRecord, Trace, TraceRequest, TrialSpec
from optimizer.workload.replay import ReplayResult


class FakeEngine:
    """Starts at once, serves nothing, stays alive."""

    def __init__(self, config: EngineConfig, *, log_path: Path, **_kw: Any) -> None:
        self.config = config
        self.log_path = log_path
        self.url = "http://127.0.0.1:9"
        self.startup_s = 0.1

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def check_alive(self) -> None:
        pass

    def memory_account(self) -> None:
        return None

    def effective_config(self) -> dict[str, str]:
        return {}

    def scrape_metrics(self) -> dict[str, float]:
        return {}


def _spec(tmp_path: Path) -> TrialSpec:
    trace = Trace(
        requests=tuple(
            TraceRequest(arrival_s=0.1 * i, input_tokens=8, output_tokens=4) for i in range(20)
        ),
    )
    return TrialSpec(
        number=3,
        engine=EngineConfig(model="org/model", args={}),
        trace=trace,
        workdir=str(tmp_path / "trial"),
        token_range=(1000, 2000),
        seed=1,
        warmup_requests=2,
    )


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

    monkeypatch.setattr(trial_mod, "EngineProcess", FakeEngine)
    monkeypatch.setattr(trial_mod, "_replay", fake_replay)
    result = trial_mod.run_trial(_spec(tmp_path))
    s = result.summary
    assert result.status.value == "complete"
    assert s["p50_send_lag_ms"] <= s["p99_send_lag_ms"] <= s["max_send_lag_ms"]
    assert s["p99_send_lag_ms"] == pytest.approx(1.0, abs=0.01)
    assert s["max_send_lag_ms"] == pytest.approx(1.0, abs=0.01)
