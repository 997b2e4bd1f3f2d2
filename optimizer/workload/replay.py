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
(:func:`describe_error`).

A trace cut from a longer one can carry a pre-roll (:attr:`~optimizer.types.Trace.preroll`,
the requests before its window): the replay first sends it, as prompts of their prefix blocks
with one output token each and the replay's own seed (so the prefix tokens are those the trace
will send), waits until all of it has finished, and only then starts the trace's clock. Nothing
of the pre-roll is in the result's records; ``ReplayResult.preroll_requests`` counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import importlib
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import numpy as np

from optimizer.errors import ReplayError
from optimizer.types import RequestRecord, Trace
from optimizer.workload.http11 import LeanTransport
from optimizer.workload.prompts import TokenRange, build_prompt_ids
from optimizer.workload.shaping import preroll_trace
from optimizer.workload.sse import DoneEvent, ErrorEvent, SSEParser, TextEvent, UsageEvent

__all__ = [
    "Clock",
    "MonotonicClock",
    "ReplayOptions",
    "ReplayProgress",
    "ReplayResult",
    "ReplaySnapshot",
    "build_request_bodies",
    "describe_error",
    "replay",
    "run_replay",
    "warm_blocks",
]

logger = logging.getLogger(__name__)

_SNIPPET_CHARS = 200
_NOT_SENT = "not sent: {reason}"
_CANCELLED = "cancelled: {reason}"
_REASON_MAX_DURATION = "max duration reached"
_REASON_CANCELLED = "replay cancelled"


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
    :func:`replay`; everything else is here. Derive variants with ``dataclasses.replace``.

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
            processes replay parts of one trace on one schedule (:func:`run_replay`'s
            ``processes``).
        schedule_origin_s: The ``arrival_s`` that is schedule time zero; None: the first
            request's.
        prompt_indices: The index each request's prompt is built from (None: its position).
        warm_seed: The seed of the blocks the trace's pre-roll warms (:func:`warm_blocks`), in
            the pre-roll and in every request; the rest of each prompt uses the replay's seed.
            Replays of one trace with different seeds and one ``warm_seed`` then share exactly
            the warm set, so a cache warmed once stays warm for the next (a capacity search's
            steps). None: every token from the replay's seed.
        warm_blocks: Those blocks; None: :func:`warm_blocks` of the trace (a part of a trace
            replayed apart is given the whole trace's).
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


def _options(options: ReplayOptions | None, overrides: Mapping[str, Any]) -> ReplayOptions:
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


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "..."


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an exception, with the OS error (errno) found in its chain.

    httpx wraps a socket error two or three times (httpx -> httpcore -> anyio), often with
    empty messages on the way; the first non-empty message of the chain is used and the
    errno's symbolic name is added, so a record says ``ReadError: [Errno 104] Connection
    reset by peer (ECONNRESET)``. Without any message, the chain's types are listed.
    """
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    message = next((str(e) for e in chain if str(e)), "")
    os_error = next((e for e in chain if isinstance(e, OSError) and e.errno), None)
    text = type(exc).__name__
    if message:
        text += f": {_snippet(message)}"
    if os_error is not None and os_error.errno is not None:
        code = os_error.errno
        name = errno.errorcode.get(code, str(code))
        if message != str(os_error):
            text += f" [Errno {code}] {os.strerror(code)}"
        text += f" ({name})"
    elif not message:
        causes = " <- ".join(type(e).__name__ for e in chain[1:])
        text += f" (from {causes})" if causes else " (raised without a message or an OS error)"
    return text


def _reset_before_response(exc: BaseException) -> bool:
    """True for a connection closed or reset under a request before any response byte."""
    return isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError)


class _Attempt:
    """What httpcore's ``trace`` hooks tell about one attempt to send a request.

    ``sent_s``: when the request line and headers were written to the socket (the server can
    read them from then on); ``fresh``: the attempt opened a connection instead of reusing
    an idle one. Passed as the request's ``trace`` extension.
    """

    __slots__ = ("clock", "fresh", "sent_s", "sent_s_first", "t0")

    def __init__(self, clock: Clock, t0: float) -> None:
        self.clock = clock
        self.t0 = t0
        self.sent_s: float | None = None
        self.sent_s_first: float | None = None  # an earlier attempt's, when this is a retry
        self.fresh = False

    def send_time(self, dispatched_s: float) -> float:
        """The request's send time: the first socket write of any attempt."""
        for sent_s in (self.sent_s_first, self.sent_s):
            if sent_s is not None:
                return sent_s
        return dispatched_s

    async def __call__(self, name: str, info: Mapping[str, Any]) -> None:
        if name == "http11.send_request_headers.complete":
            self.sent_s = self.clock.now() - self.t0
        elif name == "connection.connect_tcp.started":
            self.fresh = True


def _preload_lazy_imports() -> None:
    """Import what httpx's stack imports on its first connection, before the clock starts.

    httpcore picks its network backend, and anyio its event-loop backend, on first use; the
    imports take tens of milliseconds that would otherwise land on the first sends.
    """
    for name in ("httpcore._backends.anyio", "anyio._backends._asyncio"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def build_request_bodies(
    trace: Trace,
    model: str,
    *,
    vocab: TokenRange,
    seed: int,
    extra_body: Mapping[str, Any] | None = None,
    indices: Sequence[int] | None = None,
    warm_blocks: frozenset[int] = frozenset(),
    warm_seed: int | None = None,
) -> list[bytes]:
    """JSON-encode the ``/v1/completions`` body of every request of a trace.

    Each body asks for exactly the trace's output length: ``max_tokens = output_tokens`` with
    ``ignore_eos``, streamed, with a final usage chunk; the prompt is a token-id list from
    :func:`~optimizer.workload.prompts.build_prompt_ids`.

    Args:
        trace: The trace.
        model: Served model name (the server's ``--served-model-name`` or model path).
        vocab: Token ids the prompts may use.
        seed: Prompt seed.
        extra_body: Fields added to (or overriding) every body, e.g. ``{"temperature": 1.0}``.
        indices: Each request's index for its prompt (default: its position), so that a part
            of a trace replayed apart builds the prompts the whole trace would.
        warm_blocks: Prefix blocks built from ``warm_seed`` (see
            :func:`~optimizer.workload.prompts.build_prompt_ids`).
        warm_seed: Their seed (None: ``seed`` for every block).

    Returns:
        One body per request, in trace order.
    """
    extra = dict(extra_body or {})
    bodies: list[bytes] = []
    positions = indices if indices is not None else range(len(trace.requests))
    for index, request in zip(positions, trace.requests, strict=True):
        body: dict[str, Any] = {
            "model": model,
            "prompt": build_prompt_ids(
                request,
                index,
                block_size=trace.block_size,
                seed=seed,
                vocab=vocab,
                warm_blocks=warm_blocks,
                warm_seed=warm_seed,
            ),
            "max_tokens": request.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            # Every generated token must stream as visible text, special ones included
            # (DESIGN.md §7.11): an invisible token would shift TTFT and ITL.
            "skip_special_tokens": False,
        }
        body.update(extra)
        bodies.append(json.dumps(body, separators=(",", ":")).encode())
    return bodies


class _Run:
    """State of one replay: the dispatcher, the request tasks and their records."""

    def __init__(
        self,
        *,
        clients: Sequence[httpx.AsyncClient],
        retry_client: httpx.AsyncClient | None,
        connections_per_client: int,
        requests: Sequence[httpx.Request],
        scheduled_s: Sequence[float],
        wanted_tokens: Sequence[int],
        input_tokens: Sequence[int],
        warmup_requests: int,
        clock: Clock,
        progress: Callable[[ReplayProgress], None] | None,
        progress_interval_s: float,
    ) -> None:
        self.clients = clients
        self.retry_client = retry_client
        self.retried = 0
        self.connections_per_client = connections_per_client
        # Requests in flight per client: more than its connections means queueing in its pool.
        self.in_flight_per_client = [0] * len(clients)
        self.pool_overflow = 0
        self.requests = requests
        self.scheduled_s = scheduled_s
        self.wanted_tokens = wanted_tokens
        self.input_tokens = input_tokens
        self.warmup_requests = warmup_requests
        self.clock = clock
        self.progress = progress
        self.progress_interval_s = progress_interval_s
        self.records: list[RequestRecord | None] = [None] * len(requests)
        self.finished: list[RequestRecord] = []
        self.in_flight_sent: dict[int, float] = {}
        self.streaming: set[int] = set()
        self.pending: set[asyncio.Task[None]] = set()
        self.t0 = 0.0
        self.cancel_reason = _REASON_CANCELLED
        self.sent = 0
        self.completed = 0
        self.failed = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self._last_progress_s = -float("inf")
        # TTFTs of measured requests that finished well, for progress displays only.
        self.ttft_ms: list[float] = []
        self._p95_ttft: tuple[float, float | None] = (-float("inf"), None)

    def _p95_ttft_so_far(self, now_s: float) -> float | None:
        """P95 of :attr:`ttft_ms` (numpy's linear percentile), cached for a second."""
        at, value = self._p95_ttft
        if now_s - at < 1.0 or not self.ttft_ms:
            return value
        value = float(np.percentile(self.ttft_ms, 95))
        self._p95_ttft = (now_s, value)
        return value

    def emit_progress(self, *, force: bool = False) -> None:
        if self.progress is None:
            return
        now_s = self.clock.now() - self.t0
        if not force and now_s - self._last_progress_s < self.progress_interval_s:
            return
        self._last_progress_s = now_s
        self.progress(
            ReplayProgress(
                elapsed_s=now_s,
                total=len(self.requests),
                sent=self.sent,
                completed=self.completed,
                failed=self.failed,
                in_flight=self.in_flight,
                p95_ttft_ms=self._p95_ttft_so_far(now_s),
            )
        )

    async def main(self) -> None:
        """Dispatch every request on schedule, then wait for all of them."""
        clock = self.clock
        loop = asyncio.get_running_loop()
        for index, scheduled in enumerate(self.scheduled_s):
            deadline = self.t0 + scheduled
            if clock.now() < deadline:
                await clock.sleep_until(deadline)
            task = loop.create_task(self._send(index))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        while self.pending:
            done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = None if task.cancelled() else task.exception()
                if exc is not None:
                    raise exc

    async def watch(
        self, stop_check: Callable[[ReplaySnapshot], str | None], interval_s: float
    ) -> str:
        """Poll ``stop_check`` until it returns a reason; returns that reason."""
        while True:
            await self.clock.sleep_until(self.clock.now() + interval_s)
            measured = [(i, t) for i, t in self.in_flight_sent.items() if i >= self.warmup_requests]
            reason = stop_check(
                ReplaySnapshot(
                    now_s=self.clock.now() - self.t0,
                    finished=tuple(self.finished),
                    waiting_sent_s=tuple(t for i, t in measured if i not in self.streaming),
                    streaming_sent_s=tuple(t for i, t in measured if i in self.streaming),
                )
            )
            if reason:
                return reason

    async def cancel_all(self, main: asyncio.Task[None]) -> None:
        """Stop dispatching, cancel in-flight requests, and wait until all tasks are gone."""
        main.cancel()
        tasks = [main, *self.pending]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(self, index: int) -> None:
        clock = self.clock
        t0 = self.t0
        wanted = self.wanted_tokens[index]
        # Stamped before any await: the send time until the socket write says otherwise
        # (requests that fail before they reach a socket, transports without trace hooks).
        dispatched_s = clock.now() - t0
        shard = index % len(self.clients)
        self._count_sent(index, shard, dispatched_s)

        chunk_times: list[float] = []
        usage_tokens: int | None = None
        done_s: float | None = None
        error: str | None = None
        request = self.requests[index]
        attempt = _Attempt(clock, t0)
        request.extensions["trace"] = attempt
        try:
            try:
                response = await self.clients[shard].send(request, stream=True)
            except httpx.TransportError as exc:
                # The server closed an idle connection as the request went out on it: it
                # never read the request, so sending it again cannot count it twice.
                if self.retry_client is None or attempt.fresh or not _reset_before_response(exc):
                    raise
                attempt = self._retry_attempt(index, request, attempt, exc)
                response = await self.retry_client.send(request, stream=True)
            try:
                if response.status_code != 200:
                    body = await response.aread()
                    error = (
                        f"HTTP {response.status_code}: "
                        f"{_snippet(body.decode('utf-8', errors='replace'))}"
                    )
                else:
                    parser = SSEParser()
                    async for data in response.aiter_raw():
                        now_s = clock.now() - t0
                        for event in parser.feed(data):
                            if isinstance(event, TextEvent):
                                # A chunk carrying several tokens counts once (as vLLM bench).
                                if event.text:
                                    if not chunk_times:
                                        self.streaming.add(index)
                                    chunk_times.append(now_s)
                            elif isinstance(event, UsageEvent):
                                usage_tokens = event.completion_tokens
                            elif isinstance(event, DoneEvent):
                                done_s = now_s
                            elif isinstance(event, ErrorEvent) and error is None:
                                error = event.message
                    for event in parser.close():
                        if isinstance(event, DoneEvent):
                            done_s = clock.now() - t0
                        elif isinstance(event, ErrorEvent) and error is None:
                            error = event.message
            finally:
                await response.aclose()
        except asyncio.CancelledError:
            error = _CANCELLED.format(reason=self.cancel_reason)
            sent_s = attempt.send_time(dispatched_s)
            self._finish(index, sent_s, chunk_times, usage_tokens, None, error)
            self.in_flight_per_client[shard] -= 1
            raise
        except httpx.HTTPError as exc:
            error = describe_error(exc)

        if error is None:
            error = _incomplete(done_s, usage_tokens, len(chunk_times), wanted)
        sent_s = attempt.send_time(dispatched_s)
        self._finish(index, sent_s, chunk_times, usage_tokens, done_s, error)
        self.in_flight_per_client[shard] -= 1

    def _count_sent(self, index: int, shard: int, dispatched_s: float) -> None:
        """Count a request as sent and in flight (on its client pool too)."""
        self.sent += 1
        self.in_flight_sent[index] = dispatched_s
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.in_flight_per_client[shard] += 1
        if self.in_flight_per_client[shard] > self.connections_per_client:
            self.pool_overflow += 1
        self.emit_progress()

    def _retry_attempt(
        self, index: int, request: httpx.Request, attempt: _Attempt, exc: BaseException
    ) -> _Attempt:
        """A second attempt at a request, keeping the first attempt's send time."""
        self.retried += 1
        logger.info(
            "request %d: %s on a reused connection before any response; retrying on a fresh one",
            index,
            describe_error(exc),
        )
        first_sent_s = attempt.sent_s
        attempt = _Attempt(self.clock, self.t0)
        attempt.sent_s_first = first_sent_s
        request.extensions["trace"] = attempt
        return attempt

    def _finish(
        self,
        index: int,
        sent_s: float,
        chunk_times: list[float],
        usage_tokens: int | None,
        done_s: float | None,
        error: str | None,
    ) -> None:
        end_s = done_s if done_s is not None else self.clock.now() - self.t0
        self.in_flight_sent.pop(index, None)
        self.streaming.discard(index)
        record = self.records[index] = RequestRecord(
            index=index,
            scheduled_s=self.scheduled_s[index],
            sent_s=sent_s,
            first_token_s=chunk_times[0] if chunk_times else None,
            chunk_times_s=tuple(chunk_times),
            end_s=end_s,
            input_tokens=self.input_tokens[index],
            output_tokens=usage_tokens if usage_tokens is not None else len(chunk_times),
            error=error,
            warmup=index < self.warmup_requests,
        )
        self.finished.append(record)
        self.in_flight -= 1
        if error is None and chunk_times and self.progress is not None and not record.warmup:
            self.ttft_ms.append((chunk_times[0] - sent_s) * 1000.0)
        if error is None:
            self.completed += 1
        else:
            self.failed += 1
        self.emit_progress()

    def account_unsent(self, stop_s: float) -> None:
        """Record the requests that were never sent (the replay stopped before them)."""
        reason = self.cancel_reason
        for index, record in enumerate(self.records):
            if record is None:
                self.records[index] = RequestRecord(
                    index=index,
                    scheduled_s=self.scheduled_s[index],
                    # Never sent: both times are when the replay gave up on the request.
                    sent_s=stop_s,
                    first_token_s=None,
                    chunk_times_s=(),
                    end_s=stop_s,
                    input_tokens=self.input_tokens[index],
                    output_tokens=0,
                    error=_NOT_SENT.format(reason=reason),
                    warmup=index < self.warmup_requests,
                )
                self.failed += 1


def _incomplete(
    done_s: float | None, usage_tokens: int | None, chunks: int, wanted: int
) -> str | None:
    """Why a response that raised no error is still not a complete one (None: it is)."""
    output_tokens = usage_tokens if usage_tokens is not None else chunks
    if done_s is None:
        return "stream ended without [DONE]"
    if output_tokens < wanted:
        return f"short output: {output_tokens} of {wanted} tokens"
    return None


def _judge(
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
    opts = _with_warm_blocks(_options(options, overrides), trace)
    warm = await _preroll(trace, url, model, vocab=vocab, seed=seed, opts=opts, transport=transport)
    clock = clock if clock is not None else MonotonicClock()
    scheduled_s = _schedule(trace, opts)
    bodies = _bodies(trace, model, vocab, seed, opts)
    async with contextlib.AsyncExitStack() as stack:
        clients, retry_client, connections_per_client = await _open_clients(
            stack, url, opts, transport
        )
        requests = _http_requests(clients, opts, bodies)
        del bodies
        run = _Run(
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


def _request_headers(opts: ReplayOptions) -> dict[str, str]:
    """The headers of every request: JSON in, an unencoded event stream out."""
    # identity: no decoder layer on the stream (vLLM does not compress it anyway).
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
        "Accept-Encoding": "identity",
    }
    if opts.api_key:
        headers["Authorization"] = f"Bearer {opts.api_key}"
    return headers


def _http_requests(
    clients: Sequence[httpx.AsyncClient], opts: ReplayOptions, bodies: Sequence[bytes]
) -> list[httpx.Request]:
    """A ready request per body, spread round-robin over the client pools."""
    headers = _request_headers(opts)
    shards = len(clients)
    return [
        clients[index % shards].build_request("POST", opts.endpoint, content=body, headers=headers)
        for index, body in enumerate(bodies)
    ]


async def _open_clients(
    stack: contextlib.AsyncExitStack,
    url: str,
    opts: ReplayOptions,
    transport: httpx.AsyncBaseTransport | None,
) -> tuple[list[httpx.AsyncClient], httpx.AsyncClient | None, int]:
    """The client pools (closed by ``stack``), the retry client, and connections per pool."""
    lean = transport is None and opts.lean_transport and url.startswith("http:")
    shards = 1 if lean else max(1, min(opts.client_shards, opts.max_connections))
    connections_per_client = -(-opts.max_connections // shards)
    limits = httpx.Limits(
        max_connections=connections_per_client,
        max_keepalive_connections=connections_per_client,
        keepalive_expiry=opts.keepalive_expiry_s,
    )
    # pool=None: a request waiting for a connection is a client problem reported through
    # schedule_kept, never a timeout; read=None: a slow first token is data.
    timeout = httpx.Timeout(
        connect=opts.connect_timeout_s, read=opts.read_timeout_s, write=60.0, pool=None
    )
    _preload_lazy_imports()
    # One TLS context for every pool: each would otherwise load the CA bundle (tens of ms).
    ssl_context = httpx.create_ssl_context() if url.startswith("https:") else False
    retry_transport = transport
    if lean:
        transport = LeanTransport(
            keepalive_expiry_s=opts.keepalive_expiry_s, connect_timeout_s=opts.connect_timeout_s
        )
        # Expiry 0: never reuses a connection, so a retry always gets a fresh one.
        retry_transport = LeanTransport(
            keepalive_expiry_s=0.0, connect_timeout_s=opts.connect_timeout_s
        )
    # Several small pools instead of one big one: httpcore's pool bookkeeping costs
    # O(connections^2) per request and event (encode/httpx#3215), so one pool of
    # thousands of connections cannot keep a schedule of a few hundred requests/s.
    clients = [
        await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=url,
                transport=transport,
                limits=limits,
                timeout=timeout,
                trust_env=opts.trust_env,
                verify=ssl_context,
            )
        )
        for _ in range(shards)
    ]
    # Retries go on connections of their own, never reused: a fresh one each time.
    retry_client = None
    if opts.retry_reset:
        retry_client = await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=url,
                transport=retry_transport,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
                timeout=timeout,
                trust_env=opts.trust_env,
                verify=ssl_context,
            )
        )
    return clients, retry_client, connections_per_client


async def _run_until_stopped(
    run: _Run,
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
            run.cancel_reason = _REASON_CANCELLED
        await run.cancel_all(main)
        raise
    finally:
        for side in (timer, watcher):
            if side is not None:
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)
    return stopped_early, stop_reason


def _result(
    run: _Run, clock: Clock, opts: ReplayOptions, stopped_early: bool, stop_reason: str
) -> ReplayResult:
    """Account for the requests never sent, judge the send lag, and gather the result."""
    stop_s = clock.now() - run.t0
    run.account_unsent(stop_s)
    run.emit_progress(force=True)
    records = tuple(r for r in run.records if r is not None)
    ends = [r.end_s for r in records]
    duration_s = max(ends) if ends else stop_s
    p99_ms, max_ms, kept, message = _judge(
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
            opts=_options(options, {}),
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
    return _with_warm_blocks(_options(kwargs.get("options"), overrides), trace)


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
    p99_ms, max_ms, kept, message = _judge(
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
