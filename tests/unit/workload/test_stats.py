"""Trace statistics on a hand-made trace whose numbers are worked out by hand."""

from __future__ import annotations

import statistics

import pytest
from rich.console import Console
from rich.table import Table

from optimizer.types import Trace, TraceRequest
from optimizer.workload.stats import inspect_trace, prefix_reuse_ratio, render_inspect

ARRIVALS_S = [0.0, 0.5, 0.9, 2.0, 61.0]
HAND = Trace(
    requests=(
        TraceRequest(0.0, 100, 10, session_id="a"),
        TraceRequest(0.5, 200, 20, session_id="b"),
        TraceRequest(0.9, 300, 30, session_id="a"),
        TraceRequest(2.0, 400, 40),
        TraceRequest(61.0, 500, 1000),
    ),
    block_size=16,
    source="hand",
)


def test_load_numbers() -> None:
    stats = inspect_trace(HAND)
    assert stats["requests"] == 5
    assert stats["duration_s"] == 61.0
    assert stats["mean_rate_rps"] == pytest.approx(4 / 61)
    assert stats["peak_rate_rps"] == 3  # 0.0, 0.5, 0.9 share the first second
    assert stats["peak_rate_rpm"] == 4  # all but the request at 61 s
    gaps = [0.5, 0.4, 1.1, 59.0]
    assert stats["burstiness_cv"] == pytest.approx(statistics.pstdev(gaps) / statistics.fmean(gaps))
    assert stats["sessions"] == 2
    assert stats["source"] == "hand"


def test_length_percentiles_are_linear() -> None:
    stats = inspect_trace(HAND)
    assert stats["p50_input_tokens"] == 300
    assert stats["p95_input_tokens"] == pytest.approx(480)  # 400 + 0.8 * 100
    assert stats["p99_input_tokens"] == pytest.approx(496)
    assert stats["max_input_tokens"] == 500
    assert stats["mean_input_tokens"] == 300
    assert stats["p50_output_tokens"] == 30
    assert stats["p95_output_tokens"] == pytest.approx(40 + 0.8 * 960)
    assert stats["max_output_tokens"] == 1000
    assert stats["mean_output_tokens"] == pytest.approx(1100 / 5)


def test_prefix_reuse_counts_tokens_of_whole_prefix_matches() -> None:
    trace = Trace(
        requests=(
            TraceRequest(0.0, 8, 1, (1, 2)),  # 8 new tokens
            TraceRequest(1.0, 10, 1, (1, 2, 3)),  # 8 reused, block 3 covers 2 new tokens
            TraceRequest(2.0, 4, 1, (2,)),  # block 2 not at the start before: 4 new
            TraceRequest(3.0, 3, 1, (1, 2)),  # only 3 tokens of block 1, reused
        ),
        block_size=4,
    )
    assert prefix_reuse_ratio(trace) == pytest.approx((8 + 3) / (8 + 10 + 4 + 3))
    assert inspect_trace(trace)["prefix_reuse_ratio"] == pytest.approx(11 / 25)


def test_no_prefix_blocks_means_no_reuse() -> None:
    assert inspect_trace(HAND)["prefix_reuse_ratio"] == 0.0


def test_regular_arrivals_have_zero_burstiness() -> None:
    trace = Trace(requests=tuple(TraceRequest(i * 0.25, 1, 1) for i in range(9)))
    stats = inspect_trace(trace)
    assert stats["burstiness_cv"] == pytest.approx(0.0, abs=1e-12)
    assert stats["mean_rate_rps"] == pytest.approx(4.0)
    assert stats["peak_rate_rps"] == 4


def test_empty_and_single_request_traces() -> None:
    empty = inspect_trace(Trace(requests=()))
    assert empty["requests"] == 0
    assert all(v == 0 for k, v in empty.items() if k != "source" and k != "block_size")
    single = inspect_trace(Trace(requests=(TraceRequest(3.0, 7, 2),)))
    assert (single["requests"], single["duration_s"], single["mean_rate_rps"]) == (1, 0.0, 0.0)
    assert (single["peak_rate_rps"], single["p99_input_tokens"]) == (1, 7)


def test_render_inspect_lists_every_statistic() -> None:
    stats = inspect_trace(HAND)
    table = render_inspect(stats)
    assert isinstance(table, Table)
    assert table.row_count == len(stats) - 1  # the source goes into the title
    console = Console(record=True, width=100)
    console.print(table)
    text = console.export_text()
    assert "peak_rate_rps" in text and "hand" in text
