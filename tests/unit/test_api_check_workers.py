"""Issue 42, case 5: checking a submission costs the API's replica nothing but moving bytes.

The app runs as the Serve replica builds it (``_Ingress``: a real JobService, the real plan
check; only its driver launcher is the FAKE one of ``test_jobs``) under uvicorn in a process of
its own, and is sent what made ``/healthz`` slow in the issue's loopback run (an inline
categorical of 10,000 choices, an uploaded trace of 20,000 rows). Timing ``/healthz`` on a
2-core machine that other work shares would be a flaky test, so the tests check the mechanism
instead, by measures that do not depend on the machine's load:

- where the CPU goes: the replica's own process spends a small part of what its check
  processes spend (before: all of it in the replica's threads, beside its event loop), and the
  check processes run at the lowest priority;
- a submission is answered 429 before any of its body is read while its team's check slots
  (or all teams') are full (before: a 7.6 MB upload was read in full, then refused);
- a check process answers as the replica would (the same statuses and messages, checked side
  by side with a service that checks in its own thread), and one that dies is replaced.

``-s`` prints the measured CPU times.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import uvicorn
import yaml
from fastapi.testclient import TestClient

from optimizer.config import JobConfig
from optimizer.service.auth import TokenEntry, hash_token
from optimizer.service.facade import JobService
from optimizer.service.scheduler import Scheduler
from optimizer.service.settings import ServiceSettings
from optimizer.service.store import JobStore
from tests.unit.test_api_slow_bodies import ReplicaSlots
from tests.unit.test_jobs import TRACE, TRACES, FakeLauncher, job_doc

TEAMS = {"alpha": "alpha-token", "beta": "beta-token"}
CHOICES = 10_000


def _settings(tmp: Path, **over: Any) -> ServiceSettings:
    fields: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp / 'service.db'}",
        "data_dir": str(tmp / "data"),
        "trace_roots": (str(TRACES),),
        "tokens": tuple(TokenEntry(hash_token(t), team) for team, t in TEAMS.items()),
        "allow_hub_models": True,
        "max_concurrent": 1,
        "mlflow": False,
        **over,
    }
    return ServiceSettings(**fields)


# --- the app in a process of its own ------------------------------------------------------------


def _replica_app(tmp: Path, _arg: Any) -> Any:
    """The app as the Serve replica builds it (``_Ingress``), its driver launcher FAKE."""
    from optimizer.service import api

    api.RayDriverLauncher = lambda **_kw: FakeLauncher()  # type: ignore[assignment,misc]
    ingress = api._Ingress(_settings(tmp, max_upload_bytes=8 * 1024**2))
    _KEPT.append(ingress)  # as Serve keeps its replica: its end stops the scheduler
    return ReplicaSlots(ingress.__serve_build_asgi_app__())


_KEPT: list[Any] = []


def _held_app(tmp: Path, gate: str) -> Any:
    """Two teams on a service that checks at most 2 submissions of a team and 3 in all, each
    check held until ``gate``/release exists (:func:`held_check`)."""
    settings = _settings(tmp, max_plan_checks=3, max_plan_checks_per_team=2)
    store = JobStore(settings.database_url)
    check = functools.partial(held_check, gate)
    service = JobService(settings, store, Scheduler(store, FakeLauncher()), check_plan=check)
    from optimizer.service.api import create_app

    return ReplicaSlots(create_app(service))


def held_check(gate: str, _job: JobConfig, _base: Path) -> None:
    """A FAKE plan check: says it is in (a file in ``gate``), then waits for ``gate``/release."""
    (Path(gate) / f"in-{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + 60
    while not (Path(gate) / "release").exists():
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.02)


def _serve(factory: Callable[[Path, Any], Any], tmp: str, arg: Any, port: Any) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port.send(sock.getsockname()[1])
    config = uvicorn.Config(
        factory(Path(tmp), arg), log_level="warning", lifespan="off", access_log=False
    )
    uvicorn.Server(config).run(sockets=[sock])


@contextmanager
def served(
    factory: Callable[[Path, Any], Any], tmp: Path, arg: Any = None
) -> Iterator[tuple[int, int]]:
    """``factory``'s app under uvicorn in a process of its own: (its port, its pid)."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    # not a daemon: the replica starts processes of its own
    proc = ctx.Process(target=_serve, args=(factory, str(tmp), arg, theirs))
    proc.start()
    try:
        assert mine.poll(60), "the server process did not start"
        port = int(mine.recv())
        deadline = time.monotonic() + 120
        while True:
            try:
                if asyncio.run(post(port, "GET", "/healthz", None, b"", ""))[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "uvicorn did not answer"
            time.sleep(0.2)
        assert proc.pid is not None
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed before an answer")
    headers: dict[str, str] = {}
    while (raw := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = raw.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(line.split()[1]), headers, await reader.readexactly(int(headers["content-length"]))


def _head(method: str, path: str, token: str | None, ctype: str, length: int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: loopback", "Connection: close"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if length:
        lines += [f"Content-Type: {ctype}", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def post(
    port: int,
    method: str,
    path: str,
    token: str | None,
    body: bytes,
    ctype: str = "application/json",
    timeout_s: float = 120.0,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a connection of its own: (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_head(method, path, token, ctype, len(body)) + body)
        await writer.drain()
        return await asyncio.wait_for(_answer(reader), timeout_s)
    finally:
        writer.close()


async def headers_only(
    port: int, token: str, ctype: str, length: int, wait_s: float
) -> tuple[int | None, float, dict[str, str], bytes]:
    """Headers promising ``length`` bytes and not one byte of body: (the status, None when
    none came within ``wait_s``; seconds to it; headers; body)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_head("POST", "/v1/studies", token, ctype, length))
        await writer.drain()
        try:
            status, headers, text = await asyncio.wait_for(_answer(reader), wait_s)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            return None, time.monotonic() - t0, {}, b""
        return status, time.monotonic() - t0, headers, text
    finally:
        writer.close()


# --- the bodies ---------------------------------------------------------------------------------


def _later() -> str:
    return (datetime.now() + timedelta(days=1)).isoformat(timespec="seconds")


def big_space_body(name: str) -> bytes:
    """A JSON submission whose space is an inline categorical of 10,000 choices (59 KB)."""
    space = {"name": "big", "params": {"max-num-seqs": {"type": "categorical"}}}
    space["params"]["max-num-seqs"]["choices"] = list(range(1, CHOICES + 1))
    doc = {"job": job_doc(name, search_space=space), "not_before": _later()}
    return json.dumps(doc).encode()


def trace_csv(rows: int) -> bytes:
    """An Azure-format trace of ``rows`` requests, 20 a second (the example's token counts)."""
    lines = TRACE.read_text().splitlines()
    header, sizes = lines[0], [ln.split(",", 1)[1] for ln in lines[1:]]
    start = datetime(2023, 11, 16, 18, 0, 0)
    out = [header]
    for i in range(rows):
        out.append(f"{start + timedelta(seconds=i / 20):%Y-%m-%d %H:%M:%S.%f}0,{sizes[i % 600]}")
    return ("\n".join(out) + "\n").encode()


def multipart(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """A multipart body of (name, file name or None for a field, bytes) parts; its type."""
    b = uuid.uuid4().hex
    body = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{b}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return body + f"--{b}--\r\n".encode(), f"multipart/form-data; boundary={b}"


def upload_body(name: str, rows: int) -> tuple[bytes, str]:
    """``vllm-autotune submit --upload-trace``'s body: a time window, the job, the trace."""
    job = json.dumps(job_doc(name, trace={"path": "t.csv"})).encode()
    parts = [("not_before", None, _later().encode()), ("job", "job.json", job)]
    return multipart([*parts, ("trace", "t.csv", trace_csv(rows))])


# --- where the CPU goes -------------------------------------------------------------------------


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _is_worker(proc: psutil.Process) -> bool:
    """A process started by multiprocessing's spawn (not its resource tracker)."""
    return proc.cmdline()[-1:] == ["--multiprocessing-fork"]


def _started_workers(replica: psutil.Process, wait_s: float = 60.0) -> list[psutil.Process]:
    """The replica's child processes once its check processes (if it has any) have started
    and gone idle: their start is not what is measured."""
    deadline = time.monotonic() + wait_s
    seen: dict[int, float] = {}
    while time.monotonic() < deadline:
        children = replica.children(recursive=True)
        now = {c.pid: _cpu_s(c) for c in children}
        if any(_is_worker(c) for c in children) and now == seen:
            return children
        seen = now
        time.sleep(1.0)
    return replica.children(recursive=True)


def test_the_replica_only_moves_the_bytes_of_heavy_submissions(tmp_path: Path) -> None:
    """Four 10,000-choice spaces and two 20,000-row uploads, two at a time, all accepted: the
    replica's process spends less than a fifth of the CPU its check processes spend, and these
    run at the lowest priority (niceness 19). Before, every check ran in the replica's threads:
    it spent all of it, with no check process at all."""
    bodies = [(big_space_body(f"space-{i}"), "application/json") for i in range(4)]
    bodies += [upload_body(f"upload-{i}", 20_000) for i in range(2)]
    with served(_replica_app, tmp_path) as (port, pid):
        replica = psutil.Process(pid)
        workers = _started_workers(replica)
        before = _cpu_s(replica), sum(_cpu_s(w) for w in workers)

        async def main() -> list[int]:
            answers = []
            for i in range(0, len(bodies), 2):
                pair = [
                    post(port, "POST", "/v1/studies", TEAMS["alpha"], body, ctype)
                    for body, ctype in bodies[i : i + 2]
                ]
                answers += await asyncio.gather(*pair)
            return [status for status, _, _ in answers]

        statuses = asyncio.run(main())
        workers = replica.children(recursive=True)
        own = _cpu_s(replica) - before[0]
        checks = sum(_cpu_s(w) for w in workers) - before[1]
        niceness = {w.pid: w.nice() for w in workers if _is_worker(w)}
    print(
        f"\nreplica {own:.2f} s of CPU, its {len(niceness)} check processes {checks:.2f} s "
        f"(niceness {sorted(set(niceness.values()))})"
    )
    assert statuses == [201] * len(bodies)
    assert own < 0.2 * checks, (own, checks)
    assert set(niceness.values()) == {19}, niceness


# --- refused before the body --------------------------------------------------------------------

#: An upload at the row limit, as the issue's run sent them (7.6 MB).
UPLOAD_BYTES = 7_600_000


def test_a_submission_is_refused_before_its_body_is_read_while_the_checks_are_full(
    tmp_path: Path,
) -> None:
    """Two checks of team alpha held: alpha's next upload is 429 (the check slots' words, a
    Retry-After, the connection closed) on its headers alone, not one byte of its 7.6 MB body
    sent; beta still gets the third slot in all, then its next is 429 the same way. Once the
    checks end, the three are queued and the slots are free again. Before, the 429 came only
    after the whole body was read: with no body sent, no answer came."""
    gate = tmp_path / "gate"
    gate.mkdir()
    ctype = "multipart/form-data; boundary=x"

    def entered() -> int:
        return len(list(gate.glob("in-*")))

    async def wait_entered(n: int) -> None:
        deadline = time.monotonic() + 60
        while entered() < n:
            assert time.monotonic() < deadline, entered()
            await asyncio.sleep(0.05)

    with served(_held_app, tmp_path / "svc", str(gate)) as (port, _pid):

        async def main() -> dict[str, Any]:
            def submit(team: str, name: str) -> asyncio.Future[Any]:
                body = json.dumps({"job": job_doc(name)}).encode()
                return asyncio.ensure_future(post(port, "POST", "/v1/studies", TEAMS[team], body))

            out: dict[str, Any] = {}
            held = [submit("alpha", "a1"), submit("alpha", "a2")]
            await wait_entered(2)
            out["alpha"] = await headers_only(port, TEAMS["alpha"], ctype, UPLOAD_BYTES, 3.0)
            held.append(submit("beta", "b1"))
            await wait_entered(3)
            out["beta"] = await headers_only(port, TEAMS["beta"], ctype, UPLOAD_BYTES, 3.0)
            (gate / "release").touch()
            out["held"] = [status for status, _, _ in await asyncio.gather(*held)]
            out["after"] = await post(
                port, "POST", "/v1/studies", TEAMS["alpha"], json.dumps(job_doc("a3")).encode()
            )
            return out

        out = asyncio.run(main())
    for team, words in (("alpha", "team alpha already has 2"), ("beta", "3 in all")):
        status, took, headers, text = out[team]
        print(f"\n{team}: {status} after {took:.2f} s: {text.decode()}")
        assert status == 429 and took < 2.0, (team, status, took)
        assert words in json.loads(text)["detail"]
        assert int(headers["retry-after"]) >= 1 and headers["connection"] == "close"
    assert out["held"] == [201, 201, 201]
    assert out["after"][0] == 201


# --- a check process answers as the replica would ----------------------------------------------


def _service(tmp: Path, processes: int) -> JobService:
    settings = _settings(tmp, max_upload_bytes=64 * 1024, max_trace_rows=600)
    store = JobStore(settings.database_url)
    return JobService(settings, store, Scheduler(store, FakeLauncher()), check_processes=processes)


@pytest.fixture
def two_services(tmp_path: Path) -> Iterator[tuple[TestClient, TestClient, JobService]]:
    """The real app over a service that checks in its own thread and one with 2 check
    processes (the real plan check in both); the latter's service."""
    inline, processes = _service(tmp_path / "inline", 0), _service(tmp_path / "processes", 2)
    try:
        yield (
            TestClient(create_app_for(inline), raise_server_exceptions=False),
            TestClient(create_app_for(processes), raise_server_exceptions=False),
            processes,
        )
    finally:
        processes.close()


def create_app_for(service: JobService) -> Any:
    from optimizer.service.api import create_app

    return create_app(service)


def _requests() -> dict[str, dict[str, Any]]:
    """A request of each kind the checks answer: (content, content type), by what it is."""
    auth = {"Authorization": f"Bearer {TEAMS['alpha']}"}

    def as_json(doc: Any) -> dict[str, Any]:
        return {"content": json.dumps(doc), "headers": {**auth, "Content-Type": "application/json"}}

    def as_form(parts: list[tuple[str, str | None, bytes]]) -> dict[str, Any]:
        body, ctype = multipart(parts)
        return {"content": body, "headers": {**auth, "Content-Type": ctype}}

    job = json.dumps(job_doc("form", trace={"path": "t.csv"})).encode()
    twice = {"name": "s", "params": {"x": {"type": "categorical", "choices": [1, 2, 1.0]}}}
    return {
        "json": as_json(job_doc("ok")),
        "yaml": {
            "content": yaml.safe_dump({"job": job_doc("y"), "until": "2031-01-01T00:00:00"}),
            "headers": {**auth, "Content-Type": "application/yaml"},
        },
        "upload": as_form([("job", "job.json", job), ("trace", "t.csv", trace_csv(100))]),
        "unknown key": as_json(job_doc(sampler={"nmae": "tpe"})),
        "bad yaml": {"content": b"name: [", "headers": {**auth, "Content-Type": "text/yaml"}},
        "not a job": as_json([1, 2]),
        "outside the roots": as_json(job_doc(trace={"path": "/etc/passwd"})),
        "a choice twice": as_json(job_doc(search_space=twice)),
        "window closed": as_json({"job": job_doc(), "until": "2001-01-01T00:00:00"}),
        "bad base64": as_json({"job": job_doc(), "trace_upload": {"filename": "t.csv", "content_b64": "!"}}),
        "rows over the limit": as_form([("job", "job.json", job), ("trace", "t.csv", trace_csv(601))]),
        "three files": as_form([("job", "job.json", job)] + [("f", f"{i}.csv", b"x") for i in range(2)]),
        "upload over the limit": as_form([("job", "job.json", job), ("trace", "t.csv", b"1" * 70_000)]),
        "job as a field": as_form([("job", None, job)]),
        "no job part": as_form([("trace", "t.csv", trace_csv(10))]),
        "bad time": as_form([("job", "job.json", job), ("until", None, b"soon")]),
    }  # fmt: skip


def test_a_check_process_answers_as_the_replica_would(
    two_services: tuple[TestClient, TestClient, JobService],
) -> None:
    """Each kind of request, to a service that checks in its own thread and to one that checks
    in processes: the same status and the same words (the job ids and folders aside); what a
    refused upload left is removed either way."""
    inline, processes, service = two_services
    for what, request in _requests().items():
        a = inline.post("/v1/studies", **request)
        b = processes.post("/v1/studies", **request)
        assert a.status_code == b.status_code, (what, a.text[:300], b.text[:300])
        assert a.status_code < 500, (what, a.text[:300])
        if a.status_code == 201:
            assert a.json()["name"] == b.json()["name"] and len(b.json()["notes"]) == len(
                a.json()["notes"]
            )
        else:
            assert a.json() == b.json(), what
            assert a.headers.get("retry-after") == b.headers.get("retry-after"), what
    accepted = {r.id for r in service.store.records()}
    assert len(accepted) == 3
    assert {p.name for p in (service.data_dir / "uploads").iterdir()} <= accepted
    stored = Path(next(r for r in service.store.records() if r.name == "form").job["trace"]["path"])
    assert stored.read_bytes() == trace_csv(100)


def test_a_check_process_that_dies_is_replaced(
    two_services: tuple[TestClient, TestClient, JobService],
) -> None:
    """A check process killed (as the kernel kills one for its memory): the submission it would
    have checked is 503 with a Retry-After; new processes are started, and the next one is
    queued."""
    _inline, client, service = two_services
    auth = {"Authorization": f"Bearer {TEAMS['alpha']}"}
    assert client.post("/v1/studies", json=job_doc("first"), headers=auth).status_code == 201
    workers = [p for p in psutil.Process().children() if _is_worker(p)]
    for worker in workers:
        worker.kill()
    psutil.wait_procs(workers, timeout=10)
    time.sleep(0.5)  # the pool sees its worker gone
    r = client.post("/v1/studies", json=job_doc("lost"), headers=auth)
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text[:300]
    r = client.post("/v1/studies", json=job_doc("next"), headers=auth)
    assert r.status_code == 201, r.text[:300]
    assert [rec.name for rec in service.store.records()] == ["first", "next"]
