"""StepRunner with a FAKE replay and FAKE /metrics (no server): scaling, fresh prompts,
isolation between steps, and what an early stop's unsent requests count as."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from objectives import parse_slo, summarize
from optimizer.capacity.measure import (
    ClientCouldNotKeepUp,
    StepRunner,
    measured_records,
    slo_floors,
)
from optimizer.types import RequestRecord, Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayResult

_STEADY = [TraceRequest(arrival_s=float(i), input_tokens=100, output_tokens=5) for i in range(10)]
_BURST = [
    TraceRequest(arrival_s=10.0, input_tokens=3000, output_tokens=5),
    TraceRequest(arrival_s=10.0, input_tokens=2000, output_tokens=5),
]
TRACE = Trace(requests=(*_STEADY, *_BURST))


def _record(i: int, sched: float, *, error: str | None = None, ttft: float = 0.1) -> RequestRecord:
    if error:
        return RequestRecord(i, sched, sched, None, (), sched, 100, 0, error=error)
    chunks = tuple(sched + ttft + 0.02 * k for k in range(5))
    return RequestRecord(i, sched, sched, chunks[0], chunks, chunks[-1], 100, 5)


class FakeReplay:
    """FAKE replay: serves every request in 0.1 s, or stops early at scale > 1 after half."""

    def __init__(self, keep_schedule: bool = True) -> None:
        self.calls: list[dict[str, Any]] = []
        self.keep_schedule = keep_schedule

    def __call__(self, trace: Trace, url: str, model: str, **kw: Any) -> ReplayResult:
        self.calls.append({"trace": trace, **kw})
        t0 = trace.requests[0].arrival_s
        sched = [r.arrival_s - t0 for r in trace.requests]
        early = kw.get("stop_check") is not None and sched[-1] < 10.0  # scale > 1
        records = []
        for i, s in enumerate(sched):
            if early and i >= len(sched) // 2:
                records.append(_record(i, s, error="not sent: early stop: SLO out of reach: x"))
            else:
                records.append(_record(i, s, ttft=0.1 if not early else 2.0))
        return ReplayResult(
            records=tuple(records),
            duration_s=sched[-1] + 1,
            p99_send_lag_ms=1.0,
            max_send_lag_ms=1.0,
            max_send_lag_bound_ms=10.0,
            peak_in_flight=3,
            schedule_kept=self.keep_schedule,
            stopped_early=early,
            stop_reason="SLO out of reach: p95_ttft_ms<=500 can no longer be met" if early else "",
            message="" if self.keep_schedule else "lag",
        )


def _runner(replay: FakeReplay, tmp_path: Path, **kw: Any) -> StepRunner:
    busy = iter([{"vllm:num_requests_running": 2.0}] + [{"vllm:num_requests_running": 0.0}] * 99)
    return StepRunner(
        url="http://127.0.0.1:9",  # nothing listens: the prefix-cache reset is not offered
        model="m",
        trace=TRACE,
        slos=[parse_slo("p95_ttft_ms<=500")],
        vocab=TokenRange(10, 1000),
        seed=7,
        metrics=lambda: next(busy),
        records_dir=tmp_path / "steps",
        replay=replay,
        **kw,
    )


def test_steps_rescale_the_trace_with_fresh_prompts_and_isolate(tmp_path: Path) -> None:
    replay = FakeReplay()
    runner = _runner(replay, tmp_path, full_at_or_below=0.5)
    ok = runner(1.0, 0)
    stopped = runner(2.0, 0)
    low = runner(0.5, 0)
    scales = [c["trace"].requests[-1].arrival_s for c in replay.calls]
    assert scales == [10.0, 5.0, 20.0]  # arrival times divided by the scale, bursts kept
    seeds = [c["seed"] for c in replay.calls]
    assert len(set(seeds)) == 3  # fresh prompts per step
    assert replay.calls[2]["stop_check"] is None  # at the lowest scale: a full window
    assert ok.passed and not ok.stopped_early
    assert stopped.stopped_early and not stopped.passed and stopped.detail["partial"]
    # The requests the early stop never sent are not the server's errors.
    assert stopped.summary["error_rate"] == 0.0
    assert stopped.summary["completed"] == 6
    assert low.detail["offered_rps"] == pytest.approx(ok.detail["offered_rps"] / 2)
    assert runner.describe_isolation() == "drained, fresh prompts"
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == [
        "step-00.jsonl.gz",
        "step-01.jsonl.gz",
        "step-02.jsonl.gz",
    ]


def test_steps_inside_a_measured_bracket_run_in_full(tmp_path: Path) -> None:
    """Bisection steps (between a pass and a fail) are never stopped early: the estimate
    interpolates to their margins; outside the bracket early stop still saves time."""
    replay = FakeReplay()
    runner = _runner(replay, tmp_path)
    assert runner(1.0, 0).passed  # no bracket yet: early stop on offer
    assert replay.calls[-1]["stop_check"] is not None
    assert runner(2.0, 0).stopped_early  # bracket [1, 2] now
    inside = runner(1.5, 0)
    assert replay.calls[-1]["stop_check"] is None and not inside.stopped_early
    assert inside.summary["completed"] == len(TRACE) and not inside.detail["partial"]
    assert inside.passed  # this fake serves everything it is sent in 0.1 s: bracket [1.5, 2]
    assert runner(1.8, 0).passed and replay.calls[-1]["stop_check"] is None
    runner(4.0, 0)  # above the lowest fail: outside the bracket, early stop again
    assert replay.calls[-1]["stop_check"] is not None
    assert runner.runs_in_full(1.9) and not runner.runs_in_full(1.2)


def test_a_client_that_cannot_keep_up_twice_is_not_a_measurement(tmp_path: Path) -> None:
    replay = FakeReplay(keep_schedule=False)
    runner = _runner(replay, tmp_path)
    with pytest.raises(ClientCouldNotKeepUp):
        runner(1.0, 0)
    assert len(replay.calls) == 2
    assert replay.calls[0]["seed"] != replay.calls[1]["seed"]


def test_measured_records_drop_only_what_an_early_stop_cut() -> None:
    records = [
        _record(0, 0.0),
        _record(1, 1.0, error="not sent: early stop: SLO out of reach: x"),
        _record(2, 1.0, error="cancelled: early stop: SLO out of reach: x"),
        _record(3, 1.0, error="HTTP 500: boom"),
        _record(4, 1.0, error="not sent: max duration reached"),
    ]
    kept = measured_records(records)
    assert [r.index for r in kept] == [0, 3, 4]
    assert summarize(kept)["error_rate"] == pytest.approx(2 / 3)


def test_slo_floors_from_the_trace_and_the_measured_server() -> None:
    recs = [_record(0, 0.0, ttft=0.05), _record(1, 1.0, ttft=0.1)]
    floors = slo_floors(TRACE, recs)
    # The largest same-instant arrival: 2 requests, 5000 prompt tokens at t=10.
    assert floors["burst_requests"] == 2 and floors["burst_prompt_tokens"] == 5000
    assert floors["prefill_tokens_per_s"] == pytest.approx(100 / 0.05)
    assert floors["ttft_floor_ms"] == pytest.approx(5000 / 2000 * 1000)
    assert floors["tpot_floor_ms"] == pytest.approx(20.0)
    assert slo_floors(TRACE, []) == {}


def _preroll_steps(kv_cache_tokens: int | None) -> tuple[Trace, Any, list[Any], StepRunner]:
    """A windowed trace with a pre-roll, the real replay against a recording MockTransport
    (FAKE server: answers every request with its tokens), and a StepRunner over them."""
    import httpx

    from optimizer.workload.replay import run_replay
    from optimizer.workload.shaping import ShapeSpec, shape
    from tests.unit.workload.test_preroll import Recorder, conversations

    shaped, _ = shape(conversations(), ShapeSpec(window_s=(60.0, 75.0), compress=100.0))
    server = Recorder()
    starts: list[tuple[float, str]] = []

    def replay(trace: Trace, url: str, model: str, **kw: Any) -> ReplayResult:
        return run_replay(trace, url, model, transport=httpx.MockTransport(server.handle), **kw)

    runner = StepRunner(
        url="http://127.0.0.1:9",  # nothing listens: no reset offered, no metrics
        model="m",
        trace=shaped,
        slos=[parse_slo("error_rate<=0.01")],
        vocab=TokenRange(300, 5000),
        seed=3,
        replay=replay,
        on_step_start=lambda scale, note: starts.append((scale, note)),
        kv_cache_tokens=kv_cache_tokens,
        max_send_lag_ms=math.inf,  # the client's lag is not under test (the machine may be busy)
    )
    return shaped, server, starts, runner


def test_the_warm_set_is_sent_once_and_every_step_hits_it_with_fresh_prompts_otherwise() -> None:
    """The KV cache holds the warm set and both steps: the pre-roll goes before the first step
    only; the second step's requests start with exactly the tokens the pre-roll sent (the
    warm blocks keep their seed) and everything after them is that step's own."""
    from optimizer.workload.replay import warm_blocks
    from optimizer.workload.shaping import preroll_trace

    shaped, server, starts, runner = _preroll_steps(kv_cache_tokens=10**9)
    runner.warm_up(requests=2)
    assert len(server.bodies) == 2  # the warm-up replays the window's head, no pre-roll
    warm = len(preroll_trace(shaped))
    steps = [runner(1.0, 0), runner(2.0, 0)]
    note = f"pre-roll of {len(shaped.preroll)} requests first"
    assert starts == [(1.0, note), (2.0, "")]  # each step names its scale as it starts
    assert len(server.bodies) == 2 + warm + 2 * len(shaped)
    assert [b["max_tokens"] for b in server.bodies[2 : 2 + warm]] == [1] * warm
    assert steps[0].detail["preroll_requests"] == warm and steps[0].detail["warm_set"] == "sent"
    assert steps[1].detail["preroll_requests"] == 0 and steps[1].detail["warm_set"] == "kept"
    assert [len(runner.records[k]) for k in (0, 1)] == [len(shaped)] * 2  # the window only
    assert "warm set kept" in runner.describe_isolation()
    assert "prefix cache reset" not in runner.describe_isolation()

    preroll = [b["prompt"] for b in server.bodies[2 : 2 + warm]]
    first = [b["prompt"] for b in server.bodies[2 + warm : 2 + warm + len(shaped)]]
    second = [b["prompt"] for b in server.bodies[2 + warm + len(shaped) :]]
    blocks = warm_blocks(shaped)
    hits = fresh = 0
    for r, a, b in zip(shaped.requests, first, second, strict=True):
        n = 0
        while n < len(r.prefix_blocks) and r.prefix_blocks[n] in blocks:
            n += 1
        cut = min(n * shaped.block_size, r.input_tokens)
        assert a[:cut] == b[:cut]  # the warm run: the same tokens in every step
        assert a[cut:] != b[cut:] or cut == r.input_tokens  # the rest: each step's own
        hits += cut > 0
        fresh += cut < r.input_tokens
    assert hits >= 5 and fresh == len(shaped)
    # What the second step sends without a pre-roll of its own starts with what the first sent.
    continued = [p for p in preroll if any(ids[: len(p)] == p for ids in second)]
    in_window = {r.session_id for r in shaped.requests}
    assert len(continued) == sum(r.session_id in in_window for r in preroll_trace(shaped).requests)


@pytest.mark.parametrize("kv_cache_tokens", [None, 1])
def test_the_warm_set_is_sent_again_where_the_steps_could_have_evicted_it(
    kv_cache_tokens: int | None,
) -> None:
    """A KV cache too small for the warm set and a step's tokens (or of unknown size): the
    pre-roll goes before every step, with the same prompts (the blocks still cached hit)."""
    from optimizer.workload.shaping import preroll_trace

    shaped, server, starts, runner = _preroll_steps(kv_cache_tokens=kv_cache_tokens)
    steps = [runner(1.0, 0), runner(2.0, 0)]
    warm = len(preroll_trace(shaped))
    per_step = warm + len(shaped)
    assert len(server.bodies) == 2 * per_step
    assert [s.detail["warm_set"] for s in steps] == ["sent", "sent"]
    assert all(s.detail["preroll_requests"] == warm for s in steps)
    assert [b["prompt"] for b in server.bodies[:warm]] == [
        b["prompt"] for b in server.bodies[per_step : per_step + warm]
    ]
    assert [note != "" for _, note in starts] == [True, True]


def test_the_warm_set_bound_counts_what_was_sent_since(tmp_path: Path) -> None:
    """Due again once the warm set's tokens and the steps' since it was sent pass the cache."""
    from optimizer.workload.shaping import preroll_trace

    shaped, _, _, _ = _preroll_steps(kv_cache_tokens=None)
    warm = sum(r.input_tokens for r in preroll_trace(shaped).requests)
    step = sum(r.input_tokens + r.output_tokens for r in shaped.requests)
    runner = _runner(FakeReplay(), tmp_path, kv_cache_tokens=warm + step + step // 2)
    runner.trace = shaped
    assert runner.warm_set_due()  # never sent
    runner(1.0, 0)
    assert not runner.warm_set_due()  # the warm set and one step fit
    runner(1.0, 0)
    assert runner.warm_set_due()  # and a second one does not
    runner.trace = TRACE
    assert not runner.warm_set_due()  # no pre-roll: nothing to send


@pytest.mark.parametrize(("kv_cache_tokens", "sends"), [(10**9, 1), (1, 3)])
def test_the_trial_summary_counts_the_warm_set_s_sends(kv_cache_tokens: int, sends: int) -> None:
    """A search of 3 steps (x1, x2, x4: every one passes): the warm set sent once, or before
    every step where the steps could have evicted it; the summary sums what those sends cost."""
    from types import SimpleNamespace

    from optimizer.capacity.search import search_capacity
    from optimizer.capacity.trial import capacity_summary
    from optimizer.types import CapacitySettings
    from optimizer.workload.shaping import preroll_trace

    shaped, _, _, runner = _preroll_steps(kv_cache_tokens=kv_cache_tokens)
    search = search_capacity(runner, CapacitySettings(start_scale=1.0, max_scale=4.0))
    assert [s.scale for s in search.steps] == [1.0, 2.0, 4.0]
    fake_spec = SimpleNamespace(trace=shaped, warmup_requests=0)  # FAKE: what the summary reads
    summary = capacity_summary(fake_spec, search)  # type: ignore[arg-type]
    warm = preroll_trace(shaped)
    assert summary["preroll_sends"] == sends
    assert summary["preroll_requests"] == sends * len(warm)
    assert summary["preroll_tokens"] == sends * sum(r.input_tokens for r in warm.requests)
    assert summary["preroll_s"] == pytest.approx(sum(s.detail["preroll_s"] for s in search.steps))
