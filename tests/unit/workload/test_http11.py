"""LeanTransport against scripted raw-socket servers: framing, reuse, expiry, failures."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import httpx
import pytest

from optimizer.workload.http11 import LeanTransport
from optimizer.workload.replay_client import describe_error

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


def _run(handler: Handler, test: Callable[[str, LeanTransport], Awaitable[None]]) -> None:
    async def go() -> None:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = LeanTransport(keepalive_expiry_s=0.5)
        try:
            await test(f"http://127.0.0.1:{port}", transport)
        finally:
            await transport.aclose()
            server.close()

    asyncio.run(go())


async def _stream(client: httpx.AsyncClient, body: bytes = b"{}") -> tuple[int, bytes]:
    request = client.build_request("POST", "/v1/completions", content=body)
    response = await client.send(request, stream=True)
    try:
        data = b"".join([piece async for piece in response.aiter_raw()])
    finally:
        await response.aclose()
    return response.status_code, data


def test_chunked_body_split_anywhere_and_connection_reused() -> None:
    chunks = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                requests.append(await _read_request(reader))
            except asyncio.IncompleteReadError:
                return
            payload = head + wire
            for i in range(0, len(payload), 3):  # 3-byte writes: splits lines and sizes
                writer.write(payload[i : i + 3])
                await writer.drain()
                await asyncio.sleep(0)

    async def test(url: str, transport: LeanTransport) -> None:
        async with httpx.AsyncClient(base_url=url, transport=transport) as client:
            for _ in range(3):
                assert await _stream(client, b'{"x": 1}') == (200, b"".join(chunks))
        assert transport.opened == 1
        assert requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert requests[0].endswith(b'\r\n\r\n{"x": 1}')

    _run(handler, test)


def test_content_length_error_body_then_expiry_opens_a_new_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            body = b'{"error": "bad"}'
            writer.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )

    async def test(url: str, transport: LeanTransport) -> None:
        async with httpx.AsyncClient(base_url=url, transport=transport) as client:
            assert await _stream(client) == (400, b'{"error": "bad"}')
            assert await _stream(client) == (400, b'{"error": "bad"}')
            assert transport.opened == 1
            await asyncio.sleep(0.6)  # past the 0.5 s expiry: closed, not reused
            assert await _stream(client) == (400, b'{"error": "bad"}')
            assert transport.opened == 2

    _run(handler, test)


def test_disconnect_before_response_and_reset_carry_their_cause() -> None:
    mode = {"reset": False}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if mode["reset"]:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    async def test(url: str, transport: LeanTransport) -> None:
        async with httpx.AsyncClient(base_url=url, transport=transport) as client:
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await _stream(client)
            mode["reset"] = True
            with pytest.raises(httpx.ReadError) as info:
                await _stream(client)
            assert "ECONNRESET" in describe_error(info.value)

    _run(handler, test)


def test_truncated_chunked_body_is_an_error_and_refused_connect_names_errno() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel")
        await writer.drain()
        writer.close()

    async def test(url: str, transport: LeanTransport) -> None:
        async with httpx.AsyncClient(base_url=url, transport=transport) as client:
            with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
                await _stream(client)
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=transport) as c:
            with pytest.raises(httpx.ConnectError) as info:
                await _stream(c)
            assert "ECONNREFUSED" in describe_error(info.value)

    _run(handler, test)
