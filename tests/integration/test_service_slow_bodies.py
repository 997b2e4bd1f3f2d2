"""Slow request bodies against the real Serve deployment on loopback (issue 42, item 1).

``vllm-autotune serve``'s application (``run_service``: a local Ray, Serve's proxy, the API
replica with its 64 request slots and its scheduler) with two teams' tokens; no study runs,
so no vLLM is needed. 200 connections of one team, opened over 2 s, send headers promising a
100,000-byte body and then a byte a second, as the attack did (a byte every 3 s there);
/healthz and the other team's list are asked every 50 ms, for 2 s before (the machine's own
noise) and while they hang (``check_latencies``: p95 within 100 ms, none stalled). Before the body bounds the
slow bodies took every replica slot and /healthz waited as long as they hung (30-42 s in the
issue's run). ``-s`` prints the latencies.

Item 6: Serve's proxy (every request passes through it) and the API replica run no lower in
CPU priority than the trials (``TRIAL_NICENESS``) where the service may raise a priority (root
or CAP_SYS_NICE); their niceness is read with psutil, thread by thread. Before, the proxy ran
at Ray's worker niceness, 15.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from optimizer.service.auth import TokenEntry, hash_token
from optimizer.service.settings import ServiceSettings
from tests.unit.test_api_slow_bodies import TEAMS, attack_measured, check_latencies

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
    baseline, seen, results = asyncio.run(attack_measured(service_port, hold_s=HOLD_S))
    statuses = [status for status, _, _ in results]
    counts = {s: statuses.count(s) for s in set(statuses)}
    print(f"\nslow bodies' answers: {counts}")
    check_latencies(baseline, seen, "Serve")
    # 4 admitted (bodies_per_team), timed out after 5 s; the other 196 refused at once.
    assert counts == {429: 196, 408: 4}, counts
    assert all(t < 2.0 for status, t, _ in results if status == 429)


def _may_raise_priority() -> bool:
    """Root, or CAP_SYS_NICE (bit 23 of the effective capabilities)."""
    if os.geteuid() == 0:
        return True
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 23 & 1)
    return False


def _threads_niceness(pid: int) -> dict[int, int]:
    """The niceness of each thread of ``pid`` (Linux keeps one per thread)."""
    seen = {}
    for thread in psutil.Process(pid).threads():
        try:
            seen[thread.id] = psutil.Process(thread.id).nice()
        except psutil.NoSuchProcess:  # ended meanwhile
            continue
    return seen


def test_the_api_path_is_not_below_the_trials_priority(service_port: int) -> None:
    """Issue 42, item 6: Serve's proxy started at Ray's worker niceness (15) while the trials
    run at TRIAL_NICENESS (0), so the API slowed while validations ran; each thread of the
    proxy and of the API replica is now at most at the trials' niceness."""
    if not _may_raise_priority():
        pytest.skip(
            "raising a process's priority needs root or CAP_SYS_NICE; without either the "
            "proxy stays at Ray's worker niceness and the service logs a warning"
        )
    from optimizer.runners import TRIAL_NICENESS, serve_api_priority
    from optimizer.service.api import APP_NAME

    actors = serve_api_priority(APP_NAME)  # read only: names and pids
    kinds = {"proxy": "SERVE_PROXY_ACTOR", "replica": f"SERVE_REPLICA::{APP_NAME}#"}
    for kind, prefix in kinds.items():
        assert any(name.startswith(prefix) for name in actors), (kind, sorted(actors))
    for name, seen in actors.items():
        niceness = _threads_niceness(seen["pid"])
        print(f"\n{name} (pid {seen['pid']}): threads' niceness {sorted(set(niceness.values()))}")
        assert niceness and max(niceness.values()) <= TRIAL_NICENESS, (name, niceness)
