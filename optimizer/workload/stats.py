"""Descriptive statistics of a trace: its load, its length distributions and its prefix reuse.

:func:`inspect_trace` is a pure function from a :class:`~optimizer.types.Trace` to a flat dict
of numbers with units in their names (flat so it can be logged as MLflow parameters or metrics
as is); :func:`render_inspect` draws that dict as a ``rich`` table for the CLI. Percentiles use
``numpy.percentile`` (linear), as the metrics of replayed requests do.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from rich.table import Table

from optimizer.types import Trace

__all__ = ["inspect_trace", "prefix_reuse_ratio", "render_inspect"]

_PERCENTILES = (50, 95, 99)


def prefix_reuse_ratio(trace: Trace) -> float:
    """Fraction of prefix-block tokens that an unbounded prefix cache could have served.

    A block counts as reused when the request's blocks up to and including it already
    appeared, in that order, as the leading blocks of an earlier request (prefix caches match
    whole prefixes, not loose blocks). Each block covers ``trace.block_size`` tokens, the last
    one only what is left of the prompt.

    Args:
        trace: The trace.

    Returns:
        Reused block tokens / all block tokens; 0 when the trace has no prefix blocks.
    """
    children: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node: a prefix trie
    total_tokens = reused_tokens = 0
    size = trace.block_size
    for request in trace.requests:
        node = 0
        for position, block in enumerate(request.prefix_blocks):
            tokens = min(size, request.input_tokens - position * size)
            if tokens <= 0:
                break
            total_tokens += tokens
            child = children.get((node, block))
            if child is None:
                child = len(children) + 1
                children[(node, block)] = child
            else:
                reused_tokens += tokens
            node = child
    return reused_tokens / total_tokens if total_tokens else 0.0


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
    ``block_size``, ``prefix_reuse_ratio`` (see :func:`prefix_reuse_ratio`) and ``sessions``
    (distinct session ids, 0 when none are recorded).

    Args:
        trace: The trace.

    Returns:
        The statistics; every number is 0 for an empty trace.
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
    return stats


def _format(value: float | int | str) -> str:
    if isinstance(value, float):
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
        The table, for ``rich.console.Console().print``.
    """
    source = stats.get("source")
    table = Table(title=f"{title}: {source}" if source else title)
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        if key != "source":
            table.add_row(key, _format(value))
    return table
