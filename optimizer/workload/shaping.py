"""Shaping a trace for one trial: cut a window (with a pre-roll that warms the prefix cache),
spread coarse ticks, compress time, scale the rate, fit lengths.

A production trace rarely fits a trial as recorded: it lasts hours, its prompts exceed the
model's ``max-model-len``, or its rate is far from what one GPU serves. Each step here is a pure
function ``Trace -> (Trace, ShapeReport)`` whose report states what it changed (request count,
rate, length percentiles, prefix reuse, before and after), so a study can say exactly which
workload it tuned for. :func:`shape` applies the steps a :class:`ShapeSpec` asks for, in a fixed
order: window, pre-roll, tick spread, subsample, compress, rate scale, length scale, length
clip. The pre-roll (the requests before a window, :attr:`~optimizer.types.Trace.preroll`) is
never replayed on the trace's clock nor measured; only the length steps change it, so its prefix
blocks stay those of the window's requests. The tick spread runs on the recorded clock: after
the window (which cuts on recorded instants, so a tick's requests are kept or dropped together)
and before any step that divides time (after which the tick is no longer the file's, and a given
``tick_s`` would not be in the file's seconds); before the subsample, so the spread times do not
depend on the sample fraction. The clip comes last so ``max_model_len`` holds for the trace that
is replayed.

Times are seconds on the trace's own clock, which for an imported file starts at its first
arrival (see :data:`~optimizer.workload.stats.CLOCK_NOTE`): a window over a slice of a longer
trace counts from the slice's start.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from optimizer.errors import ConfigError
from optimizer.types import Trace, TraceRequest
from optimizer.workload.stats import (
    BURST_WINDOW_S,
    CLOCK_NOTE,
    clock_tick,
    inspect_trace,
    prefix_reuse_ratio,
)

__all__ = [
    "ShapeReport",
    "ShapeSpec",
    "clip_lengths",
    "compress_time",
    "covering_preroll_s",
    "preroll",
    "preroll_left_out",
    "preroll_trace",
    "scale_lengths",
    "scale_rate",
    "shape",
    "spread_ticks",
    "subsample",
    "time_window",
    "warm_set",
]

_REPORTED = (
    "requests",
    "duration_s",
    "mean_rate_rps",
    "p50_input_tokens",
    "p95_input_tokens",
    "p99_input_tokens",
    "p50_output_tokens",
    "p95_output_tokens",
    "p99_output_tokens",
    "prefix_reuse_ratio",
    "prefix_reuse_ratio_warm",
    "preroll_requests",
    "max_burst_requests",
    "max_burst_prompt_tokens",
)


@dataclass(frozen=True, slots=True)
class ShapeReport:
    """What one shaping step did.

    Attributes:
        step: The step's name (``window``, ``spread_ticks``, ``subsample``, ``compress``,
            ``rate_scale``, ``length_scale``, ``clip``).
        detail: The step's parameters in words.
        changed_requests: Requests removed, or whose arrival or lengths were altered.
        before: Request count, duration, mean rate, input/output P50/P95/P99, prefix reuse
            ratio (cold, and after the pre-roll), pre-roll requests and largest burst (requests,
            prompt tokens; arrivals within
            :data:`~optimizer.workload.stats.BURST_WINDOW_S` count as one burst, so a spread
            that only moves a jittered tick's requests by a millisecond cannot claim it gone)
            of the input trace (keys as in :func:`~optimizer.workload.stats.inspect_trace`).
        after: The same for the output trace.
    """

    step: str
    detail: str
    changed_requests: int
    before: Mapping[str, float]
    after: Mapping[str, float]

    def summary(self) -> str:
        """One line per changed statistic, for logs and the CLI."""
        lines = [f"{self.step}: {self.detail} ({self.changed_requests} requests changed)"]
        for key in _REPORTED:
            old, new = self.before[key], self.after[key]
            if old != new:
                lines.append(f"  {key}: {old:g} -> {new:g}")
        return "\n".join(lines)


def _numbers(trace: Trace) -> dict[str, float]:
    stats = inspect_trace(trace)
    return {key: float(stats[key]) for key in _REPORTED}


def _report(step: str, detail: str, changed: int, before: Trace, after: Trace) -> ShapeReport:
    return ShapeReport(step, detail, changed, _numbers(before), _numbers(after))


def _with(trace: Trace, requests: list[TraceRequest] | tuple[TraceRequest, ...]) -> Trace:
    return replace(trace, requests=tuple(requests))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def time_window(
    trace: Trace, start_s: float, end_s: float | None = None
) -> tuple[Trace, ShapeReport]:
    """Keep the requests arriving in ``[start_s, end_s)`` and shift them to start at 0 s.

    Arrivals are shifted by ``start_s`` (not by the first kept arrival), so an idle start of
    the window stays idle. Times are seconds on the trace's clock, which for an imported file
    starts at its own first arrival: for a slice of a longer trace (e.g. a Mooncake cut), 0 s
    is the slice's start, not the original trace's.

    Args:
        trace: The trace.
        start_s: Window start, seconds on the trace's clock (>= 0).
        end_s: Window end (exclusive); None for the end of the trace.

    Returns:
        The windowed trace and its report.

    Raises:
        ConfigError: The window is empty or inverted.
    """
    _check(start_s >= 0, f"window start_s must be >= 0, got {start_s}")
    _check(end_s is None or end_s > start_s, f"window end_s must be > start_s, got {end_s}")
    kept = [
        replace(r, arrival_s=r.arrival_s - start_s)
        for r in trace.requests
        if r.arrival_s >= start_s and (end_s is None or r.arrival_s < end_s)
    ]
    detail = f"[{start_s:g}, {'end' if end_s is None else f'{end_s:g}'}) s"
    first_s = trace.requests[0].arrival_s if trace.requests else 0.0
    last_s = trace.requests[-1].arrival_s if trace.requests else 0.0
    _check(
        bool(kept),
        f"window {detail} holds no request: the trace's arrivals span {first_s:g}-{last_s:g} s; "
        f"{CLOCK_NOTE}",
    )
    shaped = _with(trace, kept)
    removed = len(trace) - len(kept)
    changed = removed + (len(kept) if start_s else 0)  # a shift moves every kept arrival
    return shaped, _report("window", detail, changed, trace, shaped)


def preroll(
    trace: Trace, start_s: float, end_s: float | None, preroll_s: float | None = None
) -> tuple[Trace, ShapeReport]:
    """Window ``[start_s, end_s)`` of ``trace`` with a pre-roll: the requests of the stretch
    before it, kept as :attr:`~optimizer.types.Trace.preroll` to warm the prefix cache.

    A window from the middle of a conversation trace starts where production's server has
    the earlier turns' prefixes cached; a replay that starts cold sees less prefix reuse
    (5 % instead of 37 % on a 30-second cut) and judges prefix caching and the KV cache's size
    on the wrong workload. The replay sends the pre-roll before the trace (prefix blocks only,
    one output token; :func:`preroll_trace`) and measures none of it.

    What is kept: ``preroll_s`` given: every request of the ``preroll_s`` seconds before the
    window (0: none). None (the default): the window's warm set (:func:`warm_set`), one
    prefill-only request per distinct prefix chain the window reuses from an earlier request,
    however long ago it was sent. On a conversation trace the stretch that covers every
    reference held 20x the window's requests (issue 34); the warm set sends what the window hits.

    Args:
        trace: The whole trace (before the window).
        start_s: Window start, seconds on the trace's clock.
        end_s: Window end (exclusive); None for the end of the trace.
        preroll_s: The stretch in seconds (>= 0); None: cover the window's references.

    Returns:
        The windowed trace with its pre-roll (arrivals relative to ``start_s``) and a report
        whose ``before`` is the window alone and ``after`` the window with its pre-roll
        (``prefix_reuse_ratio_warm``: the reuse the window sees after the pre-roll).

    Raises:
        ConfigError: ``preroll_s`` is negative or not finite; the window is invalid.
    """
    _check(
        preroll_s is None or (preroll_s >= 0 and math.isfinite(preroll_s)),
        f"trace.shaping.preroll_s must be >= 0 seconds (0: no pre-roll), got {preroll_s}",
    )
    window, _ = time_window(trace, start_s, end_s)
    if preroll_s is None:
        before = list(warm_set(trace, start_s, end_s))
        covered = covering_preroll_s(trace, start_s, end_s)
        what = (
            f"{len(before)} prefix chains the window reuses from earlier requests "
            f"({sum(r.input_tokens for r in before):,} tokens, one prefill-only request each; "
            f"the stretch that holds them: {covered:g} s, "
            f"{_count_between(trace, start_s - covered, start_s)} requests)"
        )
    else:
        before = [
            replace(r, arrival_s=r.arrival_s - start_s)
            for r in trace.requests
            if start_s - preroll_s <= r.arrival_s < start_s and preroll_s > 0
        ]
        what = f"{len(before)} requests of the {preroll_s:g} s before the window (given)"
    shaped = replace(window, preroll=tuple(before))
    detail = (
        f"{what} warm the prefix cache; the window's prefix reuse "
        f"{prefix_reuse_ratio(window):.1%} cold, {prefix_reuse_ratio(window, before):.1%} "
        "after the pre-roll"
    )
    return shaped, _report("preroll", detail, len(before), window, shaped)


def _count_between(trace: Trace, lo: float, hi: float) -> int:
    return sum(1 for r in trace.requests if lo <= r.arrival_s < hi)


def warm_set(trace: Trace, start_s: float, end_s: float | None) -> tuple[TraceRequest, ...]:
    """What the window ``[start_s, end_s)`` hits of the prefix cache that the requests before
    it left: one prefill-only request per distinct prefix chain.

    For each window request, the longest run of its leading prefix blocks that a request
    before the window also began with (whole prefixes, as prefix caches match) is a chain; its
    tokens are the most any window request shares of it. A chain that another chain extends is
    left out (sending the longer one caches it). The chains come in the order of the prompt
    tokens the window reuses from each (most first, ties longest first): what a bounded cache
    should keep (:func:`preroll_trace`'s ``max_tokens``). Each request's ``arrival_s`` is the
    chain's last use before the window, relative to ``start_s`` (negative); it has one output
    token and the session of the first window request that uses it. Requests of the window
    that share nothing with earlier ones add nothing.
    """
    size = trace.block_size
    children: dict[tuple[int, int], int] = {}
    last_seen: dict[int, float] = {}
    held: dict[int, int] = {}  # node -> the most prompt tokens an earlier request had through it
    for r in trace.requests:
        if r.arrival_s >= start_s:
            break
        node = 0
        for depth, block in enumerate(r.prefix_blocks[: _block_count(r, size)], start=1):
            node = children.setdefault((node, block), len(children) + 1)
            last_seen[node] = r.arrival_s
            held[node] = max(held.get(node, 0), min(depth * size, r.input_tokens))
    tokens: dict[tuple[int, ...], int] = {}  # chain -> the most tokens a window request shares
    reused: dict[tuple[int, ...], int] = {}  # chain -> tokens the window reuses from it
    ends: dict[tuple[int, ...], int] = {}  # chain -> its last trie node
    session: dict[tuple[int, ...], str | None] = {}  # chain -> the first window session using it
    for r in trace.requests:
        if r.arrival_s < start_s or (end_s is not None and r.arrival_s >= end_s):
            continue
        blocks = r.prefix_blocks[: _block_count(r, size)]
        node, depth = 0, 0
        for block in blocks:
            child = children.get((node, block))
            if child is None:
                break
            node, depth = child, depth + 1
        if not depth:
            continue
        chain = tuple(blocks[:depth])
        shared = min(depth * size, r.input_tokens, held[node])
        tokens[chain] = max(tokens.get(chain, 0), shared)
        reused[chain] = reused.get(chain, 0) + shared
        ends[chain] = node
        session.setdefault(chain, r.session_id)
    inner = {chain[:i] for chain in tokens for i in range(1, len(chain))}
    kept = [c for c in tokens if c not in inner]
    kept.sort(key=lambda c: (-reused[c], -tokens[c]))
    return tuple(
        TraceRequest(last_seen[ends[c]] - start_s, tokens[c], 1, c, session[c]) for c in kept
    )


def covering_preroll_s(trace: Trace, start_s: float, end_s: float | None) -> float:
    """Seconds before ``start_s`` that hold, for every request of the window
    ``[start_s, end_s)``, the last earlier arrival of the longest prefix it shares with the
    requests before the window (0.0 when it shares none). See :func:`preroll`."""
    last_seen: dict[int, float] = {}  # trie node -> last arrival before the window
    children: dict[tuple[int, int], int] = {}
    for r in trace.requests:
        if r.arrival_s >= start_s:
            break
        node = 0
        for block in r.prefix_blocks[: _block_count(r, trace.block_size)]:
            node = children.setdefault((node, block), len(children) + 1)
            last_seen[node] = r.arrival_s
    earliest = start_s
    for r in trace.requests:
        if r.arrival_s < start_s or (end_s is not None and r.arrival_s >= end_s):
            continue
        node, found = 0, None
        for block in r.prefix_blocks[: _block_count(r, trace.block_size)]:
            child = children.get((node, block))
            if child is None:
                break
            node, found = child, last_seen[child]
        if found is not None:
            earliest = min(earliest, found)
    covered = start_s - earliest
    # In floats start - (start - earliest) can land above earliest (545.892 - 300.518 is
    # 245.37400000000002, not 245.374): widen by ulps until the stretch holds that request.
    while start_s - covered > earliest:
        covered = math.nextafter(covered, math.inf)
    return covered


def _block_count(request: TraceRequest, block_size: int) -> int:
    """How many of the request's prefix blocks lie (at least partly) inside its prompt."""
    return min(len(request.prefix_blocks), -(-request.input_tokens // block_size))


def preroll_trace(trace: Trace, max_tokens: int | None = None) -> Trace:
    """What a replay sends to warm the prefix cache for ``trace``: a trace of its pre-roll.

    Each pre-roll request becomes a prompt of its prefix blocks only (the tokens of a block
    depend on the block id and the replay's seed alone, so they are the tokens the trace's
    requests will send), one output token, all arriving at 0 s, longest first. A chain of
    blocks that another pre-roll request extends is left out (sending the longer one caches
    it), as are requests without prefix blocks. With ``max_tokens`` (the server's KV cache, in
    tokens), chains are kept in the pre-roll's order (for the default pre-roll, what the window
    reuses most: :func:`warm_set`) while they fit; the rest is left out, and
    :func:`preroll_left_out` says how much.

    Args:
        trace: A trace with a pre-roll (an empty one gives an empty trace).
        max_tokens: Send at most this many prompt tokens (None: all).

    Returns:
        The warm-up trace (no pre-roll of its own).
    """
    size = trace.block_size
    children: dict[tuple[int, int], int] = {}
    extended: set[int] = set()
    ends: dict[int, TraceRequest] = {}  # chain's last node -> the request that sends it
    for r in trace.preroll:
        tokens = min(len(r.prefix_blocks) * size, r.input_tokens)
        if tokens <= 0:
            continue
        blocks = r.prefix_blocks[: -(-tokens // size)]
        node = 0
        for block in blocks:
            extended.add(node)
            node = children.setdefault((node, block), len(children) + 1)
        kept = ends.pop(node, None)  # re-inserted: the order is that of last use
        if kept is None or kept.input_tokens < tokens:
            kept = TraceRequest(0.0, tokens, 1, blocks, r.session_id)
        ends[node] = kept
    warm = [r for node, r in ends.items() if node not in extended]
    if max_tokens is not None:
        fits, total = [], 0
        for r in _in_preroll_order(trace.preroll, warm):
            if total + r.input_tokens <= max_tokens:
                fits.append(r)
                total += r.input_tokens
        warm = fits
    warm.sort(key=lambda r: -r.input_tokens)
    return Trace(requests=tuple(warm), block_size=size, source=f"pre-roll of {trace.source}")


def _in_preroll_order(
    preroll: tuple[TraceRequest, ...], warm: list[TraceRequest]
) -> list[TraceRequest]:
    """``warm`` in the order its chains first appear in ``preroll`` (the priority given)."""
    rank: dict[tuple[int, ...], int] = {}
    for i, r in enumerate(preroll):
        rank.setdefault(tuple(r.prefix_blocks), i)
    return sorted(warm, key=lambda r: rank.get(tuple(r.prefix_blocks), len(rank)))


def preroll_left_out(trace: Trace, max_tokens: int | None) -> tuple[int, int]:
    """(chains, tokens) of ``trace``'s pre-roll that ``max_tokens`` leaves out (0, 0: none)."""
    whole = preroll_trace(trace)
    if max_tokens is None:
        return 0, 0
    sent = preroll_trace(trace, max_tokens)
    return len(whole) - len(sent), sum(r.input_tokens for r in whole.requests) - sum(
        r.input_tokens for r in sent.requests
    )


def spread_ticks(
    trace: Trace, tick_s: float | None = None, seed: int = 0, *, clock_of: Trace | None = None
) -> tuple[Trace, ShapeReport]:
    """Spread the requests that arrive in one clock tick uniformly over the tick.

    A coarse clock (the Mooncake conversation trace records arrivals in 3-second ticks) stamps
    every request of a tick with the tick's start, give or take a few milliseconds of jitter,
    and a replay would send them all at once. Requests belong to one tick when each arrives
    less than ``min(tick_s / 2, BURST_WINDOW_S)`` after the one before (exactly equal
    arrivals on a clean clock; a jittered tick's cluster). Each group of two or more, starting
    at ``t``, gets arrivals drawn uniformly from ``[t, t + tick_s)`` by a seeded
    ``numpy.random.Generator``; the draws are sorted and handed out in the group's file order,
    so the request order is unchanged and the trace stays sorted. The interval is cut at the
    next group's first arrival when that comes sooner (a ``tick_s`` larger than the clock's),
    so no request overtakes a later tick. Requests alone in their tick keep their time.
    Lengths, prefix blocks, sessions and a pre-roll are untouched.

    Args:
        trace: The trace.
        tick_s: The clock's tick in seconds; None detects it with
            :func:`~optimizer.workload.stats.clock_tick` (jitter-tolerant; with only a few
            ticks the detected step can be a multiple of the real tick: give it then).
        seed: Seed of the generator.
        clock_of: Detect the tick on this trace instead (:func:`shape` passes the trace before
            its window: a window can keep only instants that lie on a coarser grid).

    Returns:
        The spread trace and its report (``changed_requests``: requests whose arrival moved).

    Raises:
        ConfigError: ``tick_s`` is not positive, or None and no tick can be detected (fewer
            than two distinct arrival times).
    """
    source = "given"
    if tick_s is None:
        source = "detected" if clock_of is None else "detected before the window"
        tick_s = clock_tick(trace if clock_of is None else clock_of)
        _check(
            tick_s > 0,
            "trace.shaping.spread_ticks cannot detect the clock's tick (fewer than two distinct "
            "arrival times): set trace.shaping.tick_s",
        )
    _check(tick_s > 0 and math.isfinite(tick_s), f"tick_s must be > 0, got {tick_s}")
    rng = np.random.default_rng(seed)
    arrivals_s = np.array([r.arrival_s for r in trace.requests], dtype=np.float64)
    spread = arrivals_s.copy()
    n = arrivals_s.size
    # A tick's requests form runs, since the trace is sorted: run k is [starts[k], ends[k]).
    new_tick = np.ones(n, dtype=bool)
    new_tick[1:] = np.diff(arrivals_s) >= min(tick_s / 2, BURST_WINDOW_S)
    starts = np.flatnonzero(new_tick)
    ends = np.append(starts[1:], n)[: starts.size]
    groups = 0
    for first, stop in zip(starts.tolist(), ends.tolist(), strict=True):
        if stop - first < 2:
            continue
        groups += 1
        t = float(arrivals_s[first])
        upper = min(t + tick_s, float(arrivals_s[stop])) if stop < n else t + tick_s
        draws = np.sort(t + rng.random(stop - first) * (upper - t))
        spread[first:stop] = np.minimum(draws, np.nextafter(upper, -np.inf))
    moved = int(np.count_nonzero(spread != arrivals_s))
    shaped = _with(
        trace,
        [
            r if new == r.arrival_s else replace(r, arrival_s=float(new))
            for r, new in zip(trace.requests, spread.tolist(), strict=True)
        ],
    )
    detail = f"tick {tick_s:g} s ({source}), {groups} shared ticks, seed {seed}"
    return shaped, _report("spread_ticks", detail, moved, trace, shaped)


def compress_time(
    trace: Trace, factor: float | None = None, *, target_duration_s: float | None = None
) -> tuple[Trace, ShapeReport]:
    """Divide every arrival time by ``factor`` (> 1 compresses, < 1 stretches).

    The duration is divided by the factor and every rate multiplied by it; lengths and order
    are untouched.

    Args:
        trace: The trace.
        factor: The compression factor; give this or ``target_duration_s``.
        target_duration_s: Choose the factor that makes the trace last this long.

    Returns:
        The compressed trace and its report.

    Raises:
        ConfigError: Neither or both given, a non-positive value, or a target duration for a
            trace without duration.
    """
    _check(
        (factor is None) != (target_duration_s is None),
        "give exactly one of a compression factor and target_duration_s",
    )
    if target_duration_s is not None:
        _check(target_duration_s > 0, f"target_duration_s must be > 0, got {target_duration_s}")
        _check(trace.duration_s > 0, "cannot compress a trace of zero duration to a target")
        factor = trace.duration_s / target_duration_s
    assert factor is not None
    _check(factor > 0 and math.isfinite(factor), f"compression factor must be > 0, got {factor}")
    return _divide_time(trace, factor, "compress", f"time / {factor:g}")


def scale_rate(trace: Trace, rate_scale: float) -> tuple[Trace, ShapeReport]:
    """Multiply the request rate by ``rate_scale``, by compressing time (same requests).

    Args:
        trace: The trace.
        rate_scale: Rate multiplier (> 0); 2 sends the same requests twice as fast.

    Returns:
        The rescaled trace and its report.

    Raises:
        ConfigError: ``rate_scale`` is not positive.
    """
    _check(
        rate_scale > 0 and math.isfinite(rate_scale), f"rate_scale must be > 0, got {rate_scale}"
    )
    return _divide_time(trace, rate_scale, "rate_scale", f"rate x {rate_scale:g}")


def _divide_time(trace: Trace, factor: float, step: str, detail: str) -> tuple[Trace, ShapeReport]:
    shaped = _with(trace, [replace(r, arrival_s=r.arrival_s / factor) for r in trace.requests])
    changed = sum(1 for r in trace.requests if r.arrival_s != 0) if factor != 1 else 0
    return shaped, _report(step, detail, changed, trace, shaped)


def _fit_blocks(request: TraceRequest, input_tokens: int, block_size: int) -> tuple[int, ...]:
    """The prefix blocks that still lie (at least partly) inside ``input_tokens``."""
    return request.prefix_blocks[: -(-input_tokens // block_size)]


def _relength(
    trace: Trace, lengths: Callable[[TraceRequest], tuple[int, int]]
) -> tuple[Trace, int]:
    """New (input, output) lengths for every request, and for the pre-roll alike (so its
    prefix blocks stay those of the trace); returns the trace and the requests changed."""

    def one(request: TraceRequest) -> TraceRequest:
        input_tokens, output_tokens = lengths(request)
        if (input_tokens, output_tokens) == (request.input_tokens, request.output_tokens):
            return request
        return replace(
            request,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            prefix_blocks=_fit_blocks(request, input_tokens, trace.block_size),
        )

    requests = [one(r) for r in trace.requests]
    changed = sum(new is not old for new, old in zip(requests, trace.requests, strict=True))
    return replace(trace, requests=tuple(requests), preroll=tuple(map(one, trace.preroll))), changed


def clip_lengths(
    trace: Trace, max_model_len: int, *, max_output_tokens: int | None = None
) -> tuple[Trace, ShapeReport]:
    """Fit every request into ``max_model_len``: ``input_tokens + output_tokens <= max_model_len``.

    Outputs are clipped first, to ``max_output_tokens`` when given and always to
    ``max_model_len - 1`` (so one prompt token remains); then inputs are clipped to
    ``max_model_len - output_tokens``. Prefix blocks beyond the new input length are dropped
    (a block covers ``block_size`` tokens), so shared prefixes stay consistent.

    Args:
        trace: The trace.
        max_model_len: The engine's context length (>= 2).
        max_output_tokens: Optional further cap on output lengths (>= 1).

    Returns:
        The clipped trace and its report.

    Raises:
        ConfigError: A limit is too small.
    """
    _check(max_model_len >= 2, f"max_model_len must be >= 2, got {max_model_len}")
    _check(
        max_output_tokens is None or max_output_tokens >= 1,
        f"max_output_tokens must be >= 1, got {max_output_tokens}",
    )
    output_cap = max_model_len - 1
    if max_output_tokens is not None:
        output_cap = min(output_cap, max_output_tokens)

    def lengths(request: TraceRequest) -> tuple[int, int]:
        output_tokens = min(request.output_tokens, output_cap)
        return min(request.input_tokens, max_model_len - output_tokens), output_tokens

    shaped, changed = _relength(trace, lengths)
    detail = f"max_model_len {max_model_len}" + (
        f", max_output_tokens {max_output_tokens}" if max_output_tokens is not None else ""
    )
    return shaped, _report("clip", detail, changed, trace, shaped)


def scale_lengths(
    trace: Trace, input_scale: float = 1.0, output_scale: float = 1.0
) -> tuple[Trace, ShapeReport]:
    """Multiply input and output lengths (rounded, at least 1 token).

    When inputs shrink, prefix blocks beyond the new length are dropped; when they grow, the
    blocks keep covering the prompt's start and the added tokens are fresh.

    Args:
        trace: The trace.
        input_scale: Input length multiplier (> 0).
        output_scale: Output length multiplier (> 0).

    Returns:
        The rescaled trace and its report.

    Raises:
        ConfigError: A multiplier is not positive.
    """
    _check(
        input_scale > 0 and math.isfinite(input_scale),
        f"input length scale must be > 0, got {input_scale}",
    )
    _check(
        output_scale > 0 and math.isfinite(output_scale),
        f"output length scale must be > 0, got {output_scale}",
    )
    shaped, changed = _relength(
        trace,
        lambda r: (
            max(1, round(r.input_tokens * input_scale)),
            max(1, round(r.output_tokens * output_scale)),
        ),
    )
    detail = f"input x {input_scale:g}, output x {output_scale:g}"
    return shaped, _report("length_scale", detail, changed, trace, shaped)


def subsample(trace: Trace, fraction: float, seed: int = 0) -> tuple[Trace, ShapeReport]:
    """Keep ``round(fraction * len(trace))`` requests chosen at random, in arrival order.

    Arrival times are kept, so the rate drops by ``fraction`` (follow with
    :func:`scale_rate` to restore it).

    Args:
        trace: The trace.
        fraction: Share of requests to keep, in (0, 1].
        seed: Seed of the ``numpy.random.Generator`` that picks them.

    Returns:
        The subsampled trace and its report.

    Raises:
        ConfigError: ``fraction`` is outside (0, 1].
    """
    _check(0 < fraction <= 1, f"sample_fraction must be in (0, 1], got {fraction}")
    keep = round(fraction * len(trace))
    _check(keep > 0, f"sample_fraction {fraction} of {len(trace)} requests keeps none")
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(trace), size=keep, replace=False))
    shaped = _with(trace, [trace.requests[int(i)] for i in chosen])
    detail = f"fraction {fraction:g}, seed {seed}"
    return shaped, _report("subsample", detail, len(trace) - keep, trace, shaped)


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    """Which shaping steps to apply; a field left None skips its step.

    Attributes:
        window_s: ``(start_s, end_s)`` window; ``end_s`` may be None for the end. Seconds from
            the file's own first arrival (for a slice, the slice's start).
        preroll_s: The stretch before the window whose requests warm the prefix cache before
            the replay (:func:`preroll`); None: enough to cover the window's prefix
            references; 0: none. Only with ``window_s``.
        spread_ticks: Spread requests sharing one arrival instant over their clock tick
            (seeded by ``seed``).
        tick_s: The tick to spread over; None detects it on the trace before its window.
        sample_fraction: Share of requests to keep (seeded by ``seed``).
        compress: Time compression factor (> 1 compresses).
        target_duration_s: Compress (or stretch) to this duration instead of a factor.
        rate_scale: Request rate multiplier.
        length_scale: Multiplier applied to both input and output lengths.
        output_scale: Multiplier of output lengths instead of ``length_scale``'s (decode-heavier
            or lighter answers than the trace's, its prompts kept or scaled by ``length_scale``).
        max_model_len: Clip lengths so that input + output fits.
        max_output_tokens: Further cap on output lengths (applied with the clip).
        seed: Seed for subsampling and tick spreading.
    """

    window_s: tuple[float, float | None] | None = None
    preroll_s: float | None = None
    spread_ticks: bool = False
    tick_s: float | None = None
    sample_fraction: float | None = None
    compress: float | None = None
    target_duration_s: float | None = None
    rate_scale: float | None = None
    length_scale: float | None = None
    output_scale: float | None = None
    max_model_len: int | None = None
    max_output_tokens: int | None = None
    seed: int = 0


def shape(trace: Trace, spec: ShapeSpec) -> tuple[Trace, list[ShapeReport]]:
    """Apply the steps ``spec`` asks for, in the order window, pre-roll, tick spread,
    subsample, compress (factor or target duration), rate scale, length scale, clip (see the
    module docstring for why).

    Args:
        trace: The trace.
        spec: The steps.

    Returns:
        The shaped trace and one report per applied step, in order.

    Raises:
        ConfigError: A parameter is invalid (named in the message).
    """
    steps: list[Callable[[Trace], tuple[Trace, ShapeReport]]] = []
    if spec.window_s is not None:
        start_s, end_s = spec.window_s
        steps.append(lambda t: time_window(t, start_s, end_s))
        has_prefixes = any(r.prefix_blocks for r in trace.requests)
        if start_s > 0 and spec.preroll_s != 0 and (has_prefixes or spec.preroll_s is not None):
            whole = trace
            steps.append(lambda _: preroll(whole, start_s, end_s, spec.preroll_s))
    elif spec.preroll_s is not None:
        raise ConfigError(
            "trace.shaping.preroll_s warms the cache for a window: set trace.shaping.window_s "
            "too, or drop preroll_s"
        )
    if spec.spread_ticks:
        clock_of = trace if spec.window_s is not None else None
        steps.append(lambda t: spread_ticks(t, spec.tick_s, spec.seed, clock_of=clock_of))
    elif spec.tick_s is not None:
        raise ConfigError("tick_s is used by the tick spread: set spread_ticks too")
    if spec.sample_fraction is not None:
        fraction = spec.sample_fraction
        steps.append(lambda t: subsample(t, fraction, spec.seed))
    if spec.compress is not None or spec.target_duration_s is not None:
        steps.append(
            lambda t: compress_time(t, spec.compress, target_duration_s=spec.target_duration_s)
        )
    if spec.rate_scale is not None:
        rate_scale = spec.rate_scale
        steps.append(lambda t: scale_rate(t, rate_scale))
    if spec.length_scale is not None or spec.output_scale is not None:
        inputs = 1.0 if spec.length_scale is None else spec.length_scale
        outputs = inputs if spec.output_scale is None else spec.output_scale
        steps.append(lambda t: scale_lengths(t, inputs, outputs))
    if spec.max_model_len is not None:
        max_model_len = spec.max_model_len
        steps.append(
            lambda t: clip_lengths(t, max_model_len, max_output_tokens=spec.max_output_tokens)
        )
    elif spec.max_output_tokens is not None:
        raise ConfigError("max_output_tokens is applied with the clip: set max_model_len too")
    reports: list[ShapeReport] = []
    for step in steps:
        trace, report = step(trace)
        reports.append(report)
    return trace, reports
