"""A real trace's clock: 3-second ticks recorded with 1-3 ms of jitter (0, 2999, 3001, 6000 ms).

The tick must be found behind the jitter, bursts counted within 50 ms, and the tick spread
must break them up; a spread over a mis-detected 1 ms tick must not be reported as having
removed a burst that is still there.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from optimizer.types import Trace, TraceRequest
from optimizer.workload.formats import read_trace
from optimizer.workload.shaping import ShapeSpec, shape, spread_ticks
from optimizer.workload.stats import (
    BURST_WINDOW_S,
    clock_tick,
    inspect_trace,
    largest_burst,
    timestamp_resolution,
)

TICK_MS = 3000


def _jittered_rows(ticks: int, seed: int, *, skip_every: int = 0) -> list[int]:
    """Millisecond timestamps: tick k holds 1-6 requests (17 at tick 5), each k * 3000 ms
    moved by -3..+3 ms (never below 0); every ``skip_every``-th tick is empty."""
    rng = np.random.default_rng(seed)
    stamps: list[int] = []
    for k in range(ticks):
        if skip_every and k % skip_every == skip_every - 1:
            continue
        n = 17 if k == 5 else int(rng.integers(1, 7))
        for _ in range(n):
            stamps.append(max(0, k * TICK_MS + int(rng.integers(-3, 4))))
    return sorted(stamps)


def _write_mooncake(path: Path, stamps: list[int]) -> Trace:
    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": t, "input_length": 11_000, "output_length": 8, "hash_ids": [i]}
            )
            + "\n"
            for i, t in enumerate(stamps)
        )
    )
    trace, _ = read_trace(path)
    return trace


def test_the_tick_is_found_behind_the_jitter(tmp_path: Path) -> None:
    trace = _write_mooncake(tmp_path / "conv.jsonl", _jittered_rows(60, seed=1))
    assert timestamp_resolution(trace) == 0.001  # what the literal resolution says
    assert clock_tick(trace) == 3.0
    stats = inspect_trace(trace)
    assert stats["timestamp_resolution_s"] == 0.001
    assert stats["clock_tick_s"] == 3.0
    # The 17 requests of tick 5 no longer share one instant, but they arrive within 7 ms.
    assert stats["max_same_instant_requests"] < 17
    assert stats["burst_window_s"] == BURST_WINDOW_S
    assert stats["max_burst_requests"] == 17
    assert stats["max_burst_prompt_tokens"] == 17 * 11_000
    assert stats["max_burst_requests_at_s"] == pytest.approx(15.0, abs=0.01)


def test_sparse_and_long_jittered_clocks_keep_their_tick(tmp_path: Path) -> None:
    # Every third tick empty: gaps of 3 and 6 s; the tick is still 3 s, not 6.
    sparse = _write_mooncake(tmp_path / "sparse.jsonl", _jittered_rows(60, seed=2, skip_every=3))
    assert clock_tick(sparse) == 3.0
    # 3000 ticks (2.5 hours): the tick is refined from whole gaps, so no drift.
    long = _write_mooncake(tmp_path / "long.jsonl", _jittered_rows(3000, seed=3))
    assert clock_tick(long) == 3.0


def test_no_tick_is_invented_for_arrivals_off_any_grid() -> None:
    rng = np.random.default_rng(4)
    for mean_gap_s in (0.3, 2.0, 10.0):
        arrivals = np.round(np.cumsum(rng.exponential(mean_gap_s, 400)), 3)
        trace = Trace(requests=tuple(TraceRequest(float(t), 10, 2) for t in arrivals))
        assert clock_tick(trace) == timestamp_resolution(trace) == 0.001
    # A clean coarse clock is its own answer.
    clean = Trace(requests=tuple(TraceRequest(3.0 * k, 10, 2) for k in (0, 0, 1, 4, 5)))
    assert clock_tick(clean) == 3.0


def test_spreading_a_jittered_trace_breaks_its_bursts_up(tmp_path: Path) -> None:
    trace = _write_mooncake(tmp_path / "conv.jsonl", _jittered_rows(60, seed=1))
    shaped, report = spread_ticks(trace, seed=7)
    assert "tick 3 s (detected)" in report.detail
    assert report.before["max_burst_requests"] == 17
    assert report.after["max_burst_requests"] <= 3  # 17 requests drawn over 3 s
    assert report.after["max_burst_prompt_tokens"] <= 3 * 11_000
    assert "max_burst_requests: 17 -> " in report.summary()
    # Every request stays within its own tick, in file order.
    new = [r.arrival_s for r in shaped.requests]
    assert new == sorted(new)
    for old, spread in zip(trace.requests, shaped.requests, strict=True):
        assert old.arrival_s <= spread.arrival_s < old.arrival_s + 3.0
        assert old.prefix_blocks == spread.prefix_blocks


def test_a_spread_over_a_too_fine_tick_cannot_claim_the_burst_is_gone(tmp_path: Path) -> None:
    # What happened before: the 1 ms resolution taken as the tick. Requests move by under a
    # millisecond; the report counts bursts within 50 ms, so the burst stays 17.
    trace = _write_mooncake(tmp_path / "conv.jsonl", _jittered_rows(60, seed=1))
    _, report = spread_ticks(trace, tick_s=0.001, seed=7)
    assert report.before["max_burst_requests"] == report.after["max_burst_requests"] == 17
    assert "max_burst_requests" not in report.summary()


def test_a_window_spreads_over_the_tick_found_before_it(tmp_path: Path) -> None:
    trace = _write_mooncake(tmp_path / "conv.jsonl", _jittered_rows(60, seed=1))
    shaped, reports = shape(trace, ShapeSpec(window_s=(10.0, 40.0), spread_ticks=True, seed=1))
    spread = next(r for r in reports if r.step == "spread_ticks")
    assert "tick 3 s (detected before the window)" in spread.detail
    assert spread.before["max_burst_requests"] == 17
    assert largest_burst(shaped, by="requests", within_s=BURST_WINDOW_S).requests <= 3
