"""Trace statistics on a hand-made trace whose numbers are worked out by hand."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from optimizer.types import Trace, TraceRequest
from optimizer.workload.formats import read_trace
from optimizer.workload.stats import (
    Burst,
    inspect_trace,
    largest_burst,
    prefix_reuse_ratio,
    render_inspect,
    timestamp_resolution,
)

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
    settings = ("source", "block_size", "burst_window_s")
    assert all(v == 0 for k, v in empty.items() if k not in settings)
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


EXAMPLES = Path(__file__).parents[3] / "examples" / "traces"


def test_timestamp_resolution_of_the_shipped_slices() -> None:
    # Mooncake's synthetic trace stamps arrivals in whole milliseconds (offsets 40, 277, 471 ...
    # share no larger divisor); the conversation trace's 3-second ticks are tested below.
    mooncake, _ = read_trace(EXAMPLES / "mooncake_synthetic_300.jsonl")
    assert timestamp_resolution(mooncake) == 0.001
    assert inspect_trace(mooncake)["timestamp_resolution_s"] == 0.001
    # Azure 2023 writes 7 fractional digits, but every one of these 600 rows ends in "0":
    # the clock ticks in microseconds, finer than a millisecond.
    azure, _ = read_trace(EXAMPLES / "azure2023_code_600.csv")
    assert timestamp_resolution(azure) == pytest.approx(1e-6)
    assert inspect_trace(azure)["max_same_instant_requests"] == 1


def _three_second_ticks(tmp_path: Path) -> Trace:
    """A Mooncake file on a 3000 ms clock, as the conversation trace is (6 rows, 3 instants)."""
    rows = [
        (3000, 1000),
        (3000, 2000),
        (6000, 500),
        (12000, 100),
        (12000, 200),
        (12000, 300),
    ]
    path = tmp_path / "conversation.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": []})
            + "\n"
            for t, n in rows
        )
    )
    trace, _ = read_trace(path)
    return trace


def test_three_second_ticks_are_detected_and_the_clock_is_the_file_s_own(tmp_path: Path) -> None:
    trace = _three_second_ticks(tmp_path)
    stats = inspect_trace(trace)
    assert stats["timestamp_resolution_s"] == 3.0
    # Rebased: the file's first arrival (3000 ms) is 0 s, the others 3 s and 9 s after it.
    assert stats["first_arrival_s"] == 0.0
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.0, 3.0, 9.0, 9.0, 9.0]
    # By hand: 3 requests share 9 s (100 + 200 + 300 = 600 tokens); 2 share 0 s with
    # 1000 + 2000 = 3000 tokens, the heaviest instant.
    assert stats["max_same_instant_requests"] == 3
    assert stats["max_same_instant_requests_at_s"] == 9.0
    assert stats["max_same_instant_prompt_tokens"] == 3000
    assert stats["max_same_instant_prompt_tokens_at_s"] == 0.0
    assert largest_burst(trace) == Burst(0.0, 2, 3000)
    assert largest_burst(trace, by="requests") == (9.0, 3, 600)


def test_resolution_ignores_float_noise_and_a_shifted_clock() -> None:
    # 0.1 s steps written as floats that are not exact (0.1 * 3 != 0.3), shifted by 7.05 s.
    trace = Trace(requests=tuple(TraceRequest(7.05 + k * 0.1, 1, 1) for k in (0, 1, 3, 7, 30)))
    assert timestamp_resolution(trace) == pytest.approx(0.1)
    assert timestamp_resolution(Trace(requests=(TraceRequest(0.0, 1, 1),) * 3)) == 0.0
    assert timestamp_resolution(Trace(requests=())) == 0.0


def test_burst_numbers_on_the_shipped_mooncake_slice() -> None:
    # Worked out from the file: only timestamp 0 holds two rows (40160 + 36640 input
    # tokens); the heaviest instant is the single 134773-token request at 73790 ms.
    mooncake, _ = read_trace(EXAMPLES / "mooncake_synthetic_300.jsonl")
    stats = inspect_trace(mooncake)
    assert (stats["max_same_instant_requests"], stats["max_same_instant_requests_at_s"]) == (2, 0.0)
    assert stats["max_same_instant_prompt_tokens"] == 134773
    assert stats["max_same_instant_prompt_tokens_at_s"] == pytest.approx(73.79)
    assert largest_burst(mooncake, by="requests") == Burst(0.0, 2, 40160 + 36640)


def test_no_shared_instant_means_bursts_of_one() -> None:
    stats = inspect_trace(HAND)
    assert stats["max_same_instant_requests"] == 1
    assert stats["max_same_instant_prompt_tokens"] == 500
    assert stats["max_same_instant_prompt_tokens_at_s"] == 61.0
    assert stats["timestamp_resolution_s"] == pytest.approx(0.1)
    assert largest_burst(Trace(requests=())) == Burst(0.0, 0, 0)


def test_render_inspect_says_how_to_read_times() -> None:
    console = Console(record=True, width=200)
    console.print(render_inspect(inspect_trace(HAND)))
    text = " ".join(console.export_text().split())  # the caption wraps
    assert "timestamp_resolution_s" in text and "max_same_instant_prompt_tokens" in text
    assert "seconds from the file's own first arrival" in text and "slice" in text
