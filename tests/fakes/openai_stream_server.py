"""A fake, minimal OpenAI-compatible streaming completions server for loopback tests.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length request bodies, chunked responses)
on raw ``asyncio`` streams to answer ``POST /v1/completions`` the way vLLM does when asked to
stream: one ``data:`` chunk per generated token (``max_tokens`` of them, as with
``ignore_eos``), a final usage chunk when ``stream_options.include_usage`` is set, then
``data: [DONE]``. It generates nothing and costs almost no CPU, so a loopback replay against it
measures the *client*: the benchmarks use it to find the request rate a replayer can keep.

It records the arrival time (``time.monotonic()``, the system-wide monotonic clock on Linux, so
comparable across processes) of every completion request; ``GET /arrivals`` returns them as
JSON and ``POST /arrivals/reset`` clears them (and the timings). ``GET /timings`` returns, per
streamed completion, its arrival and the times each token chunk was written (same clock): what
the server actually did, the truth a client's TTFT and ITL are checked against. Also answers ``GET /health`` and
``GET /v1/models``.

With ``keepalive_s`` it closes idle connections the way vLLM's server (uvicorn on uvloop, whose
idle timeout is 5 s) does, race included: a request read from a connection that has been idle
longer than ``keepalive_s`` is not answered, the connection is reset (after a stall, such as
``SIGSTOP``, libuv runs the overdue idle timer before it reads the request that is waiting).
``GET /stats`` counts the idle connections it closed and the requests lost that way.

Run it with ``python -m tests.fakes.openai_stream_server --port 8000 [--ttft-ms 0]
[--itl-ms 0] [--keepalive-s 5]``; it prints ``listening on <port>`` once it accepts connections (``--port 0``
picks a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from subprocess import PIPE, Popen
from typing import Any

__all__ = ["FakeOpenAIServer", "in_subprocess", "main"]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeOpenAIServer:
    """The fake server.

    Args:
        host: Address to bind.
        port: Port to bind (0 picks a free one; read :attr:`port` after :meth:`start`).
        ttft_s: Delay before the first token chunk.
        itl_s: Delay between token chunks (0: all chunks in one write). Tokens are written at
            absolute deadlines (first token + ``k * itl_s``), so timer lateness never adds up.
        keepalive_s: Idle timeout of a connection between two requests (None: none).
        vocab: Reject (HTTP 400, as vLLM does) token-id prompts with an id at or above this.
        token_text: Text of every token chunk.
        model: Model name reported by ``/v1/models``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ttft_s: float = 0.0,
        itl_s: float = 0.0,
        token_text: str = " tok",
        model: str = "fake-model",
        keepalive_s: float | None = None,
        vocab: int | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.token_text = token_text
        self.model = model
        self.keepalive_s = keepalive_s
        self.vocab = vocab
        self.idle_closes = 0
        self.lost_requests = 0
        self.arrivals: list[float] = []
        self.prompt_lengths: list[int] = []
        self.timings: list[list[float]] = []
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Start listening; returns the bound port."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and drop open connections."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        idle_since: float | None = None
        try:
            while True:
                try:
                    if self.keepalive_s is not None and idle_since is not None:
                        head = await asyncio.wait_for(
                            reader.readuntil(b"\r\n\r\n"), self.keepalive_s
                        )
                    else:
                        head = await reader.readuntil(b"\r\n\r\n")
                except TimeoutError:
                    # A request may be waiting already: the timer ran before the read.
                    self.idle_closes += 1
                    self.lost_requests += bool(reader._buffer)  # type: ignore[attr-defined]
                    self._reset(writer)
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                arrival = time.monotonic()
                if (
                    self.keepalive_s is not None
                    and idle_since is not None
                    and arrival - idle_since > self.keepalive_s
                ):
                    # The idle timer was due before this read: it wins, the request is lost.
                    self.idle_closes += 1
                    self.lost_requests += 1
                    self._reset(writer)
                    return
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _version = request_line.split(" ", 2)
                headers = {}
                for line in header_lines:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                keep_alive = headers.get("connection", "").lower() != "close"
                await self._route(method, path, body, arrival, writer)
                idle_since = time.monotonic()
                if not keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        """Close with a TCP reset, as a close with an unread request in the socket does."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _route(
        self, method: str, path: str, body: bytes, arrival: float, writer: asyncio.StreamWriter
    ) -> None:
        if method == "POST" and path == "/v1/completions":
            await self._completions(body, arrival, writer)
        elif method == "GET" and path == "/health":
            self._respond(writer, 200, b"")
        elif method == "GET" and path == "/v1/models":
            card = {"id": self.model, "object": "model", "root": f"/nonexistent/{self.model}"}
            models = {"object": "list", "data": [card]}
            self._respond(writer, 200, json.dumps(models).encode())
        elif method == "GET" and path == "/stats":
            stats = {
                "idle_closes": self.idle_closes,
                "lost_requests": self.lost_requests,
                "completions": len(self.arrivals),
            }
            self._respond(writer, 200, json.dumps(stats).encode())
        elif method == "GET" and path == "/timings":
            self._respond(writer, 200, json.dumps(self.timings).encode())
        elif method == "GET" and path == "/arrivals":
            self._respond(writer, 200, json.dumps(self.arrivals).encode())
        elif method == "POST" and path == "/arrivals/reset":
            self.arrivals.clear()
            self.prompt_lengths.clear()
            self.timings.clear()
            self._respond(writer, 200, b"{}")
        else:
            self._respond(writer, 404, b'{"error": {"message": "not found"}}')
        await writer.drain()

    def _respond(self, writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        writer.write(
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )

    async def _completions(self, body: bytes, arrival: float, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(body)
            n_tokens = int(request.get("max_tokens") or 16)
            prompt = request.get("prompt", "")
        except (ValueError, TypeError, AttributeError):
            self._respond(writer, 400, b'{"error": {"message": "bad request body"}}')
            return
        if (
            self.vocab is not None
            and isinstance(prompt, list)
            and max(prompt, default=0) >= self.vocab
        ):
            message = f"Token id {max(prompt)} is out of vocabulary"
            self._respond(writer, 400, json.dumps({"error": {"message": message}}).encode())
            return
        self.arrivals.append(arrival)
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        self.prompt_lengths.append(prompt_tokens)
        created = int(time.time())
        if not request.get("stream"):
            text = self.token_text * n_tokens
            answer = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": created,
                "model": request.get("model", self.model),
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n_tokens,
                    "total_tokens": prompt_tokens + n_tokens,
                },
            }
            if self.ttft_s:
                await asyncio.sleep(self.ttft_s + self.itl_s * (n_tokens - 1))
            self._respond(writer, 200, json.dumps(answer).encode())
            return

        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        timing = [arrival]
        self.timings.append(timing)
        loop = asyncio.get_running_loop()
        first_token_at = loop.time() + self.ttft_s
        if self.ttft_s:
            await writer.drain()
            await asyncio.sleep(first_token_at - loop.time())
        for i in range(n_tokens):
            last = i == n_tokens - 1
            event = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": created,
                "model": request.get("model", self.model),
                "choices": [
                    {
                        "index": 0,
                        "text": self.token_text,
                        "logprobs": None,
                        "finish_reason": "length" if last else None,
                    }
                ],
                "usage": None,
            }
            writer.write(_chunk(_sse(event)))
            timing.append(time.monotonic())
            if self.itl_s and not last:
                await writer.drain()
                await asyncio.sleep(max(0.0, first_token_at + (i + 1) * self.itl_s - loop.time()))
        if (request.get("stream_options") or {}).get("include_usage"):
            usage = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": created,
                "model": request.get("model", self.model),
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n_tokens,
                    "total_tokens": prompt_tokens + n_tokens,
                },
            }
            writer.write(_chunk(_sse(usage)))
        writer.write(_chunk(_sse("[DONE]")) + b"0\r\n\r\n")


async def _amain(args: argparse.Namespace) -> None:
    server = FakeOpenAIServer(
        args.host,
        args.port,
        ttft_s=args.ttft_ms / 1e3,
        itl_s=args.itl_ms / 1e3,
        keepalive_s=args.keepalive_s,
        vocab=args.vocab,
    )
    port = await server.start()
    print(f"listening on {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="delay between tokens")
    parser.add_argument(
        "--keepalive-s", type=float, default=None, help="idle timeout of a connection"
    )
    parser.add_argument("--vocab", type=int, default=None, help="reject token ids at or above")
    asyncio.run(_amain(parser.parse_args(argv)))


@contextlib.contextmanager
def in_subprocess(*flags: str, new_session: bool = False) -> Iterator[tuple[str, Popen[str]]]:
    """This FAKE server in a process of its own (``--port 0`` and ``flags``): its base URL and
    the process (to stop or signal it); terminated on exit (a stopped one is continued first).
    ``new_session``: in a process group of its own (``os.getpgid(process.pid)``)."""
    root = Path(__file__).resolve().parents[2]
    process = Popen(
        [sys.executable, "-m", "tests.fakes.openai_stream_server", "--port", "0", *flags],
        cwd=root,
        stdout=PIPE,
        text=True,
        start_new_session=new_session,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("listening on"), line
        yield f"http://127.0.0.1:{int(line.split()[-1])}", process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    main()
