"""Shaping steps: each keeps its invariant and reports what it changed."""

from __future__ import annotations

import itertools
import math
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


def test_window_error_says_times_count_from_the_file_s_first_arrival() -> None:
    with pytest.raises(ConfigError, match="span 0-9 s") as caught:
        time_window(small(), 100.0, 200.0)
    assert "first arrival" in str(caught.value) and "slice" in str(caught.value)
