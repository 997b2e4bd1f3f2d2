"""Heavy submissions against the real Serve deployment on loopback (issue 42, case 5).

``vllm-autotune serve``'s application (``run_service``: a local Ray, Serve's proxy, the API
replica and its check processes, the real plan check) with two teams' tokens. Clients of both
teams submit, one after another, what made ``/healthz`` slow in the issue's loopback run: a
JSON job whose search space is an inline categorical of 10,000 choices, then an upload of a
trace at the row limit (200,000 rows, 7.6 MB, multipart as ``vllm-autotune submit
--upload-trace`` sends it). Every submission starts a day ahead, so each is checked in full and
stored and no study starts (no vLLM needed). ``/healthz`` is asked every 50 ms, for 2 s before
(the machine's own noise) and while the clients submit (``check_latencies``: p95 within 100 ms,
or twice that noise where it is larger). Before the checks moved out of the replica,
``/healthz``'s p95 was 232 ms under the spaces and 897 ms under the uploads
(``benchmarks/service_load.py``), its slowest 450 and 790 ms in this test. ``-s`` prints the
latencies.

A team's list of studies is not probed here: it reads every stored job of the team, and each
of these carries its 10,000 choices, so the list slows as the test stores them, whatever the
checks cost.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from optimizer.service.auth import TokenEntry, hash_token
from optimizer.service.settings import ServiceSettings
from tests.unit.test_api_check_workers import TEAMS, big_space_body, post, upload_body
from tests.unit.test_api_slow_bodies import check_latencies, probe_while, request
from tests.unit.test_jobs import TRACES

pytestmark = pytest.mark.integration

LOAD_S = 12.0
HEALTHZ = ("/healthz",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def service_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    pytest.importorskip("ray")
    from optimizer.service.api import run_service

    tmp = tmp_path_factory.mktemp("check-load")
    settings = ServiceSettings(
        database_url=f"sqlite:///{tmp / 'service.db'}",
        data_dir=str(tmp / "data"),
        trace_roots=(str(TRACES),),
        tokens=tuple(TokenEntry(hash_token(t), team) for team, t in TEAMS.items()),
        allow_hub_models=True,
        max_concurrent=1,
        poll_interval_s=1.0,
        mlflow=False,
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


async def _submitter(
    port: int, team: str, body: bytes, ctype: str, until: float, seen: Counter[int]
) -> None:
    """The same submission, one after another, until ``until`` (a 429 waits its Retry-After)."""
    while time.monotonic() < until:
        status, headers, _ = await post(port, "POST", "/v1/studies", TEAMS[team], body, ctype)
        seen[status] += 1
        if status == 429:
            await asyncio.sleep(float(headers.get("retry-after", "1")))


def _load(port: int, clients: int, body: bytes, ctype: str) -> tuple[Any, Any, Counter[int]]:
    """/healthz alone for 2 s, then while ``clients`` (half of them each team's) submit
    ``body`` for :data:`LOAD_S`; and the submissions' statuses."""
    probes = [lambda: request(port, "GET", "/healthz")]
    seen: Counter[int] = Counter()

    async def main() -> tuple[Any, Any]:
        baseline = await probe_while(asyncio.sleep(2.0), port, probes)
        until = time.monotonic() + LOAD_S
        load = asyncio.gather(
            *(
                _submitter(port, ("alpha", "beta")[i % 2], body, ctype, until, seen)
                for i in range(clients)
            )
        )
        return baseline, await probe_while(load, port, probes)

    baseline, during = asyncio.run(main())
    return baseline, during, seen


def test_healthz_answers_while_large_search_spaces_are_checked(service_port: int) -> None:
    baseline, during, seen = _load(service_port, 4, big_space_body("space"), "application/json")
    print(f"\nsubmissions of 10,000-choice spaces: {dict(seen)}")
    check_latencies(baseline, during, "Serve", "4 clients' 10,000-choice spaces", HEALTHZ)
    assert seen[201] >= 4, seen


def test_healthz_answers_while_traces_at_the_row_limit_are_uploaded(service_port: int) -> None:
    body, ctype = upload_body("upload", 200_000)
    baseline, during, seen = _load(service_port, 4, body, ctype)
    print(f"\nuploads of 200,000 rows: {dict(seen)}")
    check_latencies(baseline, during, "Serve", "4 clients' 200,000-row uploads", HEALTHZ)
    assert seen[201] >= 2, seen
