"""Shaping steps: each keeps its invariant and reports what it changed."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.errors import ConfigError
from optimizer.types import Trace, TraceRequest
from optimizer.workload.formats import read_trace
from optimizer.workload.shaping import (
    ShapeSpec,
    clip_lengths,
    compress_time,
    scale_lengths,
    scale_rate,
    shape,
    spread_ticks,
    subsample,
    time_window,
)

MOONCAKE_SLICE = Path(__file__).parents[3] / "examples" / "traces" / "mooncake_synthetic_300.jsonl"


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    trace, _ = read_trace(MOONCAKE_SLICE)
    return trace


def small() -> Trace:
    return Trace(
        requests=tuple(TraceRequest(float(i), 100 * (i + 1), 10 * (i + 1)) for i in range(10)),
        block_size=64,
    )


def blocks_fit(request: TraceRequest, block_size: int) -> bool:
    return len(request.prefix_blocks) <= math.ceil(request.input_tokens / block_size)


@pytest.mark.parametrize("factor", [2.0, 10.0, 0.5])
def test_compression_divides_duration_and_keeps_requests(mooncake: Trace, factor: float) -> None:
    shaped, report = compress_time(mooncake, factor)
    assert shaped.duration_s == pytest.approx(mooncake.duration_s / factor)
    assert len(shaped) == len(mooncake)
    for old, new in zip(mooncake.requests, shaped.requests, strict=True):
        assert new.arrival_s == pytest.approx(old.arrival_s / factor)
        assert (new.input_tokens, new.output_tokens, new.prefix_blocks) == (
            old.input_tokens,
            old.output_tokens,
            old.prefix_blocks,
        )
    assert report.step == "compress"
    assert report.after["mean_rate_rps"] == pytest.approx(report.before["mean_rate_rps"] * factor)
    assert report.after["p95_input_tokens"] == report.before["p95_input_tokens"]
    assert report.after["requests"] == report.before["requests"] == 300


def test_compression_to_a_target_duration(mooncake: Trace) -> None:
    shaped, _ = compress_time(mooncake, target_duration_s=30.0)
    assert shaped.duration_s == pytest.approx(30.0)


def test_rate_scale_multiplies_the_rate_by_compressing_time(mooncake: Trace) -> None:
    shaped, report = scale_rate(mooncake, 3.0)
    assert report.step == "rate_scale"
    assert report.after["mean_rate_rps"] == pytest.approx(3 * report.before["mean_rate_rps"])
    assert shaped.duration_s == pytest.approx(mooncake.duration_s / 3)


def test_window_keeps_half_open_interval_and_shifts_to_its_start() -> None:
    shaped, report = time_window(small(), 2.0, 5.0)
    assert [r.arrival_s for r in shaped.requests] == [0.0, 1.0, 2.0]
    assert [r.input_tokens for r in shaped.requests] == [300, 400, 500]
    assert (report.before["requests"], report.after["requests"]) == (10, 3)
    assert report.changed_requests == 10  # 7 removed, 3 shifted
    open_end, _ = time_window(small(), 7.5)
    assert [r.arrival_s for r in open_end.requests] == [0.5, 1.5]


def test_empty_or_inverted_window_raises() -> None:
    with pytest.raises(ConfigError, match="no request"):
        time_window(small(), 100.0, 200.0)
    with pytest.raises(ConfigError):
        time_window(small(), 5.0, 5.0)


@pytest.mark.parametrize("max_model_len", [2048, 600, 2])
def test_clip_honours_max_model_len_and_keeps_blocks_consistent(
    mooncake: Trace, max_model_len: int
) -> None:
    shaped, report = clip_lengths(mooncake, max_model_len)
    assert len(shaped) == len(mooncake)
    for old, new in zip(mooncake.requests, shaped.requests, strict=True):
        assert new.input_tokens + new.output_tokens <= max_model_len
        assert new.input_tokens >= 1 and new.output_tokens >= 1
        assert new.output_tokens == min(old.output_tokens, max_model_len - 1)
        assert new.input_tokens == min(old.input_tokens, max_model_len - new.output_tokens)
        # The surviving blocks are exactly those that still cover part of the prompt.
        assert new.prefix_blocks == old.prefix_blocks[: math.ceil(new.input_tokens / 512)]
        assert blocks_fit(new, shaped.block_size)
    assert report.after["p99_input_tokens"] <= max_model_len
    assert report.changed_requests == sum(
        1 for o, n in zip(mooncake.requests, shaped.requests, strict=True) if o != n
    )


def test_clip_leaves_fitting_requests_alone_and_caps_outputs() -> None:
    trace = Trace(
        requests=(TraceRequest(0.0, 100, 10, (1,)), TraceRequest(1.0, 100, 500, (1,))),
        block_size=64,
    )
    shaped, report = clip_lengths(trace, 1000, max_output_tokens=50)
    assert shaped.requests[0] is trace.requests[0]
    assert (shaped.requests[1].input_tokens, shaped.requests[1].output_tokens) == (100, 50)
    assert report.changed_requests == 1
    assert "max_output_tokens 50" in report.detail


def test_length_scale_multiplies_and_trims_blocks(mooncake: Trace) -> None:
    shaped, report = scale_lengths(mooncake, 0.25, 0.5)
    for old, new in zip(mooncake.requests, shaped.requests, strict=True):
        assert new.input_tokens == max(1, round(old.input_tokens * 0.25))
        assert new.output_tokens == max(1, round(old.output_tokens * 0.5))
        assert blocks_fit(new, shaped.block_size)
        assert new.prefix_blocks == old.prefix_blocks[: len(new.prefix_blocks)]
    assert report.after["p50_input_tokens"] == pytest.approx(
        report.before["p50_input_tokens"] * 0.25, rel=0.01
    )


def test_subsample_is_seeded_sorted_and_sized(mooncake: Trace) -> None:
    a, report = subsample(mooncake, 0.3, seed=11)
    b, _ = subsample(mooncake, 0.3, seed=11)
    c, _ = subsample(mooncake, 0.3, seed=12)
    assert a == b
    assert a.requests != c.requests
    assert len(a) == 90
    original = list(mooncake.requests)
    positions = [original.index(r) for r in a.requests]
    assert positions == sorted(positions)
    assert (report.before["requests"], report.after["requests"], report.changed_requests) == (
        300,
        90,
        210,
    )
    with pytest.raises(ConfigError):
        subsample(mooncake, 0.0)


def test_shape_applies_steps_in_a_fixed_order_and_reports_each(mooncake: Trace) -> None:
    spec = ShapeSpec(
        window_s=(0.0, 60.0),
        sample_fraction=0.5,
        compress=2.0,
        rate_scale=1.5,
        length_scale=0.5,
        max_model_len=1024,
        seed=3,
    )
    shaped, reports = shape(mooncake, spec)
    assert [r.step for r in reports] == [
        "window",
        "subsample",
        "compress",
        "rate_scale",
        "length_scale",
        "clip",
    ]
    for earlier, later in itertools.pairwise(reports):
        assert later.before == earlier.after
    assert reports[-1].after["requests"] == len(shaped)
    assert all(r.input_tokens + r.output_tokens <= 1024 for r in shaped.requests)
    assert all(blocks_fit(r, shaped.block_size) for r in shaped.requests)
    assert shaped.duration_s < 60.0 / 3
    again, _ = shape(mooncake, spec)
    assert again == shaped
    assert "clip: max_model_len 1024" in reports[-1].summary()


def test_shape_with_an_empty_spec_changes_nothing(mooncake: Trace) -> None:
    shaped, reports = shape(mooncake, ShapeSpec())
    assert shaped == mooncake and reports == []


def test_shape_rejects_contradictory_specs(mooncake: Trace) -> None:
    with pytest.raises(ConfigError):
        shape(mooncake, ShapeSpec(compress=2.0, target_duration_s=10.0))
    with pytest.raises(ConfigError, match="max_model_len"):
        shape(mooncake, ShapeSpec(max_output_tokens=10))
    with pytest.raises(ConfigError):
        shape(mooncake, ShapeSpec(rate_scale=-1.0))


def ticked() -> Trace:
    """A 3-second clock: 3 requests at 0 s, 1 at 3 s, 4 at 6 s, 2 at 12 s (sessions kept)."""
    arrivals = [0.0, 0.0, 0.0, 3.0, 6.0, 6.0, 6.0, 6.0, 12.0, 12.0]
    return Trace(
        requests=tuple(
            TraceRequest(t, 100 + i, 10 + i, (i,), session_id=f"s{i % 3}")
            for i, t in enumerate(arrivals)
        ),
        block_size=64,
        source="ticks",
    )


def test_spread_ticks_stays_within_each_tick_and_keeps_every_request() -> None:
    trace = ticked()
    shaped, report = spread_ticks(trace, seed=5)
    assert report.step == "spread_ticks"
    assert "tick 3 s (detected)" in report.detail and "3 shared ticks" in report.detail
    assert len(shaped) == len(trace)
    new = [r.arrival_s for r in shaped.requests]
    assert new == sorted(new)
    for old, spread in zip(trace.requests, shaped.requests, strict=True):
        # Same request in the same position; only its arrival moved, within its tick.
        assert replace(spread, arrival_s=old.arrival_s) == old
        assert old.arrival_s <= spread.arrival_s < old.arrival_s + 3.0
    assert shaped.requests[3].arrival_s == 3.0  # alone at its instant: not moved
    assert report.changed_requests == 9  # 3 + 4 + 2 shared
    assert report.before["max_burst_requests"] == 4
    assert report.after["max_burst_requests"] <= 2  # within 50 ms, drawn over 3 s
    assert report.after["requests"] == report.before["requests"] == 10
    assert report.after["p50_input_tokens"] == report.before["p50_input_tokens"]
    assert f"max_burst_requests: 4 -> {report.after['max_burst_requests']:g}" in report.summary()


def test_spread_ticks_is_seeded() -> None:
    a, _ = spread_ticks(ticked(), seed=1)
    b, _ = spread_ticks(ticked(), seed=1)
    c, _ = spread_ticks(ticked(), seed=2)
    assert a == b
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in c.requests]


def test_a_given_tick_never_reorders_across_instants() -> None:
    # A 10 s tick overlaps the next instants: each group stops short of the next instant.
    shaped, report = spread_ticks(ticked(), 10.0, seed=0)
    assert "tick 10 s (given)" in report.detail
    new = [r.arrival_s for r in shaped.requests]
    assert all(0.0 <= t < 3.0 for t in new[:3])
    assert new[3] == 3.0
    assert all(6.0 <= t < 12.0 for t in new[4:8])
    assert all(12.0 <= t < 22.0 for t in new[8:])
    assert new == sorted(new)


def test_spread_ticks_of_the_shipped_slice_keeps_its_order_invariant_properties(
    mooncake: Trace,
) -> None:
    # The slice's clock ticks in milliseconds; only its first instant holds two requests.
    shaped, report = spread_ticks(mooncake, seed=0)
    assert "tick 0.001 s (detected)" in report.detail
    assert report.changed_requests == 2
    assert sorted((r.input_tokens, r.output_tokens, r.prefix_blocks) for r in shaped.requests) == (
        sorted((r.input_tokens, r.output_tokens, r.prefix_blocks) for r in mooncake.requests)
    )
    assert all(0.0 <= r.arrival_s < 0.001 for r in shaped.requests[:2])
    assert shaped.requests[2:] == mooncake.requests[2:]


def test_a_trace_without_shared_instants_is_unchanged() -> None:
    shaped, report = spread_ticks(small(), seed=3)
    assert shaped == small()
    assert report.changed_requests == 0
    assert "0 shared ticks" in report.detail


def test_spread_ticks_needs_a_tick() -> None:
    one_instant = Trace(requests=(TraceRequest(0.0, 1, 1), TraceRequest(0.0, 2, 1)))
    with pytest.raises(ConfigError, match="tick_s"):
        spread_ticks(one_instant)
    shaped, report = spread_ticks(one_instant, 0.5, seed=0)
    assert all(0.0 <= r.arrival_s < 0.5 for r in shaped.requests) and report.changed_requests
    with pytest.raises(ConfigError, match="tick_s"):
        spread_ticks(ticked(), 0.0)
    with pytest.raises(ConfigError, match="spread_ticks"):
        shape(ticked(), ShapeSpec(tick_s=3.0))


def test_shape_spreads_ticks_after_the_window_and_before_compressing() -> None:
    spec = ShapeSpec(window_s=(6.0, None), spread_ticks=True, compress=2.0, seed=4)
    shaped, reports = shape(ticked(), spec)
    assert [r.step for r in reports] == ["window", "preroll", "spread_ticks", "compress"]
    # The window keeps only instants 0 s and 6 s (a 6 s grid): the tick comes from the file.
    assert "tick 3 s (detected before the window)" in reports[2].detail
    assert reports[2].changed_requests == 6
    # Spread on the recorded clock, then halved: the first four land in [0, 1.5) s.
    assert all(0.0 <= r.arrival_s < 1.5 for r in shaped.requests[:4])
    assert all(3.0 <= r.arrival_s < 4.5 for r in shaped.requests[4:])


def test_window_error_says_times_count_from_the_file_s_first_arrival() -> None:
    with pytest.raises(ConfigError, match="span 0-9 s") as caught:
        time_window(small(), 100.0, 200.0)
    assert "first arrival" in str(caught.value) and "slice" in str(caught.value)


def test_shape_without_a_window_detects_the_tick_on_the_trace_itself() -> None:
    _, reports = shape(ticked(), ShapeSpec(spread_ticks=True, tick_s=None, seed=1))
    assert [r.step for r in reports] == ["spread_ticks"]
    assert "tick 3 s (detected)" in reports[0].detail


def test_cli_flags_and_config_section_reach_the_shape_spec() -> None:
    import argparse

    from optimizer.cli_trace import _add_shaping, shape_spec_from
    from optimizer.config import ShapingSection

    parser = argparse.ArgumentParser()
    _add_shaping(parser)
    spec = shape_spec_from(parser.parse_args(["--spread-ticks", "--tick-s", "3", "--seed", "7"]))
    assert (spec.spread_ticks, spec.tick_s, spec.seed) == (True, 3.0, 7)
    assert shape_spec_from(parser.parse_args([])).spread_ticks is False
    section = ShapingSection(spread_ticks=True, tick_s=3.0)
    assert ShapeSpec(**section.model_dump()) == ShapeSpec(spread_ticks=True, tick_s=3.0)
    with pytest.raises(ValueError):
        ShapingSection(tick_s=0.0)


def test_output_scale_gives_answers_their_own_multiplier(mooncake: Trace) -> None:
    # A job's shaping: prompts x0.25 (length_scale), answers x0.5 (output_scale); output_scale
    # alone keeps the prompts.
    both, _ = shape(mooncake, ShapeSpec(length_scale=0.25, output_scale=0.5))
    alone, _ = shape(mooncake, ShapeSpec(output_scale=2.0))
    for old, new, kept in zip(mooncake.requests, both.requests, alone.requests, strict=True):
        assert new.input_tokens == max(1, round(old.input_tokens * 0.25))
        assert new.output_tokens == max(1, round(old.output_tokens * 0.5))
        assert kept.input_tokens == old.input_tokens
        assert kept.output_tokens == round(old.output_tokens * 2.0)
