"""A lean HTTP/1.1 transport for httpx, on asyncio protocols: the replay client's hot path.

httpx's default transport (httpcore, h11, anyio) runs a dozen coroutine layers, context managers
and an event-object state machine for every network read of a streamed response: most of the
replay client's CPU time (about 40 % of it in a profile of a loopback replay). vLLM's
benchmark client (aiohttp, a C parser) does far less per read. This transport does what a
replay needs and no more: plain-text HTTP/1.1 with keep-alive, ``Content-Length`` and chunked
bodies, parsed in :meth:`asyncio.Protocol.data_received` and handed to the reader as one joined
piece per network read (the same per-read granularity as aiohttp's and httpx's streams).

Connections are kept in one pool, reused most-recently-idle first so that few connections stay
warm and the rest reach the client's idle expiry (closed here, cleanly, before the server's
idle timeout could race a request). It calls the request's ``trace`` extension with the two
events the replayer uses (``connection.connect_tcp.started``,
``http11.send_request_headers.complete``) and raises httpx's exceptions, each chained to the
OS error under it. TLS, proxies, HTTP/2 and request streaming are out of scope: the replayer
uses httpx's own transport for ``https`` URLs.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

__all__ = ["LeanTransport"]

_HEAD_END = b"\r\n\r\n"
_CRLF = b"\r\n"
_MAX_HEAD = 64 * 1024


class _Connection(asyncio.Protocol):
    """One TCP connection and the parser of the response it is receiving."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.pieces: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.lost = False
        self.lost_error: BaseException | None = None
        self.eof = False
        self.idle_since = 0.0
        self.requests = 0
        self._reset_response()

    def _reset_response(self) -> None:
        self.head: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None
        self.chunked = False
        self.remaining = -1  # body bytes left (Content-Length or current chunk); -1: unknown
        self.until_close = False
        self.body_done = False
        self.keep_alive = True
        self.expect_chunk_crlf = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        try:
            self._parse()
        except httpx.RemoteProtocolError as exc:
            self.lost_error = exc
            self.close()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        if self.until_close and self.head is not None:
            self.body_done = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if exc is not None and self.lost_error is None:
            self.lost_error = exc
        if self.until_close and self.head is not None and exc is None:
            self.body_done = True
        self._wake()

    # -- helpers

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def usable(self) -> bool:
        return (
            not self.lost
            and not self.eof
            and self.transport is not None
            and not self.transport.is_closing()
            and not self.buffer
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.lost = True

    def failure(self, *, during: str) -> httpx.TransportError:
        """The httpx exception for a connection that ended before the response did."""
        error = self.lost_error
        if isinstance(error, httpx.TransportError):
            return error
        if error is not None:
            exc: httpx.TransportError = httpx.ReadError(str(error) or type(error).__name__)
            exc.__cause__ = error
            return exc
        if during == "head":
            return httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body"
        )

    # -- parser

    def _parse(self) -> None:
        if self.head is None:
            end = self.buffer.find(_HEAD_END)
            if end < 0:
                if len(self.buffer) > _MAX_HEAD:
                    raise httpx.RemoteProtocolError("response head too large")
                return
            self._parse_head(bytes(self.buffer[:end]))
            del self.buffer[: end + 4]
        if not self.body_done:
            self._parse_body()

    def _parse_head(self, raw: bytes) -> None:
        status_line, *lines = raw.split(_CRLF)
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise httpx.RemoteProtocolError(f"malformed status line {status_line[:80]!r}")
        try:
            status = int(parts[1])
        except ValueError as exc:
            raise httpx.RemoteProtocolError(f"malformed status line {status_line[:80]!r}") from exc
        headers: list[tuple[bytes, bytes]] = []
        length = -1
        for line in lines:
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            name, value = name.strip(), value.strip()
            headers.append((name, value))
            lower = name.lower()
            if lower == b"transfer-encoding" and b"chunked" in value.lower():
                self.chunked = True
            elif lower == b"content-length":
                try:
                    length = int(value)
                except ValueError as exc:
                    raise httpx.RemoteProtocolError(f"bad content-length {value!r}") from exc
            elif lower == b"connection" and value.lower() == b"close":
                self.keep_alive = False
        if parts[0] == b"HTTP/1.0":
            self.keep_alive = False
        self.head = (status, parts[2] if len(parts) > 2 else b"", headers)
        if self.chunked:
            self.remaining = -1
        elif length >= 0:
            self.remaining = length
            self.body_done = length == 0
        elif status in (204, 304) or 100 <= status < 200:
            self.body_done = True
        else:
            self.until_close = True
            self.keep_alive = False

    def _parse_body(self) -> None:
        buffer = self.buffer
        if self.until_close:
            if buffer:
                self.pieces.append(bytes(buffer))
                buffer.clear()
            return
        if not self.chunked:
            if buffer:
                take = min(self.remaining, len(buffer))
                self.pieces.append(bytes(buffer[:take]))
                del buffer[:take]
                self.remaining -= take
            if self.remaining == 0:
                self.body_done = True
            return
        while buffer:
            if self.expect_chunk_crlf:
                if len(buffer) < 2:
                    return
                del buffer[:2]
                self.expect_chunk_crlf = False
            if self.remaining <= 0:
                end = buffer.find(_CRLF)
                if end < 0:
                    return
                size_field = bytes(buffer[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_field, 16)
                except ValueError as exc:
                    raise httpx.RemoteProtocolError(f"bad chunk size {size_field[:20]!r}") from exc
                if size == 0:
                    # Last chunk: no trailers expected; the terminating CRLF follows.
                    trailer_end = buffer.find(_CRLF, end + 2)
                    if trailer_end < 0:
                        return
                    del buffer[: trailer_end + 2]
                    self.body_done = True
                    return
                del buffer[: end + 2]
                self.remaining = size
            take = min(self.remaining, len(buffer))
            if take == 0:
                return
            self.pieces.append(bytes(buffer[:take]))
            del buffer[:take]
            self.remaining -= take
            if self.remaining == 0:
                self.expect_chunk_crlf = True


class _Body(httpx.AsyncByteStream):
    """The streamed body of one response: one joined piece per network read."""

    def __init__(self, pool: LeanTransport, connection: _Connection) -> None:
        self.pool = pool
        self.connection = connection
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self.connection
        while True:
            if connection.pieces:
                pieces = connection.pieces
                data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                yield data
                continue
            if connection.body_done:
                return
            if connection.lost or connection.eof:
                raise connection.failure(during="body")
            await connection.wait()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        connection = self.connection
        if connection.body_done and connection.keep_alive and connection.usable():
            self.pool.release(connection)
        else:
            self.pool.discard(connection)


class LeanTransport(httpx.AsyncBaseTransport):
    """Plain-text HTTP/1.1 keep-alive transport (see the module docstring).

    Args:
        keepalive_expiry_s: Idle connections older than this are closed, never reused.
        connect_timeout_s: Default TCP connect timeout (a request's own ``timeout`` extension
            wins).
    """

    def __init__(self, *, keepalive_expiry_s: float = 3.0, connect_timeout_s: float = 10.0) -> None:
        self.keepalive_expiry_s = keepalive_expiry_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}
        self._all: set[_Connection] = set()
        self.opened = 0

    def _acquire(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_allowed = time.monotonic() - self.keepalive_expiry_s
        # Expire from the cold end, reuse from the warm end.
        while idle and idle[0].idle_since < oldest_allowed:
            stale = idle.popleft()
            stale.close()
            self._all.discard(stale)
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
            connection.close()
            self._all.discard(connection)
        return None

    def release(self, connection: _Connection) -> None:
        """Put a connection whose response is complete back into the pool."""
        connection._reset_response()
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, collections.deque()).append(connection)

    def discard(self, connection: _Connection) -> None:
        """Close a connection that cannot be reused."""
        connection.close()
        self._all.discard(connection)

    async def _connect(self, key: tuple[str, int], timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(lambda: _Connection(key), *key)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connect to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        self._all.add(connection)
        self.opened += 1
        return connection

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"LeanTransport speaks plain http, not {url.scheme}")
        key = (url.host, url.port or 80)
        trace = request.extensions.get("trace")
        connection = self._acquire(key)
        if connection is None:
            if trace is not None:
                await trace("connection.connect_tcp.started", {})
            timeouts: dict[str, Any] = request.extensions.get("timeout") or {}
            connect_timeout = timeouts.get("connect", self.connect_timeout_s)
            connection = await self._connect(key, connect_timeout)
        body = request.content
        head = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), url.raw_path)]
        head += [b"%s: %s" % (name, value) for name, value in request.headers.raw]
        transport = connection.transport
        assert transport is not None
        if not connection.usable():
            self.discard(connection)
            raise httpx.WriteError("connection closed before the request was written")
        transport.write(_CRLF.join(head) + _HEAD_END + body)
        connection.requests += 1
        if trace is not None:
            await trace("http11.send_request_headers.complete", {})
        try:
            while connection.head is None:
                if connection.lost or connection.eof:
                    raise connection.failure(during="head")
                await connection.wait()
        except BaseException:
            self.discard(connection)
            raise
        status, reason, headers = connection.head
        return httpx.Response(
            status,
            headers=headers,
            stream=_Body(self, connection),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
        )

    async def aclose(self) -> None:
        for connection in list(self._all):
            connection.close()
        self._all.clear()
        self._idle.clear()
