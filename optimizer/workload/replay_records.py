"""How a replay runs and what it returns: the clock it keeps time with (a seam for tests),
:class:`ReplayOptions`, the progress and early-stop snapshots a running replay hands out, the
:class:`ReplayResult`, and the judgement of the client's send lag that says whether the replay
kept the trace's schedule (pure: no I/O).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from optimizer.errors import ReplayError
from optimizer.types import RequestRecord

__all__ = [
    "Clock",
    "MonotonicClock",
    "ReplayOptions",
    "ReplayProgress",
    "ReplayResult",
    "ReplaySnapshot",
    "judge_send_lag",
    "options_with",
]


class Clock(Protocol):
    """Where the replayer gets its time and how it waits (a seam for deterministic tests)."""

    def now(self) -> float:
        """Current time in seconds on a monotonic scale (the origin is arbitrary)."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return at (or as soon as possible after) ``deadline``, on the scale of :meth:`now`."""
        ...


class MonotonicClock:
    """The real clock: ``time.perf_counter`` and ``asyncio.sleep``.

    ``perf_counter`` is monotonic and, on Linux, the same clock the event loop's timers use, so
    a sleep ends at the deadline plus the loop's timer granularity (about a millisecond).
    """

    def now(self) -> float:
        """Current ``time.perf_counter()``."""
        return time.perf_counter()

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until ``deadline`` (no-op if it has passed)."""
        delay = deadline - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOptions:
    """How a replay runs: one record instead of a long keyword list (like httpx's ``Limits``).

    The seams (clock, transport) and callbacks (progress, stop check) stay arguments of
    :func:`~optimizer.workload.replay.replay`; everything else is here. Derive variants with
    ``dataclasses.replace``.

    Attributes:
        warmup_requests: The first this many requests are marked ``warmup=True``.
        max_duration_s: Stop after this many seconds: requests not yet sent are recorded as
            ``"not sent: max duration reached"``, in-flight ones are cancelled and recorded as
            ``"cancelled: max duration reached"``. None: run until every request finished.
        endpoint: Path of the completions endpoint.
        max_connections: Connections in all; must exceed the peak number of requests in
            flight, or requests queue inside the client and the schedule is not kept.
        client_shards: Number of ``httpx.AsyncClient`` pools the connections are split over
            (requests go round-robin); keeps httpx's per-request pool overhead small. Few:
            every pool keeps connections of its own, and the more pools, the more
            connections sit idle long enough to race the server's idle timeout.
        keepalive_expiry_s: An idle connection is closed by the client after this many
            seconds. Below the server's own idle timeout (vLLM's uvicorn: 5 s) with a margin
            for a busy server, so the client never sends on a connection the server is about
            to close.
        retry_reset: A request whose *reused* connection was reset or closed before any
            response byte arrived (the server closed it as idle, racing the send: it never
            read the request) is sent once more on a fresh connection and counted in
            ``ReplayResult.retried``. Its send time stays the first attempt's: those bytes
            reached the server's socket on time, and the server's stall belongs in the
            request's TTFT, not in the client's send lag.
        lean_transport: For ``http`` URLs, send through
            :class:`~optimizer.workload.http11.LeanTransport` (one pool, a fraction of httpx's
            per-read CPU cost) instead of httpx's own transport; ``client_shards`` then does
            not matter. Off: httpx's transport (also used for ``https``).
        connect_timeout_s: TCP connect timeout.
        read_timeout_s: Timeout between two reads of a response; None (the default) so a
            slow first token under heavy load is measured, not cut off.
        max_send_lag_ms: Bound on the P99 send lag for ``schedule_kept``.
        progress_interval_s: Minimum seconds between two progress calls.
        api_key: Sent as a bearer token when given.
        extra_body: Fields added to every request body.
        trust_env: Let httpx read proxy settings from the environment; off by default
            because the replay targets a server the tuner started, and a proxy would distort
            every latency.
        stop_check_interval_s: Seconds between two ``stop_check`` calls.
        start_at: When schedule time zero falls, on the clock's scale (``perf_counter``,
            system-wide on Linux); None: as soon as everything is prepared. Lets several
            processes replay parts of one trace on one schedule
            (:func:`~optimizer.workload.replay.run_replay`'s ``processes``).
        schedule_origin_s: The ``arrival_s`` that is schedule time zero; None: the first
            request's.
        prompt_indices: The index each request's prompt is built from (None: its position).
        warm_seed: The seed of the blocks the trace's pre-roll warms
            (:func:`~optimizer.workload.replay.warm_blocks`), in the pre-roll and in every
            request; the rest of each prompt uses the replay's seed.
            Replays of one trace with different seeds and one ``warm_seed`` then share exactly
            the warm set, so a cache warmed once stays warm for the next (a capacity search's
            steps). None: every token from the replay's seed.
        warm_blocks: Those blocks; None: :func:`~optimizer.workload.replay.warm_blocks` of the
            trace (a part of a trace replayed apart is given the whole trace's).
        send_preroll: Send the trace's pre-roll before the clock starts. False: the server's
            cache is warm already (an earlier replay with the same ``warm_seed`` sent it).
    """

    warmup_requests: int = 0
    max_duration_s: float | None = None
    endpoint: str = "/v1/completions"
    max_connections: int = 4096
    client_shards: int = 4
    keepalive_expiry_s: float = 3.0
    retry_reset: bool = True
    lean_transport: bool = True
    connect_timeout_s: float = 10.0
    read_timeout_s: float | None = None
    max_send_lag_ms: float = 10.0
    progress_interval_s: float = 0.2
    api_key: str | None = None
    extra_body: Mapping[str, Any] | None = None
    trust_env: bool = False
    stop_check_interval_s: float = 0.5
    start_at: float | None = None
    schedule_origin_s: float | None = None
    prompt_indices: tuple[int, ...] | None = None
    warm_seed: int | None = None
    warm_blocks: frozenset[int] | None = None
    send_preroll: bool = True

    def __post_init__(self) -> None:
        if self.warmup_requests < 0:
            raise ReplayError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if self.max_duration_s is not None and self.max_duration_s <= 0:
            raise ReplayError(f"max_duration_s must be positive, got {self.max_duration_s}")
        if self.keepalive_expiry_s < 0:
            raise ReplayError(f"keepalive_expiry_s must be >= 0, got {self.keepalive_expiry_s}")
        if self.max_connections <= 0 or self.client_shards <= 0:
            raise ReplayError(
                f"max_connections and client_shards must be positive, "
                f"got {self.max_connections} and {self.client_shards}"
            )


def options_with(options: ReplayOptions | None, overrides: Mapping[str, Any]) -> ReplayOptions:
    """``options`` (or the defaults) with keyword overrides (the pre-record call style)."""
    base = options if options is not None else ReplayOptions()
    if not overrides:
        return base
    unknown = sorted(set(overrides) - set(ReplayOptions.__dataclass_fields__))
    if unknown:
        raise TypeError(f"replay() got unexpected keyword arguments: {', '.join(unknown)}")
    return dataclasses.replace(base, **overrides)


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """A snapshot for progress displays.

    Attributes:
        elapsed_s: Seconds since the replay clock started.
        total: Requests in the trace.
        sent: Requests sent so far.
        completed: Requests finished without error.
        failed: Requests finished with an error.
        in_flight: Requests sent and not finished.
        p95_ttft_ms: P95 time to first token of the measured (not warm-up) requests that
            finished well so far, recomputed at most once a second; None before the first.
    """

    elapsed_s: float
    total: int
    sent: int
    completed: int
    failed: int
    in_flight: int
    p95_ttft_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ReplaySnapshot:
    """What a running replay has seen so far, for early-stop decisions.

    Attributes:
        now_s: Seconds since the replay clock started.
        finished: Records of the requests that finished (any order).
        waiting_sent_s: Send times of measured (non-warm-up) requests in flight that have no
            first token yet.
        streaming_sent_s: Send times of measured requests in flight that are streaming.
    """

    now_s: float
    finished: tuple[RequestRecord, ...]
    waiting_sent_s: tuple[float, ...]
    streaming_sent_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay observed, plus how faithfully the client kept the schedule.

    Attributes:
        records: One record per trace request, in trace order.
        duration_s: Wall seconds from the clock start to the last request's end.
        p99_send_lag_ms: 99th percentile of ``sent_s - scheduled_s`` over sent measured
            (non-warm-up) requests, where ``sent_s`` is when the request's first bytes were
            written to its socket, as the server sees it, not when its task started (a
            request the replay gave up on after its scheduled time counts with the time it had
            waited, so a client that fell behind cannot look punctual); 0 if none was sent.
        max_send_lag_ms: Largest such lag.
        max_send_lag_bound_ms: The bound ``p99_send_lag_ms`` was judged against.
        peak_in_flight: Most requests in flight at once.
        schedule_kept: False when the client distorted the load (P99 lag over the bound, or
            a request found every connection of its pool busy and queued inside the client).
            A caller must not score such a replay.
        stopped_early: True when ``max_duration_s`` or ``stop_check`` ended the replay before
            every request finished.
        message: Empty when the schedule was kept; otherwise what went wrong and what to do.
        stop_reason: Why the replay stopped early ("" when it did not).
        retried: Requests sent a second time, on a fresh connection, because the server
            closed their idle connection as they were sent (``ReplayOptions.retry_reset``).
        preroll_requests: Requests of the trace's pre-roll sent (and finished) before the
            trace's clock started; never in ``records``.
        preroll_failed: How many of them failed (a cache that is not as warm as meant).
        preroll_tokens: Prompt tokens the pre-roll sent.
        preroll_s: Seconds from its first send until its last request finished.
    """

    records: tuple[RequestRecord, ...]
    duration_s: float
    p99_send_lag_ms: float
    max_send_lag_ms: float
    max_send_lag_bound_ms: float
    peak_in_flight: int
    schedule_kept: bool
    stopped_early: bool
    message: str = ""
    stop_reason: str = ""
    retried: int = 0
    preroll_requests: int = 0
    preroll_failed: int = 0
    preroll_tokens: int = 0
    preroll_s: float = 0.0

    @property
    def failed(self) -> int:
        """Number of records with an error."""
        return sum(1 for r in self.records if r.error is not None)


def judge_send_lag(
    records: Sequence[RequestRecord],
    *,
    stop_s: float,
    bound_ms: float,
    pool_overflow: int,
    max_connections: int,
) -> tuple[float, float, bool, str]:
    """Summarise send lag and decide whether the client kept the schedule.

    Only the measured window counts: warm-up requests absorb the client's cold start (first
    connections, first-call code paths) as they absorb the server's.
    """
    lags_ms = []
    for record in records:
        if record.warmup:
            continue
        if record.error is not None and record.error.startswith("not sent"):
            # Overdue but never sent: it waited at least until the stop.
            if record.scheduled_s < stop_s:
                lags_ms.append((stop_s - record.scheduled_s) * 1e3)
        else:
            lags_ms.append((record.sent_s - record.scheduled_s) * 1e3)
    if lags_ms:
        p99_ms = float(np.percentile(lags_ms, 99))
        max_ms = float(max(lags_ms))
    else:
        p99_ms = max_ms = 0.0
    problems = []
    if p99_ms > bound_ms:
        problems.append(
            f"P99 send lag {p99_ms:.1f} ms exceeds the {bound_ms:g} ms bound (max {max_ms:.1f} ms)"
        )
    if pool_overflow:
        problems.append(
            f"{pool_overflow} requests found every connection of their pool busy "
            f"(max_connections={max_connections}) and waited inside the client; "
            "raise max_connections"
        )
    if not problems:
        return p99_ms, max_ms, True, ""
    message = (
        "the replay client could not keep the trace's schedule: "
        + "; ".join(problems)
        + ". Do not score this replay: lower the request rate, or spread the trace over "
        "several client processes."
    )
    return p99_ms, max_ms, False, message
