"""Descriptive statistics of a trace: its load, its length distributions and its prefix reuse.

:func:`inspect_trace` is a pure function from a :class:`~optimizer.types.Trace` to a flat dict
of numbers with units in their names (flat so it can be logged as MLflow parameters or metrics
as is); :func:`render_inspect` draws that dict as a ``rich`` table for the CLI. Percentiles use
``numpy.percentile`` (linear), as the metrics of replayed requests do.

Some traces record arrivals on a coarse clock: the Mooncake conversation trace's timestamps
come in 3-second ticks, so one instant can hold many requests. Real recordings add a little
jitter to the tick (0, 2999, 3001, 6000 ms ...), so the requests of one tick no longer share one
instant exactly: :func:`timestamp_resolution` gives the file's literal resolution (1 ms there),
:func:`clock_tick` the tick behind the jitter (arrivals clustered within
:data:`BURST_WINDOW_S`, the dominant gap between clusters), and :func:`largest_burst` the heaviest
burst, counted within the same tolerance. All of them are in the inspect output.

Times are seconds on the trace's own clock: importers rebase a file so that its first arrival
is 0 s, so a slice cut from a longer trace counts from the slice's own first row, not from the
original trace's start (canonical files keep the times they were written with).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np
from rich.table import Table

from optimizer.types import Trace, TraceRequest

__all__ = [
    "BURST_WINDOW_S",
    "CLOCK_NOTE",
    "Burst",
    "clock_tick",
    "inspect_trace",
    "largest_burst",
    "prefix_reuse_ratio",
    "render_inspect",
    "timestamp_resolution",
]

_PERCENTILES = (50, 95, 99)
_NS_PER_S = 1_000_000_000

CLOCK_NOTE = (
    "times are seconds from the file's own first arrival (imported files start at 0 s; a "
    "slice of a longer trace, e.g. a Mooncake cut, counts from the slice's start, not the "
    "original's); window_s and --window use this clock"
)
"""How to read arrival times and windows, shown by ``trace inspect`` and the window error."""

BURST_WINDOW_S = 0.05
"""Arrivals this close (seconds) count as one burst, and as one tick of a jittered clock.

A server cannot tell 17 requests arriving within a few milliseconds from 17 arriving at one
instant: both land in the same scheduler steps. 50 ms is far above recorded clock jitter (1-3 ms)
and below any TTFT SLO worth tuning for."""

_ON_GRID = 0.9  # share of the gaps between clusters that must be whole ticks
_MIN_GAPS = 4  # fewer gaps between clusters say nothing about a tick


class Burst(NamedTuple):
    """The requests that arrive together: at one instant, or within a stated window.

    Attributes:
        arrival_s: The (first) instant, seconds on the trace's clock.
        requests: How many requests arrive at it (within the window from it).
        prompt_tokens: Their summed input tokens.
    """

    arrival_s: float
    requests: int
    prompt_tokens: int


def prefix_reuse_ratio(trace: Trace, warm: Sequence[TraceRequest] = ()) -> float:
    """Fraction of prefix-block tokens that an unbounded prefix cache could have served.

    A block counts as reused when the request's blocks up to and including it already
    appeared, in that order, as the leading blocks of an earlier request (prefix caches match
    whole prefixes, not loose blocks). Each block covers ``trace.block_size`` tokens, the last
    one only what is left of the prompt.

    Args:
        trace: The trace.
        warm: Requests served before the trace (a window's pre-roll): their prefixes are in
            the cache when the trace starts, and their own tokens are not counted.

    Returns:
        Reused block tokens / all block tokens of ``trace``; 0 when it has no prefix blocks.
    """
    children: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node: a prefix trie
    size = trace.block_size
    for request in warm:
        _walk(children, request, size)
    total_tokens = reused_tokens = 0
    for request in trace.requests:
        total, reused = _walk(children, request, size)
        total_tokens += total
        reused_tokens += reused
    return reused_tokens / total_tokens if total_tokens else 0.0


def _walk(
    children: dict[tuple[int, int], int], request: TraceRequest, size: int
) -> tuple[int, int]:
    """Insert one request's prefix chain into the trie: (its block tokens, those already in)."""
    node = total = reused = 0
    for position, block in enumerate(request.prefix_blocks):
        tokens = min(size, request.input_tokens - position * size)
        if tokens <= 0:
            break
        total += tokens
        child = children.get((node, block))
        if child is None:
            child = len(children) + 1
            children[(node, block)] = child
        else:
            reused += tokens
        node = child
    return total, reused


def timestamp_resolution(trace: Trace) -> float:
    """The tick of the trace's arrival clock, in seconds.

    Rule: every arrival's offset from the first arrival is rounded to whole nanoseconds (which
    absorbs the float noise of unit conversion, e.g. milliseconds times 1e-3), and the tick is
    the greatest common divisor of those offsets: the largest step that every arrival lies on.
    A Mooncake conversation trace written in multiples of 3000 ms gives 3.0, a file with
    millisecond timestamps 0.001 (or a multiple of it, when every timestamp happens to share
    one). Offsets are taken from the first arrival, so a shifted clock (a window) keeps its
    tick; a trace compressed by a non-integer factor typically comes out at (about) 1e-9, i.e.
    no coarse tick.

    Args:
        trace: The trace.

    Returns:
        The tick in seconds; 0.0 when there are no two distinct arrival times.
    """
    if len(trace) < 2:
        return 0.0
    arrivals_s = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    offsets_ns = np.rint((arrivals_s - arrivals_s[0]) * _NS_PER_S).astype(np.int64)
    tick_ns = math.gcd(*(int(v) for v in np.unique(offsets_ns)))
    return tick_ns / _NS_PER_S


def clock_tick(trace: Trace, tolerance_s: float = BURST_WINDOW_S) -> float:
    """The tick of the trace's arrival clock, in seconds, even when the ticks are jittered.

    Rule: arrivals less than ``tolerance_s`` apart form one cluster (a tick's requests, with
    their jitter); the gaps between consecutive clusters' first arrivals are taken, and the
    tick is the largest ``g / k`` (``g`` the median of the most common gaps, binned by
    ``tolerance_s``; ``k`` = 1 ... 6) of which at least 90 % of the gaps are whole multiples,
    within twice the jitter (the 95th percentile of the clusters' widths, at least the literal
    resolution: jitter at both ends), and at least ten times that (so that chance alone cannot
    put 90 % of random gaps on the grid). The tick is then refined as the sum of
    those gaps over the sum of their multiples (no drift over a long trace) and rounded to the
    file's literal resolution. When the literal resolution
    (:func:`timestamp_resolution`) is already coarser than ``2 * tolerance_s``, or no such tick
    exists (arrivals not on a grid, fewer than 4 gaps between clusters, a tick under
    ``2 * tolerance_s``), the literal resolution is the answer.

    A Mooncake conversation trace recorded as 0, 2999, 3001, 6000 ms ... gives 3.0, where the
    literal resolution is 0.001.

    Args:
        trace: The trace.
        tolerance_s: Arrivals this close belong to one tick (> 0).

    Returns:
        The tick in seconds; 0.0 when there are no two distinct arrival times.
    """
    exact = timestamp_resolution(trace)
    if exact == 0.0 or exact >= 2 * tolerance_s:
        return exact
    arrivals_s = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    new_cluster = np.r_[True, np.diff(arrivals_s) >= tolerance_s]
    first = np.flatnonzero(new_cluster)
    last = np.r_[first[1:] - 1, arrivals_s.size - 1]
    gaps = np.diff(arrivals_s[first])
    if gaps.size < _MIN_GAPS:
        return exact
    widths = (arrivals_s[last] - arrivals_s[first])[last > first]
    jitter_s = float(np.percentile(widths, 95)) if widths.size else 0.0
    grid_s = 2 * max(jitter_s, exact)  # a gap off a whole tick by more is off the grid
    bins = np.rint(gaps / tolerance_s).astype(np.int64)
    base = float(np.median(gaps[bins == int(np.argmax(np.bincount(bins)))]))
    for k in range(1, 7):
        tick = base / k
        if tick < max(2 * tolerance_s, 10 * grid_s):  # chance alone puts 20 % on the grid
            break
        multiples = np.rint(gaps / tick)
        on_grid = (multiples >= 1) & (np.abs(gaps - multiples * tick) <= grid_s)
        if on_grid.mean() >= _ON_GRID:
            refined = float(gaps[on_grid].sum() / multiples[on_grid].sum())
            return round(refined / exact) * exact
    return exact


def largest_burst(
    trace: Trace,
    by: Literal["prompt_tokens", "requests"] = "prompt_tokens",
    *,
    within_s: float = 0.0,
) -> Burst:
    """The arrival instant with the most prompt tokens (or the most requests), counting every
    request that arrives within ``within_s`` after it.

    With ``within_s`` 0 requests belong together when their ``arrival_s`` are equal. On a
    coarse clock a whole tick's requests land together, and the replay sends them at once: a
    floor under the time to first token that no engine configuration removes. A jittered clock
    spreads them over a few milliseconds, which changes nothing for the server: count them
    within :data:`BURST_WINDOW_S`.

    Args:
        trace: The trace.
        by: ``prompt_tokens`` (summed input tokens, the prefill work that lands at once) or
            ``requests``; ties go to the earliest instant.
        within_s: Requests arriving up to this many seconds after an instant count with it.

    Returns:
        The burst; ``Burst(0.0, 0, 0)`` for an empty trace.
    """
    if not trace.requests:
        return Burst(0.0, 0, 0)
    arrivals_s = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    tokens = np.array([r.input_tokens for r in trace.requests], dtype=np.int64)
    summed_before = np.r_[0, np.cumsum(tokens)]
    first = np.arange(arrivals_s.size)
    stop = np.searchsorted(arrivals_s, arrivals_s + within_s, side="right")
    counts = stop - first
    summed = summed_before[stop] - summed_before[first]
    index = int(np.argmax(summed if by == "prompt_tokens" else counts))
    return Burst(float(arrivals_s[index]), int(counts[index]), int(summed[index]))


def _peak_count(arrivals_s: np.ndarray, bin_s: float) -> int:
    bins = np.floor((arrivals_s - arrivals_s[0]) / bin_s).astype(np.int64)
    return int(np.bincount(bins).max())


def inspect_trace(trace: Trace) -> dict[str, float | int | str]:
    """Summarize a trace.

    Keys: ``source``, ``requests``, ``duration_s`` (first to last arrival), ``mean_rate_rps``
    (1 / mean inter-arrival gap, i.e. (requests - 1) / duration_s), ``peak_rate_rps`` (most
    arrivals in one 1-second bin, bins aligned on the first arrival), ``peak_rate_rpm`` (same
    with 60-second bins), ``burstiness_cv`` (coefficient of variation of inter-arrival gaps: 1
    for Poisson arrivals, 0 for a fixed rate), ``{p50,p95,p99,max,mean}_{input,output}_tokens``,
    ``block_size``, ``prefix_reuse_ratio`` (see :func:`prefix_reuse_ratio`), ``sessions``
    (distinct session ids, 0 when none are recorded), ``first_arrival_s`` (0 for an imported
    file: times count from its own first arrival), ``timestamp_resolution_s`` (the arrival
    file's literal resolution, see :func:`timestamp_resolution`), ``clock_tick_s`` (the clock's
    tick behind any jitter, see :func:`clock_tick`), ``max_same_instant_requests`` and
    ``max_same_instant_requests_at_s`` (the most requests sharing one arrival time, and that
    time), ``max_same_instant_prompt_tokens`` and ``max_same_instant_prompt_tokens_at_s`` (the
    most input tokens arriving at one time, and that time; see :func:`largest_burst`),
    ``burst_window_s`` (:data:`BURST_WINDOW_S`) and ``max_burst_requests``,
    ``max_burst_prompt_tokens`` (with their ``_at_s``): the same counted over every arrival
    within that window, which a jittered clock does not hide; ``preroll_requests`` (requests a
    window's pre-roll sends before the trace, see :attr:`~optimizer.types.Trace.preroll`) and
    ``prefix_reuse_ratio_warm`` (the prefix reuse the trace sees after its pre-roll; equal to
    ``prefix_reuse_ratio`` without one).

    Args:
        trace: The trace.

    Returns:
        The statistics; every number but the settings (``block_size``, ``burst_window_s``) is
        0 for an empty trace.
    """
    stats: dict[str, float | int | str] = {"source": trace.source, "requests": len(trace)}
    n = len(trace)
    arrivals_s = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    duration_s = float(arrivals_s[-1] - arrivals_s[0]) if n > 1 else 0.0
    gaps_s = np.diff(arrivals_s)
    mean_gap_s = float(gaps_s.mean()) if gaps_s.size else 0.0
    stats["duration_s"] = duration_s
    stats["mean_rate_rps"] = (n - 1) / duration_s if duration_s > 0 else 0.0
    stats["peak_rate_rps"] = _peak_count(arrivals_s, 1.0) if n else 0
    stats["peak_rate_rpm"] = _peak_count(arrivals_s, 60.0) if n else 0
    stats["burstiness_cv"] = float(gaps_s.std() / mean_gap_s) if mean_gap_s > 0 else 0.0
    for kind in ("input", "output"):
        values = np.array([getattr(r, f"{kind}_tokens") for r in trace.requests], dtype=np.float64)
        for q in _PERCENTILES:
            stats[f"p{q}_{kind}_tokens"] = float(np.percentile(values, q)) if n else 0.0
        stats[f"max_{kind}_tokens"] = int(values.max()) if n else 0
        stats[f"mean_{kind}_tokens"] = float(values.mean()) if n else 0.0
    stats["block_size"] = trace.block_size
    stats["prefix_reuse_ratio"] = prefix_reuse_ratio(trace)
    stats["sessions"] = len({r.session_id for r in trace.requests if r.session_id is not None})
    stats["first_arrival_s"] = float(arrivals_s[0]) if n else 0.0
    stats["timestamp_resolution_s"] = timestamp_resolution(trace)
    stats["clock_tick_s"] = clock_tick(trace)
    stats.update(_bursts(trace))
    stats["preroll_requests"] = len(trace.preroll)
    stats["prefix_reuse_ratio_warm"] = (
        prefix_reuse_ratio(trace, trace.preroll) if trace.preroll else stats["prefix_reuse_ratio"]
    )
    return stats


def _bursts(trace: Trace) -> dict[str, float | int]:
    """The largest bursts at one instant and within :data:`BURST_WINDOW_S`."""
    out: dict[str, float | int] = {"burst_window_s": BURST_WINDOW_S}
    for name, within_s in (("same_instant", 0.0), ("burst", BURST_WINDOW_S)):
        by_requests = largest_burst(trace, by="requests", within_s=within_s)
        by_tokens = largest_burst(trace, by="prompt_tokens", within_s=within_s)
        out[f"max_{name}_requests"] = by_requests.requests
        out[f"max_{name}_requests_at_s"] = by_requests.arrival_s
        out[f"max_{name}_prompt_tokens"] = by_tokens.prompt_tokens
        out[f"max_{name}_prompt_tokens_at_s"] = by_tokens.arrival_s
    return out


def _format(value: float | int | str) -> str:
    if isinstance(value, float):
        if 0 < abs(value) < 0.001:
            return f"{value:.3g}"  # e.g. a microsecond clock tick, not 0.000
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return value


def render_inspect(stats: Mapping[str, float | int | str], title: str = "Trace") -> Table:
    """Draw :func:`inspect_trace` output as a two-column ``rich`` table.

    Args:
        stats: The statistics.
        title: Table title; the trace's source is appended when known.

    Returns:
        The table, for ``rich.console.Console().print``; its caption says how to read times
        (:data:`CLOCK_NOTE`).
    """
    source = stats.get("source")
    table = Table(title=f"{title}: {source}" if source else title, caption=CLOCK_NOTE)
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        if key != "source":
            table.add_row(key, _format(value))
    return table
