"""The verdict math on synthetic series: slope and its interval, drift, spikes, recovery,
preemptions and errors per phase, long inputs, and the comparison with the baseline."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from objectives import parse_slo
from optimizer.stability.plan import PlanSettings, StabilityPlan, build_plan
from optimizer.stability.verdicts import (
    Sample,
    Verdict,
    compare,
    counter_increase,
    drift_windows,
    evaluate,
    overall,
    recovery_s,
    slope_ci,
    t_critical,
    windows,
)
from optimizer.types import RequestRecord

SLOS = [parse_slo("p95_ttft_ms<=500"), parse_slo("p95_tpot_ms<=50"), parse_slo("error_rate<=0.01")]


def _plan(**kw: float) -> StabilityPlan:
    settings = PlanSettings(
        **{"sustained_s": 60, "burst_s": 10, "recovery_s": 30, "long_input_s": 20, **kw}
    )
    return build_plan(settings, base_scale=1.0, burst_scale=3.0, max_model_len=2048)


def _rec(
    i: int, t: float, ttft_ms: float = 100, tpot_ms: float = 20, error: str | None = None
) -> RequestRecord:
    first = t + ttft_ms / 1000
    chunks = tuple(first + k * tpot_ms / 1000 for k in range(10))
    return RequestRecord(
        index=i,
        scheduled_s=t,
        sent_s=t,
        first_token_s=None if error else first,
        chunk_times_s=() if error else chunks,
        end_s=chunks[-1],
        input_tokens=100,
        output_tokens=0 if error else 10,
        error=error,
    )


def _steady(plan: StabilityPlan, ttft=lambda t: 100.0, every: float = 0.5) -> list[RequestRecord]:
    return [_rec(i, t, ttft(t)) for i, t in enumerate(np.arange(0, plan.duration_s, every))]


def test_slope_recovers_a_known_line_and_its_interval_covers_it() -> None:
    rng = np.random.default_rng(0)
    t = np.arange(0, 600, 2.0)
    y = 1000 + 0.05 * t + rng.normal(0, 2, len(t))  # 3 MiB/min
    s = slope_ci(t, y)
    assert s is not None and s.n == len(t)
    assert s.lo < 3.0 < s.hi and s.per_min == pytest.approx(3.0, rel=0.05)
    assert s.growing(0.05)  # 180 MiB/h on 1 GiB: growing
    flat = slope_ci(t, 1000 + rng.normal(0, 2, len(t)))
    assert flat is not None and flat.lo < 0 < flat.hi and not flat.growing(0.05)
    # Significant but small: 0.01 MiB/min on 1000 MiB is 0.06 %/h: level.
    tiny = slope_ci(t, 1000 + t * (0.01 / 60))
    assert tiny is not None and tiny.lo > 0 and not tiny.growing(0.05)
    assert slope_ci([0, 1], [1, 2]) is None and slope_ci([1, 1, 1], [1, 2, 3]) is None


def test_t_quantiles() -> None:
    assert t_critical(1) == pytest.approx(12.706)
    assert t_critical(30) == pytest.approx(2.042)
    assert t_critical(60) == pytest.approx(2.0, abs=0.01)
    assert t_critical(0) == math.inf


def test_memory_verdict_fails_a_leak_and_passes_a_level_server() -> None:
    plan = _plan()
    records = _steady(plan)
    leak = [Sample(t_s=float(t), rss_mib=2000 + 2 * t, preemptions=0) for t in range(0, 120)]
    level = [Sample(t_s=float(t), rss_mib=2000 + (t % 3), preemptions=0) for t in range(0, 120)]
    v_leak = {v.name: v for v in evaluate(records, [False] * len(records), leak, plan, SLOS)}
    v_level = {v.name: v for v in evaluate(records, [False] * len(records), level, plan, SLOS)}
    assert v_leak["memory_rss"].status == "fail" and "growing" in v_leak["memory_rss"].text
    assert v_leak["memory_rss"].numbers["per_min"] == pytest.approx(120, rel=0.01)
    assert v_level["memory_rss"].status == "pass" and "level" in v_level["memory_rss"].text
    assert "memory_gpu" not in v_level  # no GPU samples: no GPU verdict
    assert overall(list(v_level.values())) == "stable"
    assert overall(list(v_leak.values())) == "unstable"


def test_drift_compares_first_and_last_windows() -> None:
    plan = _plan()  # drift windows: max(10 s, 60 s / 6) = 10 s
    rising = _steady(plan, ttft=lambda t: 100 + 6 * t if t < 60 else 100)
    v = {x.name: x for x in evaluate(rising, [False] * len(rising), [], plan, SLOS)}
    d = v["drift"]
    assert d.numbers["p95_ttft_ms"]["first"] < 200 < 400 < d.numbers["p95_ttft_ms"]["last"]
    assert d.status == "fail"  # x3 and the last window uses more than half the 500 ms SLO
    mild = _steady(plan, ttft=lambda t: 10 + 0.5 * t if t < 60 else 10)
    v = {x.name: x for x in evaluate(mild, [False] * len(mild), [], plan, SLOS)}
    assert v["drift"].status == "warn"  # x4, but far inside the SLO
    flat = _steady(plan)
    v = {x.name: x for x in evaluate(flat, [False] * len(flat), [], plan, SLOS)}
    assert v["drift"].status == "pass"
    # A drift window nobody arrived in: nothing to compare.
    gap = [r for r in flat if not 50 <= r.scheduled_s < 60]
    v = {x.name: x for x in evaluate(gap, [False] * len(gap), [], plan, SLOS)}
    assert v["drift"].status == "n/a" and "(20 and 0)" in v["drift"].text
    # A rise on a metric without an SLO only warns.
    v = {x.name: x for x in evaluate(rising, [False] * len(rising), [], plan, SLOS[2:])}
    assert v["drift"].status == "warn"


def test_spikes_are_windows_over_an_slo_per_phase() -> None:
    plan = _plan()
    spiky = _steady(plan, ttft=lambda t: 900 if 30 <= t < 40 or 70 <= t < 80 else 100)
    wins = windows(spiky, plan, SLOS)
    assert [w.phase for w in wins].count("sustained") == 6
    over = [(w.phase, w.start_s) for w in wins if w.slo_met is False]
    assert over == [("sustained", 30), ("recovery", 70)]
    v = {x.name: x for x in evaluate(spiky, [False] * len(spiky), [], plan, SLOS)}
    assert v["spikes"].status == "fail" and v["spikes"].numbers["per_phase"]["sustained"] == 1
    # The worst window outside the burst and recovery, with its excess over the bound.
    worst = v["spikes"].numbers["worst"]
    assert (worst["phase"], worst["start_s"]) == ("sustained", 30)
    assert worst["slo"].startswith("p95_ttft_ms") and abs(worst["value"] - 900) < 1e-6
    assert abs(worst["excess"] - 0.8) < 1e-6  # 900 ms against 500
    assert "worst outside the burst" in v["spikes"].text
    only_burst = _steady(plan, ttft=lambda t: 900 if 60 <= t < 70 else 100)
    v = {x.name: x for x in evaluate(only_burst, [False] * len(only_burst), [], plan, SLOS)}
    assert v["spikes"].status == "warn"


def test_recovery_time_after_the_burst() -> None:
    plan = _plan()  # burst 60..70, recovery 70..100, windows of 10 s
    # Requests arriving in the 7 s after the burst still queue behind it.
    slow = _steady(plan, ttft=lambda t: 2000 if 60 <= t < 77 else 100)
    assert recovery_s(slow, plan, SLOS) == 7.0
    assert recovery_s(_steady(plan), plan, SLOS) == 0.0
    never = _steady(plan, ttft=lambda t: 2000 if t >= 60 else 100)
    assert recovery_s(never, plan, SLOS) is None
    v = {x.name: x for x in evaluate(never, [False] * len(never), [], plan, SLOS)}
    assert v["recovery"].status == "fail"
    no_burst = _plan(burst_s=0)
    assert recovery_s(_steady(no_burst), no_burst, SLOS) is None


def test_preemptions_and_errors_per_phase() -> None:
    plan = _plan()
    samples = [
        Sample(t_s=float(t), preemptions=float(max(0, t - 62) if t < 66 else 4))
        for t in range(-1, 125)
    ]
    assert counter_increase(samples, 0, 60) == 0
    assert counter_increase(samples, 60, 70) == 4
    assert counter_increase([], 0, 1) is None
    records = _steady(plan)
    records[10] = _rec(10, records[10].scheduled_s, error="HTTP 500")  # sustained
    v = {x.name: x for x in evaluate(records, [False] * len(records), samples, plan, SLOS)}
    assert v["preemptions"].status == "warn"  # only in the burst
    assert v["preemptions"].numbers["per_phase"]["burst"] == 4
    assert v["errors"].status == "fail" and v["errors"].numbers["per_phase"]["sustained"] == 1
    late = [Sample(t_s=float(t), preemptions=0.0 if t < 105 else 9.0) for t in range(-1, 125)]
    clean = _steady(plan)
    v = {x.name: x for x in evaluate(clean, [False] * len(clean), late, plan, SLOS)}
    assert v["preemptions"].status == "fail"


def test_long_inputs_served_or_refused() -> None:
    plan = _plan()
    records = _steady(plan)
    long = [False] * len(records)
    for i in (-4, -3):
        long[i] = True
    v = {x.name: x for x in evaluate(records, long, [], plan, SLOS)}
    assert v["long_inputs"].status == "pass" and v["long_inputs"].numbers["served"] == 2
    records[-3] = _rec(0, records[-3].scheduled_s, error="HTTP 400: maximum context length")
    v = {x.name: x for x in evaluate(records, long, [], plan, SLOS)}
    assert v["long_inputs"].status == "fail" and "maximum context" in v["long_inputs"].text
    v = {x.name: x for x in evaluate(records, [False] * len(records), [], plan, SLOS)}
    assert v["long_inputs"].status == "n/a"
    # Served, but queued one after the other: over the TTFT SLO.
    slow = _steady(plan)
    slow[-4] = _rec(0, slow[-4].scheduled_s, ttft_ms=2500)
    slow[-3] = _rec(0, slow[-3].scheduled_s, ttft_ms=2500)
    v = {x.name: x for x in evaluate(slow, long, [], plan, SLOS)}
    assert v["long_inputs"].status == "fail" and "over the 500 ms SLO" in v["long_inputs"].text
    assert v["long_inputs"].numbers["served"] == 2


def test_compare_flags_what_the_chosen_did_worse() -> None:
    chosen = [
        Verdict("memory_rss", "fail", "growing"),
        Verdict("recovery", "pass", "2 s"),
        Verdict("drift", "warn", "x2"),
    ]
    base = [
        Verdict("memory_rss", "pass", "level"),
        Verdict("recovery", "fail", "never"),
        Verdict("drift", "n/a", "short"),
    ]
    flags = compare(chosen, base)
    assert len(flags) == 1 and flags[0].startswith("memory_rss: chosen fail")
    assert compare(base, base) == []


def test_drift_compares_whole_loops_of_a_bursty_trace() -> None:
    """A trace quiet for its first half and busy for its second, looped: the last sixth of the
    sustained phase falls in a busy part, the first in a quiet one. The sixths report a drift
    that is the trace's shape; whole loops compare like with like and see none."""
    base = _plan()  # sustained 0..60 s
    looped = dataclasses.replace(base, trace_period_s=20.0 * base.base_scale)  # 20 s loops

    def shaped(t: float) -> float:
        return 400.0 if (t % 20.0) >= 10.0 else 100.0  # busy second half of every loop

    recs = _steady(base, ttft=shaped)
    sixths = {x.name: x for x in evaluate(recs, [False] * len(recs), [], base, SLOS)}
    assert sixths["drift"].status == "fail"  # 100 ms first sixth vs 400 ms last sixth
    loops = {x.name: x for x in evaluate(recs, [False] * len(recs), [], looped, SLOS)}
    assert loops["drift"].status == "pass", loops["drift"].text
    first, last = drift_windows(recs, looped, SLOS) or (None, None)
    assert first is not None and last is not None
    assert (first.start_s, first.end_s, last.start_s, last.end_s) == (0, 20, 40, 60)
    # Fewer than two whole loops in the phase: not judged, and the text says why.
    long_loops = dataclasses.replace(base, trace_period_s=40.0 * base.base_scale)
    v = {x.name: x for x in evaluate(recs, [False] * len(recs), [], long_loops, SLOS)}
    assert v["drift"].status == "n/a" and "two whole loops" in v["drift"].text
