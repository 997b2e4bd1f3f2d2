"""The stability plan and its load (pure): phases, scales, looping with fresh prompts, long
inputs."""

from __future__ import annotations

import pytest

from optimizer.errors import ConfigError
from optimizer.stability.plan import (
    PlanSettings,
    build_load,
    build_plan,
    drain_time_s,
    long_input_tokens,
    plan_scales,
    with_trace,
)
from optimizer.types import Trace, TraceRequest


def _trace() -> Trace:
    # 4 requests over 3 s (1 req/s), two of them sharing a prefix block.
    reqs = (
        TraceRequest(10.0, 100, 10, prefix_blocks=(0,)),
        TraceRequest(11.0, 200, 10, prefix_blocks=(0, 1)),
        TraceRequest(12.0, 300, 10),
        TraceRequest(13.0, 400, 10, prefix_blocks=(2,)),
    )
    return Trace(requests=reqs, block_size=16, source="t")


SETTINGS = PlanSettings(
    sustained_s=20, burst_s=4, recovery_s=8, long_input_s=10, long_every_s=5, long_group=3
)


def test_phases_follow_each_other_at_their_scales() -> None:
    plan = build_plan(SETTINGS, base_scale=0.5, burst_scale=3.0, max_model_len=2048)
    assert [(p.name, p.start_s, p.end_s, p.scale) for p in plan.phases] == [
        ("sustained", 0, 20, 0.5),
        ("burst", 20, 24, 3.0),
        ("recovery", 24, 32, 0.5),
        ("long_input", 32, 42, 0.5),
    ]
    assert plan.duration_s == 42
    assert plan.phase_at(21) == "burst" and plan.phase_at(99) == "long_input"
    assert plan.long_input_tokens == 2048 - 32 - 16
    # A phase of zero seconds is left out.
    short = build_plan(
        PlanSettings(sustained_s=5, burst_s=0, recovery_s=0, long_input_s=0),
        base_scale=1,
        burst_scale=3,
        max_model_len=512,
    )
    assert [p.name for p in short.phases] == ["sustained"]


def test_load_loops_the_trace_with_fresh_prefix_blocks() -> None:
    plan = build_plan(SETTINGS, base_scale=0.5, burst_scale=3.0, max_model_len=2048)
    load = build_load(_trace(), plan)
    arrivals = [r.arrival_s for r in load.trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    sustained = [
        r for r, p in zip(load.trace.requests, load.phase_of, strict=True) if p == "sustained"
    ]
    # Rate x0.5: the 3 s trace lasts 6 s, a loop every 8 s (one mean gap between loops).
    assert [r.arrival_s for r in sustained] == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]
    # Each loop's blocks are new; inside a loop the trace's sharing is kept.
    assert sustained[0].prefix_blocks == (0,) and sustained[1].prefix_blocks == (0, 1)
    assert sustained[4].prefix_blocks == (3,) and sustained[5].prefix_blocks == (3, 4)
    assert sustained[8].prefix_blocks == (6,)
    # The burst: the trace at x3 from the burst's start.
    burst = [
        r.arrival_s for r, p in zip(load.trace.requests, load.phase_of, strict=True) if p == "burst"
    ]
    assert burst[:4] == pytest.approx([20, 20 + 1 / 3, 20 + 2 / 3, 21])
    # Every phase tag agrees with the plan's timeline.
    for r, p in zip(load.trace.requests, load.phase_of, strict=True):
        assert plan.phase_at(r.arrival_s) == p


def test_long_inputs_arrive_in_groups_in_their_phase_only() -> None:
    plan = build_plan(SETTINGS, base_scale=0.5, burst_scale=3.0, max_model_len=2048)
    load = build_load(_trace(), plan)
    longs = [r for r, x in zip(load.trace.requests, load.long_input, strict=True) if x]
    assert [r.arrival_s for r in longs] == [34.5] * 3 + [39.5] * 3
    assert all(r.input_tokens == plan.long_input_tokens and r.output_tokens == 16 for r in longs)
    assert all(r.input_tokens + r.output_tokens < 2048 for r in longs)
    phases = {p for p, x in zip(load.phase_of, load.long_input, strict=True) if x}
    assert phases == {"long_input"}
    assert load.count("long_input") == 6 + sum(
        1
        for r, p, x in zip(load.trace.requests, load.phase_of, load.long_input, strict=True)
        if p == "long_input" and not x
    )


def test_scales_of_capacity_and_fixed_load_studies() -> None:
    assert plan_scales(2.0, 0.7, 3.0) == pytest.approx((1.4, 6.0))
    assert plan_scales(None, 0.7, 3.0) == (1.0, 3.0)
    with pytest.raises(ConfigError, match="capacity 0"):
        plan_scales(0.0, 0.7, 3.0)
    with pytest.raises(ConfigError):
        plan_scales(1.0, 0.0, 3.0)


def test_bad_settings_and_lengths_are_refused() -> None:
    with pytest.raises(ConfigError):
        PlanSettings(sustained_s=0)
    with pytest.raises(ConfigError):
        PlanSettings(burst_s=-1)
    with pytest.raises(ConfigError):
        long_input_tokens(16, 16)
    with pytest.raises(ConfigError):
        build_plan(SETTINGS, base_scale=0, burst_scale=1, max_model_len=512)
    with pytest.raises(ConfigError, match="empty"):
        build_load(
            Trace(requests=()), build_plan(SETTINGS, base_scale=1, burst_scale=1, max_model_len=512)
        )


def test_the_bursts_backlog_drains_at_the_spare_capacity() -> None:
    # 20 s at 3x capacity 1.0 leaves 40 s of work; 0.3 spare drains it in 133 s.
    assert drain_time_s(20, 3.0, 0.7, 1.0) == pytest.approx(133.33, rel=1e-3)
    assert drain_time_s(20, 0.9, 0.7, 1.0) is None  # the burst stays within capacity
    assert drain_time_s(20, 3.0, 1.0, 1.0) is None  # nothing spare


def test_the_plan_knows_the_trace_loop_it_is_run_with() -> None:
    plan = build_plan(
        PlanSettings(sustained_s=60, burst_s=0, recovery_s=0, long_input_s=0),
        base_scale=0.5,
        burst_scale=1.0,
        max_model_len=2048,
    )
    assert plan.loop_s() is None and plan.doc()["trace_period_s"] is None
    looped = with_trace(plan, _trace())
    # 3 s of arrivals plus one mean gap (1 s): a 4 s loop, 8 s at half the rate.
    assert looped.trace_period_s == 4.0 and looped.loop_s() == 8.0
    assert looped.doc()["trace_period_s"] == 4.0
    arrivals = [r.arrival_s for r in build_load(_trace(), looped).trace.requests]
    assert arrivals[4] == 8.0  # the second loop starts one loop_s after the first
