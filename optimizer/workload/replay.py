"""Open-loop replay of a trace against an OpenAI-compatible ``/v1/completions`` server.

:func:`replay` sends every request of a :class:`~optimizer.types.Trace` at its recorded arrival
time (relative to the first request), whatever the server's state: a slow server gets a queue,
as in production, instead of a politely waiting client. Everything that costs time is done
before the clock starts: prompts are built (:mod:`optimizer.workload.prompts`), JSON-encoded and
wrapped in ready ``httpx.Request`` objects. A single dispatcher sleeps to absolute deadlines on a
monotonic clock (relative sleeps would accumulate drift) and starts one task per request, which
streams the response through :class:`~optimizer.workload.sse.SSEParser` and keeps raw
observations only (:class:`~optimizer.types.RequestRecord`). The client's own fidelity is
measured too: send lag (sent - scheduled) is summarised in :class:`ReplayResult`, which says
whether the schedule was kept, so a caller never scores a replay the client distorted
(DESIGN §3). A request's send time is when its first bytes were written to its socket (httpcore's
``trace`` hook), as the server sees it: an overloaded client's tasks, pool and connection set-up
all delay it, and all of that counts as lag. Every request of the trace is accounted for,
including the ones a time limit stopped. The clock and the HTTP transport are seams for tests.

Connections do not race the server's idle timeout: they expire on the client first
(``keepalive_expiry_s``), and a request the server never read because it closed the request's
reused connection as idle (after a stall of the server) is sent once more on a fresh connection
(``ReplayResult.retried``). Transport failures are recorded with the OS error under them
(:func:`~optimizer.workload.replay_client.describe_error`).

A trace cut from a longer one can carry a pre-roll (:attr:`~optimizer.types.Trace.preroll`,
the requests before its window): the replay first sends it, as prompts of their prefix blocks
with one output token each and the replay's own seed (so the prefix tokens are those the trace
will send), waits until all of it has finished, and only then starts the trace's clock. Nothing
of the pre-roll is in the result's records; ``ReplayResult.preroll_requests`` counts it.

The records a replay takes and returns are in :mod:`optimizer.workload.replay_records`, the HTTP
side of one run (pools, requests, the per-request tasks) in
:mod:`optimizer.workload.replay_client`; this module runs them: the pre-roll, the schedule, the
time limit and early stop, and a replay spread over several client processes
(:func:`run_replay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import httpx

from optimizer.errors import ReplayError
from optimizer.types import RequestRecord, Trace
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay_client import (
    REASON_CANCELLED,
    ReplayRun,
    build_request_bodies,
    http_requests,
    open_clients,
)
from optimizer.workload.replay_records import (
    Clock,
    MonotonicClock,
    ReplayOptions,
    ReplayProgress,
    ReplayResult,
    ReplaySnapshot,
    judge_send_lag,
    options_with,
)
from optimizer.workload.shaping import preroll_trace

__all__ = [
    "Clock",
    "MonotonicClock",
    "ReplayOptions",
    "ReplayProgress",
    "ReplayResult",
    "ReplaySnapshot",
    "build_request_bodies",
    "replay",
    "run_replay",
    "warm_blocks",
]

logger = logging.getLogger(__name__)

_REASON_MAX_DURATION = "max duration reached"


async def replay(
    trace: Trace,
    url: str,
    model: str,
    *,
    vocab: TokenRange,
    seed: int,
    options: ReplayOptions | None = None,
    clock: Clock | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: Callable[[ReplayProgress], None] | None = None,
    stop_check: Callable[[ReplaySnapshot], str | None] | None = None,
    **overrides: Any,
) -> ReplayResult:
    """Replay a trace open-loop and record every request.

    Args:
        trace: The requests, sorted by ``arrival_s``; request ``i`` is scheduled at
            ``arrival_s - trace.requests[0].arrival_s`` seconds after the clock starts.
        url: Base URL of the server, e.g. ``http://127.0.0.1:8000``.
        model: Served model name sent in every body.
        vocab: Token ids prompts may use (see :class:`~optimizer.workload.prompts.TokenRange`).
        seed: Prompt seed (see :func:`~optimizer.workload.prompts.build_prompt_ids`).
        options: How to run (:class:`ReplayOptions`); the defaults when None.
        clock: Time source and sleeper; :class:`MonotonicClock` when None.
        transport: httpx transport (tests pass ``httpx.MockTransport``); when given, the
            connection limits of ``options`` are the transport's business.
        progress: Called with a :class:`ReplayProgress` at most once per
            ``options.progress_interval_s`` while requests are sent or finish, and once at
            the end.
        stop_check: Called every ``options.stop_check_interval_s`` with a
            :class:`ReplaySnapshot`; returning a reason stops the replay like
            ``max_duration_s`` does (early stop of a trial whose SLOs can no longer be met),
            with the reason in ``stop_reason``.
        **overrides: Fields of :class:`ReplayOptions` given as keywords (replacing those of
            ``options``), so ``replay(..., warmup_requests=10)`` keeps working.

    Returns:
        The records of all requests in trace order and the client's fidelity.

    Raises:
        ReplayError: If the trace is empty or an argument is out of range.
    """
    if not trace.requests:
        raise ReplayError("cannot replay an empty trace")
    opts = _with_warm_blocks(options_with(options, overrides), trace)
    warm = await _preroll(trace, url, model, vocab=vocab, seed=seed, opts=opts, transport=transport)
    clock = clock if clock is not None else MonotonicClock()
    scheduled_s = _schedule(trace, opts)
    bodies = _bodies(trace, model, vocab, seed, opts)
    async with contextlib.AsyncExitStack() as stack:
        clients, retry_client, connections_per_client = await open_clients(
            stack, url, opts, transport
        )
        requests = http_requests(clients, opts, bodies)
        del bodies
        run = ReplayRun(
            clients=clients,
            retry_client=retry_client,
            connections_per_client=connections_per_client,
            requests=requests,
            scheduled_s=scheduled_s,
            wanted_tokens=[r.output_tokens for r in trace.requests],
            input_tokens=[r.input_tokens for r in trace.requests],
            warmup_requests=opts.warmup_requests,
            clock=clock,
            progress=progress,
            progress_interval_s=opts.progress_interval_s,
        )
        run.t0 = clock.now() if opts.start_at is None else opts.start_at
        stopped_early, stop_reason = await _run_until_stopped(run, clock, opts, stop_check)
    result = _result(run, clock, opts, stopped_early, stop_reason)
    return _with_preroll(result, warm)


def _bodies(
    trace: Trace, model: str, vocab: TokenRange, seed: int, opts: ReplayOptions
) -> list[bytes]:
    """:func:`build_request_bodies` as ``opts`` asks (extra body, indices, warm blocks)."""
    return build_request_bodies(
        trace,
        model,
        vocab=vocab,
        seed=seed,
        extra_body=opts.extra_body,
        indices=opts.prompt_indices,
        warm_blocks=opts.warm_blocks or frozenset(),
        warm_seed=opts.warm_seed,
    )


def warm_blocks(trace: Trace) -> frozenset[int]:
    """The prefix blocks the trace's pre-roll sends: every block of the requests of
    :func:`~optimizer.workload.shaping.preroll_trace` that holds a prompt token."""
    blocks: set[int] = set()
    for r in preroll_trace(trace).requests:
        n_tokens = min(len(r.prefix_blocks) * trace.block_size, r.input_tokens)
        blocks.update(r.prefix_blocks[: -(-n_tokens // trace.block_size)])
    return frozenset(blocks)


def _with_warm_blocks(opts: ReplayOptions, trace: Trace) -> ReplayOptions:
    """``opts`` with its warm blocks set from the trace's pre-roll where a warm seed asks."""
    if opts.warm_seed is None or opts.warm_blocks is not None:
        return opts
    return dataclasses.replace(opts, warm_blocks=warm_blocks(trace))


def _with_preroll(result: ReplayResult, warm: tuple[int, int, int, float]) -> ReplayResult:
    """``result`` with what its pre-roll sent: (requests, failed, tokens, seconds)."""
    return dataclasses.replace(
        result,
        preroll_requests=warm[0],
        preroll_failed=warm[1],
        preroll_tokens=warm[2],
        preroll_s=warm[3],
    )


async def _preroll(
    trace: Trace,
    url: str,
    model: str,
    *,
    vocab: TokenRange,
    seed: int,
    opts: ReplayOptions,
    transport: httpx.AsyncBaseTransport | None,
) -> tuple[int, int, int, float]:
    """Send the trace's pre-roll (:func:`~optimizer.workload.shaping.preroll_trace`), all at
    once, and wait for every request of it; returns (requests, failed, tokens, seconds)."""
    warm = preroll_trace(trace)
    if not warm.requests or not opts.send_preroll:
        return 0, 0, 0, 0.0
    t0 = time.monotonic()
    result = await replay(
        warm,
        url,
        model,
        vocab=vocab,
        seed=seed,
        options=dataclasses.replace(
            opts,
            warmup_requests=len(warm),
            max_duration_s=None,
            max_send_lag_ms=math.inf,
            start_at=None,
            schedule_origin_s=None,
            prompt_indices=None,
        ),
        transport=transport,
    )
    if result.failed:
        logger.warning(
            "pre-roll: %d of %d requests failed (%s)",
            result.failed,
            len(warm),
            next(r.error for r in result.records if r.error),
        )
    tokens = sum(r.input_tokens for r in warm.requests)
    return len(warm), result.failed, tokens, round(time.monotonic() - t0, 3)


def _schedule(trace: Trace, opts: ReplayOptions) -> list[float]:
    """Every request's send time after the clock starts (the trace must be sorted)."""
    first_arrival_s = (
        opts.schedule_origin_s
        if opts.schedule_origin_s is not None
        else trace.requests[0].arrival_s
    )
    scheduled_s = [r.arrival_s - first_arrival_s for r in trace.requests]
    if any(b < a for a, b in itertools.pairwise(scheduled_s)):
        raise ReplayError("trace requests must be sorted by arrival_s")
    return scheduled_s


async def _run_until_stopped(
    run: ReplayRun,
    clock: Clock,
    opts: ReplayOptions,
    stop_check: Callable[[ReplaySnapshot], str | None] | None,
) -> tuple[bool, str]:
    """Run the replay until every request finished, the time limit, or ``stop_check`` says stop.

    Returns whether it stopped early, and why ("" when it did not).
    """
    main = asyncio.create_task(run.main())
    timer: asyncio.Task[None] | None = None
    watcher: asyncio.Task[str] | None = None
    stopped_early = False
    stop_reason = ""
    try:
        waiting: set[asyncio.Task[Any]] = {main}
        if opts.max_duration_s is not None:
            timer = asyncio.create_task(clock.sleep_until(run.t0 + opts.max_duration_s))
            waiting.add(timer)
        if stop_check is not None:
            watcher = asyncio.create_task(run.watch(stop_check, opts.stop_check_interval_s))
            waiting.add(watcher)
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            main.result()  # re-raises a bug in the replayer
        else:
            stopped_early = True
            if watcher is not None and watcher in done:
                stop_reason = watcher.result()
                run.cancel_reason = f"early stop: {stop_reason}"
            else:
                stop_reason = run.cancel_reason = _REASON_MAX_DURATION
            await run.cancel_all(main)
    except BaseException:
        # Outer cancellation, Ctrl-C or a bug: leave no request task behind.
        if not stopped_early:
            run.cancel_reason = REASON_CANCELLED
        await run.cancel_all(main)
        raise
    finally:
        for side in (timer, watcher):
            if side is not None:
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)
    return stopped_early, stop_reason


def _result(
    run: ReplayRun, clock: Clock, opts: ReplayOptions, stopped_early: bool, stop_reason: str
) -> ReplayResult:
    """Account for the requests never sent, judge the send lag, and gather the result."""
    stop_s = clock.now() - run.t0
    run.account_unsent(stop_s)
    run.emit_progress(force=True)
    records = tuple(r for r in run.records if r is not None)
    ends = [r.end_s for r in records]
    duration_s = max(ends) if ends else stop_s
    p99_ms, max_ms, kept, message = judge_send_lag(
        records,
        stop_s=stop_s,
        bound_ms=opts.max_send_lag_ms,
        pool_overflow=run.pool_overflow,
        max_connections=opts.max_connections,
    )
    if not kept:
        logger.warning("%s", message)
    return ReplayResult(
        records=records,
        duration_s=duration_s,
        p99_send_lag_ms=p99_ms,
        max_send_lag_ms=max_ms,
        max_send_lag_bound_ms=opts.max_send_lag_ms,
        peak_in_flight=run.peak_in_flight,
        schedule_kept=kept,
        stopped_early=stopped_early,
        message=message,
        stop_reason=stop_reason,
        retried=run.retried,
    )


def run_replay(
    trace: Trace, url: str, model: str, *, processes: int = 1, **kwargs: Any
) -> ReplayResult:
    """Run :func:`replay` in a fresh event loop (for synchronous callers).

    Ctrl-C cancels the replay: in-flight requests are cancelled, the client is closed, and
    ``KeyboardInterrupt`` propagates. Keyword arguments are those of :func:`replay`.

    Args:
        trace: The trace.
        url: Base URL of the server.
        model: Served model name.
        processes: Client processes (one event loop each, for rates one core cannot keep):
            request ``i`` goes to process ``i % processes``, all on one schedule; prompts are
            those of a single-process replay. Not with ``progress``, ``stop_check``,
            ``clock`` or ``transport``.
        **kwargs: As for :func:`replay`.

    Returns:
        The :class:`ReplayResult` (merged over the processes, judged as a whole).
    """
    if processes <= 1:
        return asyncio.run(replay(trace, url, model, **kwargs))
    return _run_in_processes(trace, url, model, processes, kwargs)


_PROCESS_START_MARGIN_S = 3.0


def _replay_part(
    trace: Trace, url: str, model: str, vocab: TokenRange, seed: int, options: ReplayOptions
) -> ReplayResult:
    """One process's part of a multi-process replay (runs in that process)."""
    return asyncio.run(replay(trace, url, model, vocab=vocab, seed=seed, options=options))


def _preroll_first(
    trace: Trace,
    url: str,
    model: str,
    vocab: TokenRange,
    seed: int,
    options: ReplayOptions | None,
) -> tuple[Trace, tuple[int, int, int, float]]:
    """A multi-process replay's pre-roll, sent once from here: the trace without it, and the
    pre-roll's (requests, failed, tokens, seconds)."""
    if not trace.preroll:
        return trace, (0, 0, 0, 0.0)
    warm = asyncio.run(
        _preroll(
            trace,
            url,
            model,
            vocab=vocab,
            seed=seed,
            opts=options_with(options, {}),
            transport=None,
        )
    )
    return dataclasses.replace(trace, preroll=()), warm


def _process_options(trace: Trace, kwargs: dict[str, Any]) -> ReplayOptions:
    """A multi-process replay's options (its ``options`` and keyword overrides), with the whole
    trace's warm blocks: its parts are replayed without the pre-roll they come from."""
    overrides = {
        k: v
        for k, v in kwargs.items()
        if k not in ("options", "progress", "stop_check", "clock", "transport")
    }
    return _with_warm_blocks(options_with(kwargs.get("options"), overrides), trace)


def _run_in_processes(
    trace: Trace, url: str, model: str, processes: int, kwargs: dict[str, Any]
) -> ReplayResult:
    import concurrent.futures
    import multiprocessing

    for name in ("progress", "stop_check", "clock", "transport"):
        if kwargs.get(name) is not None:
            raise ReplayError(f"run_replay(processes={processes}) does not take {name}")
    if not trace.requests:
        raise ReplayError("cannot replay an empty trace")
    vocab, seed = kwargs.pop("vocab"), kwargs.pop("seed")
    options = _process_options(trace, kwargs)
    trace, warm = _preroll_first(trace, url, model, vocab, seed, options)
    origin = trace.requests[0].arrival_s
    parts = []
    for p in range(min(processes, len(trace.requests))):
        indices = tuple(range(p, len(trace.requests), processes))
        part = dataclasses.replace(trace, requests=tuple(trace.requests[i] for i in indices))
        part_options = dataclasses.replace(
            options,
            schedule_origin_s=origin,
            prompt_indices=indices,
            warmup_requests=max(0, -(-(options.warmup_requests - p) // processes)),
        )
        parts.append((indices, part, part_options))
    # Every process starts its clock at the same instant, once all can have started.
    start_at = time.perf_counter() + _PROCESS_START_MARGIN_S
    parts = [
        (indices, part, dataclasses.replace(part_options, start_at=start_at))
        for indices, part, part_options in parts
    ]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(parts), mp_context=context) as pool:
        futures = [
            pool.submit(_replay_part, part, url, model, vocab, seed, part_options)
            for _, part, part_options in parts
        ]
        results = [future.result() for future in futures]
    records: list[RequestRecord | None] = [None] * len(trace.requests)
    for (indices, _, _), result in zip(parts, results, strict=True):
        for record in result.records:
            records[indices[record.index]] = dataclasses.replace(
                record, index=indices[record.index]
            )
    merged = tuple(r for r in records if r is not None)
    stop_s = max(r.end_s for r in merged)
    p99_ms, max_ms, kept, message = judge_send_lag(
        merged,
        stop_s=stop_s,
        bound_ms=options.max_send_lag_ms,
        pool_overflow=sum(not r.schedule_kept and "max_connections" in r.message for r in results),
        max_connections=options.max_connections,
    )
    return ReplayResult(
        records=merged,
        duration_s=max(r.duration_s for r in results),
        p99_send_lag_ms=p99_ms,
        max_send_lag_ms=max_ms,
        max_send_lag_bound_ms=options.max_send_lag_ms,
        peak_in_flight=sum(r.peak_in_flight for r in results),
        schedule_kept=kept,
        stopped_early=any(r.stopped_early for r in results),
        message=message,
        stop_reason=next((r.stop_reason for r in results if r.stop_reason), ""),
        retried=sum(r.retried for r in results),
        preroll_requests=warm[0],
        preroll_failed=warm[1],
        preroll_tokens=warm[2],
        preroll_s=warm[3],
    )
