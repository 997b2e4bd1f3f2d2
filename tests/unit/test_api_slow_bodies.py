"""Slow request bodies against the real app over a real socket (issue 42, item 1).

The app of ``test_api`` (a real JobService, a FAKE driver launcher) runs under uvicorn on
loopback behind :class:`ReplicaSlots`, which takes requests as Serve's replica does: at most
:data:`~optimizer.service.settings.REPLICA_SLOTS` at once (``max_ongoing_requests``), the rest
waiting in line (Serve's proxy queues them). Clients are raw sockets: headers with a
Content-Length, then a body byte now and then, as the attack did. Before the body bounds, 66
such connections filled the slots and ``/healthz`` waited for as long as they hung;
``tests/integration/test_service_slow_bodies.py`` shows the same on the real Serve deployment.
``-s`` prints the measured latencies.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import socket
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from optimizer.errors import ConfigError
from optimizer.service.api import create_app, settings_from_args
from optimizer.service.auth import TokenEntry, hash_token
from optimizer.service.settings import REPLICA_SLOTS
from tests.unit.test_jobs import FakeLauncher, job_doc, make_service

TEAMS = {"alpha": "alpha-token", "beta": "beta-token"}
PROBE_TIMEOUT_S = 5.0
#: The attack's connections open this far apart (200 of them over 2 s).
RAMP_S = 0.01


class ReplicaSlots:
    """An ASGI app taken as Serve's replica takes requests: ``slots`` at once, the rest wait."""

    def __init__(self, app: Any, slots: int = REPLICA_SLOTS) -> None:
        self.app, self.slots = app, slots
        self._free: asyncio.Semaphore | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        async with self._free:
            await self.app(scope, receive, send)


def _serve(tmp: str, bounds: dict[str, Any], port: Any) -> None:
    """The child process: the app under uvicorn on a loopback port (sent back on ``port``)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port.send(sock.getsockname()[1])
    config = uvicorn.Config(
        app_with(Path(tmp), **bounds), log_level="warning", lifespan="off", access_log=False
    )
    uvicorn.Server(config).run(sockets=[sock])


@contextmanager
def served(tmp_path: Path, **bounds: Any) -> Iterator[int]:
    """The app with body ``bounds`` under uvicorn in a process of its own (the clients' own
    work never delays its answers); its port once it answers."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(str(tmp_path), bounds, theirs), daemon=True)
    proc.start()
    try:
        assert mine.poll(60), "the server process did not start"
        port = int(mine.recv())
        deadline = time.monotonic() + 60
        while True:
            try:
                if asyncio.run(request(port, "GET", "/healthz"))[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "uvicorn did not answer"
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def app_with(tmp_path: Path, **bounds: Any) -> Any:
    """The real app (two teams' tokens and ``good-token``) with body ``bounds``, as the replica
    runs it."""
    tokens = tuple(TokenEntry(hash_token(t), team) for team, t in TEAMS.items())
    service = make_service(tmp_path, FakeLauncher(), tokens=tokens, **bounds)
    return ReplicaSlots(create_app(service))


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response (with a Content-Length)."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("closed before an answer")
    status = int(status_line.split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        if key.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


def _head(method: str, path: str, token: str | None, length: int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: loopback", "Connection: close"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if length:
        lines += ["Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def request(
    port: int, method: str, path: str, token: str | None = None, body: bytes = b""
) -> tuple[int, bytes]:
    """One request on a connection of its own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_head(method, path, token, len(body)) + body)
        await writer.drain()
        return await asyncio.wait_for(_response(reader), PROBE_TIMEOUT_S)
    finally:
        writer.close()


async def slow_body(
    port: int,
    token: str | None,
    *,
    body: bytes = b" " * 100_000,
    chunk: int = 1,
    every_s: float = 1.0,
    hold_s: float = 60.0,
    after_s: float = 0.0,
) -> tuple[int | None, float, bytes]:
    """POST /v1/studies, ``after_s`` from now, sending ``chunk`` bytes of ``body`` every
    ``every_s`` (after the headers): (its status, None when none came within ``hold_s``;
    seconds to it; its body)."""
    await asyncio.sleep(after_s)
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = asyncio.ensure_future(_response(reader))
    try:
        writer.write(_head("POST", "/v1/studies", token, len(body)))
        sent = 0
        while not answer.done() and time.monotonic() - t0 < hold_s:
            if sent < len(body):
                try:
                    writer.write(body[sent : sent + chunk])
                    await writer.drain()
                except OSError:  # answered and closed
                    pass
                sent += chunk
            await asyncio.wait({answer}, timeout=every_s)
        if not answer.done():
            return None, time.monotonic() - t0, b""
        try:
            status, text = answer.result()
        except (ConnectionError, asyncio.IncompleteReadError):
            return None, time.monotonic() - t0, b""
        return status, time.monotonic() - t0, text
    finally:
        answer.cancel()
        writer.close()


async def probe_while(
    busy: Awaitable[Any], port: int, probes: list[Callable[[], Awaitable[Any]]]
) -> dict[str, list[float]]:
    """Latencies (ms) of each probe, run one after another every 50 ms until ``busy`` ends;
    a probe that fails or times out counts as :data:`PROBE_TIMEOUT_S`."""
    for probe in probes:  # warm: the first read of a route is not what is measured
        await probe()
    task = asyncio.ensure_future(busy)
    seen: dict[str, list[float]] = {}
    await asyncio.sleep(0.05)
    while not task.done():
        for i, probe in enumerate(probes):
            t0 = time.perf_counter()
            try:
                status, _ = await probe()
                ok = status == 200
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                ok = False
            ms = (time.perf_counter() - t0) * 1000 if ok else PROBE_TIMEOUT_S * 1000
            seen.setdefault(str(i), []).append(ms)
        await asyncio.sleep(0.05)
    await task
    return seen


def _p95(values: list[float]) -> float:
    """The 95th percentile (nearest rank)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(0.95 * len(ranked)) - 1)]


#: What the probes' p95 may take while the slow bodies hang (issue 42: within 100 ms), unless the
#: machine's own noise (the same probes just before, nothing else sent) already comes near it:
#: then twice that noise, never more than a second (a stall lasts as long as the bodies hang).
LATENCY_MS = 100.0
#: What any one probe may take. On a shared 2-core machine one probe in a few hundred is
#: delayed by the scheduler (up to 0.62 s was seen in CI with every other probe near 10 ms),
#: so the bound on each probe is a stall's, not the p95's: before the fixes a stalled probe
#: waited the whole hold (30-42 s in the issue, 4 s in these tests), the p95 232-897 ms.
STALL_MS = 2000.0
PROBES = ("/healthz", "GET /v1/studies (team beta)")


def _probes(port: int) -> list[Callable[[], Awaitable[Any]]]:
    return [
        lambda: request(port, "GET", "/healthz"),
        lambda: request(port, "GET", "/v1/studies", TEAMS["beta"]),
    ]


async def attack_measured(
    port: int, hold_s: float
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[Any]]:
    """The probes' latencies for 2 s with nothing else sent, then while 200 connections of
    team alpha (opened over 2 s) send a byte a second after headers promising 100,000 bytes,
    each for ``hold_s``; and what those connections got (:func:`slow_body`)."""
    baseline = await probe_while(asyncio.sleep(2.0), port, _probes(port))
    results: list[Any] = []

    async def attack() -> None:
        bodies = (
            slow_body(port, TEAMS["alpha"], hold_s=hold_s, after_s=i * RAMP_S) for i in range(200)
        )
        results.extend(await asyncio.gather(*bodies))

    seen = await probe_while(attack(), port, _probes(port))
    return baseline, seen, results


def check_latencies(
    baseline: dict[str, list[float]],
    seen: dict[str, list[float]],
    where: str,
    during: str = "200 slow bodies",
    names: tuple[str, ...] = PROBES,
) -> None:
    """Print the probes' latencies (``names``: theirs), and assert that their p95 stayed under
    the bound (:data:`LATENCY_MS`) and none stalled (:data:`STALL_MS`) while the slow bodies
    hung (or what ``during`` names went on)."""
    noise = max(max(ms) for ms in baseline.values())
    bound = min(max(LATENCY_MS, 2 * noise), 1000.0)
    for name, alone, ms in zip(names, baseline.values(), seen.values(), strict=True):
        print(
            f"\n{where}, {name} during {during}: {len(ms)} probes, median "
            f"{statistics.median(ms):.1f} ms, p95 {_p95(ms):.1f} ms, max {max(ms):.1f} ms "
            f"(alone: median {statistics.median(alone):.1f}, max {max(alone):.1f} ms)"
        )
    print(f"bound: {bound:.0f} ms")
    for name, ms in zip(names, seen.values(), strict=True):
        assert _p95(ms) < bound, (name, sorted(ms)[-10:])
        assert max(ms) < STALL_MS, (name, sorted(ms)[-10:])


def test_200_slow_bodies_leave_healthz_and_reads_answering(tmp_path: Path) -> None:
    """The issue's attack, 200 connections of one team opened over 2 s (a byte a second after
    headers that promise 100,000): at most ``bodies_per_team`` of them are admitted, the rest
    are 429 at once, and /healthz and another team's list answer within 100 ms (p95,
    :data:`LATENCY_MS`) and none stalls (:data:`STALL_MS`) throughout."""
    # the default bounds: 30 s, 16 KiB/s, 4 a team, 32 in all
    with served(tmp_path) as port:
        baseline, seen, results = asyncio.run(attack_measured(port, hold_s=4.0))
    statuses = [status for status, _, _ in results]
    print(f"\nslow bodies: {statuses.count(429)} x 429, {statuses.count(None)} still sending")
    check_latencies(baseline, seen, "uvicorn")
    assert statuses.count(None) == 4  # bodies_per_team, still within their deadline
    assert statuses.count(429) == 196
    assert all(t < 2.0 for status, t, _ in results if status == 429)


def test_a_slow_body_is_408_and_one_that_keeps_the_rate_is_accepted(tmp_path: Path) -> None:
    """1 s plus a second per 1,000 bytes: a byte every 0.3 s is 408 after about a second
    (its slot then free again); 6,000 bytes at 5,000 bytes a second take longer than 1 s but
    keep the rate, and the job is queued."""
    job = json.dumps({"job": job_doc("steady")}).encode()
    steady = job + b" " * (6000 - len(job))
    bounds = {"body_timeout_s": 1.0, "body_min_rate": 1000, "bodies_per_team": 1}
    with served(tmp_path, **bounds) as port:

        async def main() -> list[tuple[int | None, float, bytes]]:
            late = await slow_body(port, TEAMS["alpha"], every_s=0.3, hold_s=10)
            kept = await slow_body(port, TEAMS["alpha"], body=steady, chunk=500, every_s=0.1)
            return [late, kept]

        (late, late_s, late_text), (kept, kept_s, kept_text) = asyncio.run(main())
    print(f"\n408 after {late_s:.2f} s: {late_text.decode()}")
    assert late == 408, late_text
    assert 0.9 < late_s < 3.0
    assert "did not arrive in time" in json.loads(late_text)["detail"]
    assert kept == 201, kept_text
    assert kept_s > 1.0


def test_bodies_over_a_teams_or_the_services_bound_are_429(tmp_path: Path) -> None:
    """Two bodies a team, three in all: a team's third is 429 while another team still gets
    one, the fourth of all is 429, a request without a valid token is 401 (never counted);
    once bodies are in (or timed out), the slots are free again."""
    bounds = {"body_timeout_s": 2.0, "bodies_per_team": 2, "bodies_in_flight": 3}
    with served(tmp_path, **bounds) as port:

        async def main() -> dict[str, Any]:
            hang = [
                asyncio.ensure_future(slow_body(port, TEAMS[t], every_s=0.5, hold_s=10))
                for t in ("alpha", "alpha", "beta")
            ]
            await asyncio.sleep(0.5)
            out: dict[str, Any] = {
                "alpha third": await slow_body(port, TEAMS["alpha"], hold_s=3),
                "beta second": await slow_body(port, TEAMS["beta"], hold_s=3),
                "no token": await slow_body(port, None, hold_s=3),
                "wrong token": await slow_body(port, "nope", hold_s=3),
            }
            out["hung"] = await asyncio.gather(*hang)
            out["after"] = await request(port, "POST", "/v1/studies", TEAMS["alpha"], b"{}")
            return out

        out = asyncio.run(main())
    for key in ("alpha third", "beta second"):
        status, took, text = out[key]
        assert status == 429 and took < 1.0, (key, out[key])
        print(f"\n{key}: 429 {json.loads(text)['detail']}")
    assert out["no token"][0] == 401 and out["wrong token"][0] == 401
    assert [status for status, _, _ in out["hung"]] == [408, 408, 408]
    assert out["after"][0] == 422  # admitted again: an empty job, refused as such


def test_the_body_bounds_are_settings_with_checked_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_AUTOTUNE_TOKENS", "t")
    s = settings_from_args({})
    assert (s.body_timeout_s, s.body_min_rate, s.bodies_per_team, s.bodies_in_flight) == (
        30.0,
        16384,
        4,
        32,
    )
    s = settings_from_args({"body_timeout_s": 5, "body_min_rate": 0, "bodies_per_team": 1})
    assert (s.body_timeout_s, s.body_min_rate, s.bodies_per_team) == (5.0, 0, 1)
    for bad in (
        {"body_timeout_s": -1},
        {"body_min_rate": -5},
        {"bodies_per_team": 40},
        {"bodies_in_flight": REPLICA_SLOTS},
    ):
        with pytest.raises(ConfigError, match=r"body|bodies"):
            settings_from_args(bad)
