"""The HTTP side of one replay: the JSON bodies and ready requests, the client pools and the
retry client, and :class:`ReplayRun`, which dispatches every request at its scheduled time, streams
each response through :class:`~optimizer.workload.sse.SSEParser` and keeps what it observed as a
:class:`~optimizer.types.RequestRecord`. A request's send time is its first socket write
(httpcore's ``trace`` hook); a request the server never read because it closed the reused
connection as idle is sent once more on a fresh one. :func:`describe_error` names a transport
failure with the OS error under it. :func:`optimizer.workload.replay.replay` runs all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import numpy as np

from optimizer.types import RequestRecord, Trace
from optimizer.workload.http11 import LeanTransport
from optimizer.workload.prompts import TokenRange, build_prompt_ids
from optimizer.workload.replay_records import (
    Clock,
    ReplayOptions,
    ReplayProgress,
    ReplaySnapshot,
)
from optimizer.workload.sse import DoneEvent, ErrorEvent, SSEParser, TextEvent, UsageEvent

__all__ = [
    "REASON_CANCELLED",
    "ReplayRun",
    "build_request_bodies",
    "describe_error",
    "http_requests",
    "open_clients",
]

logger = logging.getLogger(__name__)

_SNIPPET_CHARS = 200
_NOT_SENT = "not sent: {reason}"
_CANCELLED = "cancelled: {reason}"
REASON_CANCELLED = "replay cancelled"


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


class ReplayRun:
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
        self.cancel_reason = REASON_CANCELLED
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


def http_requests(
    clients: Sequence[httpx.AsyncClient], opts: ReplayOptions, bodies: Sequence[bytes]
) -> list[httpx.Request]:
    """A ready request per body, spread round-robin over the client pools."""
    headers = _request_headers(opts)
    shards = len(clients)
    return [
        clients[index % shards].build_request("POST", opts.endpoint, content=body, headers=headers)
        for index, body in enumerate(bodies)
    ]


async def open_clients(
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
