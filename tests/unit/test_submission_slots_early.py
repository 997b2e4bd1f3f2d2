"""A submission's check slot is taken before its body is read, and ``/healthz`` answers while
a check runs (issue 42, case 5).

The real app (a real JobService, a FAKE driver launcher and a FAKE slow, CPU-bound plan check)
runs under uvicorn on loopback in a process of its own; clients are raw sockets, so a request
can send its headers and no body at all.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import socket
import time
from pathlib import Path
from typing import Any

import uvicorn

from optimizer.config import JobConfig
from optimizer.service.api import create_app
from optimizer.service.auth import TokenEntry, hash_token
from optimizer.service.facade import JobService
from optimizer.service.scheduler import Scheduler
from optimizer.service.settings import ServiceSettings
from optimizer.service.store import JobStore
from tests.unit.test_api_slow_bodies import request
from tests.unit.test_jobs import TRACES, FakeLauncher, job_doc

TEAMS = {"alpha": "alpha-token", "beta": "beta-token"}
CHECK_S = 2.0


class FakeCpuBoundPlanCheck:
    """A FAKE plan check: spins the CPU (holding the GIL as Python code does) for ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, _job: JobConfig, _base: Path) -> None:
        end = time.monotonic() + self.seconds
        n = 0
        while time.monotonic() < end:
            n += sum(range(200))


def _serve(tmp: str, port: Any) -> None:
    settings = ServiceSettings(
        database_url=f"sqlite:///{Path(tmp) / 'service.db'}",
        data_dir=str(Path(tmp) / "data"),
        trace_roots=(str(TRACES),),
        tokens=tuple(TokenEntry(hash_token(t), team) for team, t in TEAMS.items()),
        allow_hub_models=True,
        max_plan_checks=2,
        max_plan_checks_per_team=1,
    )
    store = JobStore(settings.database_url)
    svc = JobService(
        settings,
        store,
        Scheduler(store, FakeLauncher()),
        check_plan=FakeCpuBoundPlanCheck(CHECK_S),
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port.send(sock.getsockname()[1])
    config = uvicorn.Config(create_app(svc), log_level="warning", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


async def _headers_only(port: int, token: str, length: int) -> tuple[int, dict[str, str]]:
    """A submission that sends its headers and none of its body: the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            "POST /v1/studies HTTP/1.1\r\nHost: loopback\r\nConnection: close\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n"
        )
        writer.write(head.encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers
    finally:
        writer.close()


async def _scenario(port: int) -> dict[str, Any]:
    body = json.dumps(job_doc("alpha-slow")).encode()
    first = asyncio.create_task(request(port, "POST", "/v1/studies", TEAMS["alpha"], body))
    await asyncio.sleep(0.5)  # the first one is in its (fake, slow) check now
    early = await _headers_only(port, TEAMS["alpha"], 100_000)
    waits = []
    while not first.done():
        t0 = time.perf_counter()
        status, _ = await request(port, "GET", "/healthz")
        assert status == 200
        waits.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
    again = await request(port, "POST", "/v1/studies", TEAMS["alpha"], body)
    return {"first": (await first)[0], "early": early, "waits": waits, "again": again[0]}


def test_an_over_bound_submission_is_429_before_its_body_and_healthz_answers(
    tmp_path: Path,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(str(tmp_path), theirs), daemon=True)
    proc.start()
    try:
        assert mine.poll(60)
        port = int(mine.recv())
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        out = asyncio.run(_scenario(port))
    finally:
        proc.kill()
        proc.join(10)
    status, headers = out["early"]
    # answered without a byte of its body sent: the slot was taken before the body is read
    assert status == 429 and headers.get("retry-after") == "5"
    assert out["first"] == 201 and out["again"] == 201  # the slot was freed after each
    assert out["waits"] and max(out["waits"]) < 1.0, out["waits"]
    print(f"healthz during a fake CPU-bound check: max {max(out['waits']) * 1000:.0f} ms")


