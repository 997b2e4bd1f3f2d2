"""Slow request bodies against the real Serve deployment on loopback (issue 42, item 1).

``vllm-autotune serve``'s application (``run_service``: a local Ray, Serve's proxy, the API
replica with its 64 request slots and its scheduler) with two teams' tokens; no study runs,
so no vLLM is needed. 200 connections of one team, opened over 2 s, send headers promising a
100,000-byte body and then a byte a second, as the attack did (a byte every 3 s there);
meanwhile /healthz and the other team's list are asked every 50 ms. Before the body bounds the slow bodies took
every replica slot and /healthz waited as long as they hung (30-42 s in the issue's run).
``-s`` prints the latencies.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
from collections.abc import Iterator
from typing import Any

import pytest

from optimizer.service.auth import TokenEntry, hash_token
from optimizer.service.settings import ServiceSettings
from tests.unit.test_api_slow_bodies import (
    RAMP_S,
    TEAMS,
    _p95,
    probe_while,
    request,
    slow_body,
)

pytestmark = pytest.mark.integration

HOLD_S = 8.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def service_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    pytest.importorskip("ray")
    from optimizer.service.api import run_service

    tmp = tmp_path_factory.mktemp("slow-bodies")
    settings = ServiceSettings(
        database_url=f"sqlite:///{tmp / 'service.db'}",
        data_dir=str(tmp / "data"),
        tokens=tuple(TokenEntry(hash_token(t), team) for team, t in TEAMS.items()),
        max_concurrent=1,
        poll_interval_s=1.0,
        mlflow=False,
        body_timeout_s=5.0,
    )
    port = _free_port()
    run_service(settings, host="127.0.0.1", port=port)
    try:
        yield port
    finally:
        import ray

        from optimizer.runners import serve_shutdown

        serve_shutdown()
        ray.shutdown()


def test_200_slow_bodies_leave_the_served_api_answering(service_port: int) -> None:
    port = service_port

    async def main() -> tuple[dict[str, list[float]], list[Any]]:
        results: list[Any] = []

        async def attack() -> None:
            results.extend(
                await asyncio.gather(
                    *(
                        slow_body(port, TEAMS["alpha"], hold_s=HOLD_S, after_s=i * RAMP_S)
                        for i in range(200)
                    )
                )
            )

        seen = await probe_while(
            attack(),
            port,
            [
                lambda: request(port, "GET", "/healthz"),
                lambda: request(port, "GET", "/v1/studies", TEAMS["beta"]),
            ],
        )
        return seen, results

    seen, results = asyncio.run(main())
    statuses = [status for status, _, _ in results]
    for name, ms in zip(("/healthz", "GET /v1/studies (team beta)"), seen.values(), strict=True):
        print(
            f"\nServe, {name} during 200 slow bodies: {len(ms)} probes, median "
            f"{statistics.median(ms):.1f} ms, p95 {_p95(ms):.1f} ms, max {max(ms):.1f} ms"
        )
    counts = {s: statuses.count(s) for s in set(statuses)}
    print(f"slow bodies' answers: {counts}")
    for ms in seen.values():
        assert max(ms) < 100, ms
    # 4 admitted (bodies_per_team), timed out after 5 s; the other 196 refused at once.
    assert counts == {429: 196, 408: 4}, counts
    assert all(t < 2.0 for status, t, _ in results if status == 429)


def test_healthz_answers_without_slow_bodies(service_port: int) -> None:
    """The same probes with nothing else going on: the baseline of the numbers above."""

    async def main() -> list[float]:
        seen = await probe_while(
            asyncio.sleep(3.0), service_port, [lambda: request(service_port, "GET", "/healthz")]
        )
        return seen["0"]

    ms = asyncio.run(main())
    print(
        f"\nServe, /healthz alone: {len(ms)} probes, median {statistics.median(ms):.1f} ms, "
        f"p95 {_p95(ms):.1f} ms, max {max(ms):.1f} ms"
    )
    assert max(ms) < 100, ms
