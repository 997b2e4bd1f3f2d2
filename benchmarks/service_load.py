"""/healthz of the real service on loopback while slow bodies hang and big submissions are
checked (issue 42, cases 1 and 5; its "done when": under 100 ms throughout).

Starts ``vllm-autotune serve``'s application (:func:`optimizer.service.api.run_service`: a
local Ray, Serve's proxy, the API replica and its scheduler) as
``tests/integration/test_service_slow_bodies.py`` does, with a real token file (teams alpha
and beta), a trace root and a model root in a temporary folder, and the service's default
bounds. Every submission carries a ``not_before`` a day ahead: it is checked in full (the real
plan check: the trace counted, read and shaped) and stored, but no study ever starts, so no
vLLM (nor its fake) is needed. Then, each phase for a fixed time while a process of its own
reads ``/healthz`` every 50 ms, each on a new connection (as a load balancer's probe; one that
fails or takes 5 s counts as 5 s), each followed by Serve's proxy's own ``/-/healthz`` (the
proxy answers it, no replica: what the machine and the proxy alone cost a probe):

``idle``
    nothing else sent: the machine's own noise.
``1``
    200 connections of team alpha, opened over 2 s, each sending headers with
    ``Content-Length: 100000`` and then one body byte every 3 s; a connection answered (429 at
    once, 408 at its body deadline) is opened again at its next 3 s tick. Open ones are closed
    when the phase ends.
``5a``
    4 clients (2 a team: the service's bound of 4 checks at once, all of them) each sending,
    one after another, a JSON submission whose search space is an inline categorical of
    10,000 choices (the most a list may hold, ``security.MAX_CONTAINER_ITEMS``; the body's
    20,000-value bound allows no larger one).
``5b``
    8 clients (4 a team) each uploading, one after another, a trace at the 200,000-row limit
    (7.6 MB of CSV) as ``vllm-autotune submit --upload-trace`` sends it: multipart, a ``job``
    part and a ``trace`` file part.

A client answered 429 waits its ``Retry-After``. After a submission phase its requests in
flight are let finish (at most ``--drain-s``), the probe still reading. The table: requests
sent, their answers counted by status, the median time to answer a submission, ``/healthz``'s
median, p95 and max (and failed probes), the probes over 100 ms, the proxy's own
``/-/healthz`` (median and max), and the RSS growth over the phase of the API replica
with its check processes (the last sample, and the peak) where they are readable here. The
header gives each process's niceness (the check processes': ``checks``): the benchmark and its
probe keep the one they are started with, unless
``--probe-nice`` sets the probe's (a probe at nice 19 waits for the CPU itself while the
service, raised to the trials' nice 0, is busy).

Started under ``nice -n 19``, Ray's own processes (GCS, raylet, agents, Serve's controller) run at
nice 19 beside the load's clients, while a served service runs them at its own priority:
``--load-nice 19`` instead lowers only the benchmark's thread that sends the load, once the
service is up (the clients stand in for machines elsewhere; the probe keeps ``--probe-nice``).

Usage::

    nice -n 19 python -m benchmarks.service_load [--seconds 45] [--idle-s 10] [--drain-s 60]
        [--phases idle,1,5a,5b] [--probe-nice N]
    python -m benchmarks.service_load --load-nice 19 --probe-nice 0

About 4 minutes after Ray's start with the defaults. Not a test: ``benchmarks/`` is outside
pytest's ``testpaths``, so CI never runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_TRACE = REPO / "examples" / "traces" / "azure2023_code_600.csv"
HOST = "127.0.0.1"
PROBE_EVERY_S = 0.05
PROBE_TIMEOUT_S = 5.0
SLOW_CONNECTIONS = 200
SLOW_RAMP_S = 2.0
SLOW_EVERY_S = 3.0
SLOW_LENGTH = 100_000
SUBMIT_TIMEOUT_S = 180.0
TRACE_ROWS = 200_000
TEAMS = ("alpha", "beta")


# --- HTTP on raw connections --------------------------------------------------------------------


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """Status and headers of one HTTP/1.1 response; its body read and dropped."""
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed before an answer")
    status = int(line.split()[1])
    headers: dict[str, str] = {}
    while (raw := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = raw.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers


def _head(path: str, token: str, content_type: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: loopback\r\nConnection: close\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _healthz_ms(port: int, path: str = "/healthz") -> float | None:
    """One GET ``path`` on a new connection: milliseconds to a 200, else None."""
    t0 = time.perf_counter()
    request = f"GET {path} HTTP/1.1\r\nHost: loopback\r\nConnection: close\r\n\r\n".encode()
    try:
        with socket.create_connection((HOST, port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.sendall(request)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return None
    ok = data.startswith(b"HTTP/1.1 200")
    return (time.perf_counter() - t0) * 1000 if ok else None


def _probe(port: int, stop: Any, out: Any, niceness: int | None) -> None:
    """The probe's process (at ``niceness`` where given and permitted): /healthz every
    :data:`PROBE_EVERY_S` until ``stop`` is set; sends back the latencies (ms; a failure as
    :data:`PROBE_TIMEOUT_S`) and the failures. Each /healthz is followed by Serve's proxy's own
    ``/-/healthz`` (answered by the proxy, no replica): the machine's and the proxy's share of a
    slow probe, apart from the app's."""
    if niceness is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
        except OSError as exc:
            print(f"probe: niceness {niceness} refused ({exc.strerror})", file=sys.stderr)
    seen: list[float] = []
    proxy: list[float] = []
    failed = 0
    out.send(os.getpriority(os.PRIO_PROCESS, 0))
    next_at = time.monotonic()
    while not stop.is_set():
        ms = _healthz_ms(port)
        failed += ms is None
        seen.append(PROBE_TIMEOUT_S * 1000 if ms is None else ms)
        alone = _healthz_ms(port, "/-/healthz")
        proxy.append(PROBE_TIMEOUT_S * 1000 if alone is None else alone)
        next_at += PROBE_EVERY_S
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.monotonic()
    out.send((seen, failed, proxy))


# --- the service --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _trace_csv(rows: int) -> bytes:
    """An Azure-format trace of ``rows`` requests (the example's token counts, repeated), 20
    a second."""
    lines = EXAMPLE_TRACE.read_text().splitlines()
    header, sizes = lines[0], [ln.split(",", 1)[1] for ln in lines[1:]]
    start = datetime(2023, 11, 16, 18, 0, 0)
    out = [header]
    for i in range(rows):
        at = start + timedelta(seconds=i / 20)
        out.append(f"{at:%Y-%m-%d %H:%M:%S.%f}0,{sizes[i % len(sizes)]}")
    return ("\n".join(out) + "\n").encode()


def _job(name: str, trace: str, choices: int = 0) -> dict[str, Any]:
    """A job on a hub model name (never read: no study starts) and ``trace``; its search
    space a categorical of ``choices`` values where given."""
    param: dict[str, Any] = (
        {"type": "categorical", "choices": list(range(1, choices + 1))}
        if choices
        else {"type": "int", "low": 4, "high": 64}
    )
    return {
        "name": name,
        "model": {"path": "org/some-model"},
        "trace": {"path": trace, "shaping": {"window_s": [0, 10]}},
        "search_space": {"name": "s", "params": {"max-num-seqs": param}},
        "trials": 2,
        "mlflow": {"enabled": False},
    }


def _multipart(job: dict[str, Any], trace: bytes, not_before: str) -> tuple[bytes, str]:
    """The body and content type of an upload as the client sends it (a form field, then the
    ``job`` and ``trace`` file parts)."""
    b = secrets.token_hex(16)
    body = (
        (
            f'--{b}\r\nContent-Disposition: form-data; name="not_before"\r\n\r\n{not_before}\r\n'
            f'--{b}\r\nContent-Disposition: form-data; name="job"; filename="job.json"\r\n'
            "Content-Type: application/json\r\n\r\n"
        ).encode()
        + json.dumps(job).encode()
        + (
            f'\r\n--{b}\r\nContent-Disposition: form-data; name="trace"; filename="trace.csv"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + trace
        + f"\r\n--{b}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={b}"


@dataclass
class Service:
    """The running service: its port, tokens and bodies to send."""

    port: int
    tokens: dict[str, str]
    big_space: bytes  # 5a's JSON body
    upload: tuple[bytes, str]  # 5b's multipart body and content type
    probe_nice: int | None = None  # the probe's niceness, once it runs


def start_service(tmp: Path) -> Service:
    """``run_service`` on a free loopback port, with a token file and roots under ``tmp``."""
    from optimizer.service import security
    from optimizer.service.api import run_service, settings_from_args
    from optimizer.service.submissions import parse_body

    tokens = {team: secrets.token_urlsafe(24) for team in TEAMS}
    token_file = tmp / "tokens"
    token_file.write_text("".join(f"{team} {t}\n" for team, t in tokens.items()))
    traces, models = tmp / "traces", tmp / "models"
    traces.mkdir()
    models.mkdir()
    shutil.copy(EXAMPLE_TRACE, traces / EXAMPLE_TRACE.name)
    settings = settings_from_args(
        {
            "database_url": f"sqlite:///{tmp / 'service.db'}",
            "data_dir": str(tmp / "data"),
            "trace_roots": [str(traces)],
            "model_roots": [str(models)],
            "allow_hub_models": True,
            "token_file": str(token_file),
            "max_concurrent": 1,
            "mlflow": False,
        }
    )
    not_before = (datetime.now() + timedelta(days=1)).isoformat(timespec="seconds")
    choices = security.MAX_CONTAINER_ITEMS
    doc = {
        "job": _job("big-space", str(traces / EXAMPLE_TRACE.name), choices),
        "not_before": not_before,
    }
    big_space = json.dumps(doc).encode()
    parse_body(big_space, "application/json")  # within the body bounds, or fail here
    upload = _multipart(_job("upload", "trace.csv"), _trace_csv(TRACE_ROWS), not_before)
    port = _free_port()
    run_service(settings, host=HOST, port=port)
    return Service(port, tokens, big_space, upload)


def stop_service() -> None:
    import ray

    from optimizer.runners import serve_shutdown

    serve_shutdown()
    ray.shutdown()


def api_processes() -> dict[str, dict[str, Any]]:
    """Serve's proxy and the API replica: pid and niceness (highest of its threads)."""
    from optimizer.runners import serve_api_priority
    from optimizer.service.api import APP_NAME

    return serve_api_priority(APP_NAME)


# --- the phases ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """What a phase's clients sent and got."""

    sent: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    took_s: list[float] = field(default_factory=list)  # answered submissions, any status


async def _slow_body(port: int, token: str, stop_at: float, after_s: float, tally: Tally) -> None:
    """One of case 1's clients until ``stop_at``: headers promising :data:`SLOW_LENGTH`
    bytes, then a byte every :data:`SLOW_EVERY_S`; opened again at the next tick once answered."""
    await asyncio.sleep(after_s)
    first = time.monotonic()
    head = _head("/v1/studies", token, "application/json", SLOW_LENGTH)
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            tally.answers["no connection"] += 1
        else:
            tally.sent += 1
            answer = asyncio.ensure_future(_response(reader))
            try:
                writer.write(head)
                await writer.drain()
                while not answer.done() and time.monotonic() < stop_at:
                    await asyncio.wait({answer}, timeout=SLOW_EVERY_S)
                    if not answer.done():
                        try:
                            writer.write(b" ")
                            await writer.drain()
                        except OSError:  # answered and closed: the answer says
                            pass
                if not answer.done():
                    tally.answers["open at end"] += 1
                elif answer.exception() is not None:
                    tally.answers["closed"] += 1
                else:
                    tally.answers[str(answer.result()[0])] += 1
            except OSError:
                tally.answers["closed"] += 1
            finally:
                answer.cancel()
                writer.close()
        since = time.monotonic() - first
        await asyncio.sleep(SLOW_EVERY_S - since % SLOW_EVERY_S)


async def _send(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> tuple[int, dict[str, str]]:
    """Send ``payload`` while reading the answer: one that comes before the whole body was
    sent (a 429 before the body is read, the connection then closed) is read, not lost to the
    broken pipe."""
    answer = asyncio.ensure_future(_response(reader))
    writer.write(payload)
    sending = asyncio.ensure_future(writer.drain())
    try:
        await asyncio.wait({answer, sending}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            await sending  # all sent (or the connection broke: below)
        return await asyncio.wait_for(answer, SUBMIT_TIMEOUT_S)
    except OSError:
        await asyncio.wait({answer}, timeout=1.0)  # an answer that came says why
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            return answer.result()
        raise
    finally:
        for task in (answer, sending):
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "never retrieved" noise
            else:
                task.cancel()


async def _submitter(port: int, payload: bytes, stop_at: float, tally: Tally) -> None:
    """One of case 5's clients: the same request, one after another, until ``stop_at``."""
    while time.monotonic() < stop_at:
        t0 = time.monotonic()
        tally.sent += 1
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                status, headers = await _send(reader, writer, payload)
            finally:
                writer.close()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            tally.answers[type(exc).__name__] += 1
            await asyncio.sleep(1.0)
            continue
        tally.answers[str(status)] += 1
        tally.took_s.append(time.monotonic() - t0)
        if status == 429:
            await asyncio.sleep(float(headers.get("retry-after", "1")))


def _phase_clients(
    phase: str, svc: Service, stop_at: float, tally: Tally
) -> list[Any]:  # coroutines
    if phase == "1":
        token = svc.tokens["alpha"]
        ramp = SLOW_RAMP_S / SLOW_CONNECTIONS
        return [
            _slow_body(svc.port, token, stop_at, i * ramp, tally) for i in range(SLOW_CONNECTIONS)
        ]
    if phase == "5a":
        clients, body, ctype = 4, svc.big_space, "application/json"
    elif phase == "5b":
        clients, (body, ctype) = 8, svc.upload
    else:
        return []
    return [
        _submitter(
            svc.port,
            _head("/v1/studies", svc.tokens[TEAMS[i % 2]], ctype, len(body)) + body,
            stop_at,
            tally,
        )
        for i in range(clients)
    ]


def _check_processes(pid: int | None) -> list[Any]:
    """The replica's check processes (started by multiprocessing's spawn), as psutil sees them."""
    import psutil

    if not pid:
        return []
    try:
        children = psutil.Process(pid).children(recursive=True)
        return [c for c in children if c.cmdline()[-1:] == ["--multiprocessing-fork"]]
    except (psutil.Error, OSError):
        return []


def _nice(proc: Any) -> str:
    import psutil

    try:
        return str(proc.nice())
    except (psutil.Error, OSError):
        return "?"


def _rss(pid: int | None) -> int | None:
    """The replica's RSS with its check processes'."""
    import psutil

    try:
        own = int(psutil.Process(pid).memory_info().rss) if pid else None
    except (psutil.Error, OSError):
        return None
    if own is None:
        return None
    for child in _check_processes(pid):
        try:
            own += int(child.memory_info().rss)
        except (psutil.Error, OSError):
            continue
    return own


@dataclass
class Row:
    phase: str
    seconds: float
    tally: Tally
    probes: list[float]
    failed: int
    rss: list[int]
    proxy: list[float] = field(default_factory=list)  # Serve's proxy alone (/-/healthz), ms


async def _run_clients(
    phase: str, svc: Service, seconds: float, drain_s: float, replica_pid: int | None
) -> tuple[Tally, list[int], float]:
    tally = Tally()
    rss: list[int] = []
    t0 = time.monotonic()
    stop_at = t0 + seconds
    clients = _phase_clients(phase, svc, stop_at, tally)
    load = asyncio.gather(*clients) if clients else asyncio.sleep(seconds)

    async def sample() -> None:
        while True:
            if (now := _rss(replica_pid)) is not None:
                rss.append(now)
            await asyncio.sleep(0.5)

    sampler = asyncio.ensure_future(sample())
    try:
        await asyncio.wait_for(load, seconds + drain_s)
    except TimeoutError:
        tally.answers["cut at drain"] += 1
    finally:
        sampler.cancel()
    if (now := _rss(replica_pid)) is not None:
        rss.append(now)
    return tally, rss, time.monotonic() - t0


def run_phase(
    phase: str, svc: Service, seconds: float, drain_s: float, probe_nice: int | None = None
) -> Row:
    """One phase with the probe running in a process of its own throughout."""
    pid = api_processes()
    replica_pid = next((v["pid"] for k, v in pid.items() if k.startswith("SERVE_REPLICA")), None)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    mine, theirs = ctx.Pipe()
    probe = ctx.Process(target=_probe, args=(svc.port, stop, theirs, probe_nice), daemon=True)
    probe.start()
    assert mine.poll(60), "the probe did not start"
    svc.probe_nice = mine.recv()
    try:
        tally, rss, took = asyncio.run(_run_clients(phase, svc, seconds, drain_s, replica_pid))
    finally:
        stop.set()
    assert mine.poll(30), "the probe did not answer"
    probes, failed, proxy = mine.recv()
    probe.join(10)
    return Row(phase, took, tally, probes, failed, rss, proxy)


# --- the table ----------------------------------------------------------------------------------


def _p95(values: list[float]) -> float:
    ranked = sorted(values)
    return ranked[max(0, math.ceil(0.95 * len(ranked)) - 1)]


def _mib(rss: list[int]) -> str:
    if len(rss) < 2:
        return "n/a"
    return f"{(rss[-1] - rss[0]) / 2**20:+.0f} (peak {(max(rss) - rss[0]) / 2**20:+.0f})"


def table(rows: list[Row]) -> str:
    out = [
        "| phase | s | sent | answers | submit median s | /healthz median / p95 / max ms "
        "(probes, failed) | over 100 ms | proxy alone median / max ms | replica + checks RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(r.tally.answers.items())) or "-"
        took = f"{statistics.median(r.tally.took_s):.2f}" if r.tally.took_s else "-"
        ms = r.probes
        health = (
            f"{statistics.median(ms):.1f} / {_p95(ms):.1f} / {max(ms):.1f} ({len(ms)}, {r.failed})"
            if ms
            else "-"
        )
        slow = sorted(round(m) for m in ms if m > 100.0)
        alone = f"{statistics.median(r.proxy):.1f} / {max(r.proxy):.1f}" if r.proxy else "-"
        over = f"{len(slow)}" + (f" ({', '.join(map(str, slow[-5:]))} ms)" if slow else "")
        out.append(
            f"| {r.phase} | {r.seconds:.0f} | {r.tally.sent} | {answers} | {took} | {health} "
            f"| {over} | {alone} | {_mib(r.rss)} |"
        )
    return "\n".join(out)


def _niceness_line(svc: Service) -> str:
    probe = "" if svc.probe_nice is None else f", probe {svc.probe_nice}"
    parts = [f"benchmark {os.nice(0)}{probe}"]
    for name, seen in sorted(api_processes().items()):
        kind = "proxy" if name.startswith("SERVE_PROXY") else "replica"
        parts.append(f"{kind} {seen['nice']} (pid {seen['pid']})")
        if kind == "replica":
            checks = sorted({_nice(c) for c in _check_processes(seen["pid"])})
            parts.append(f"checks {'/'.join(checks) or '-'}")
    parts.append(f"Ray's GCS {_gcs_nice()}")
    return "niceness: " + ", ".join(parts)


def _gcs_nice() -> str:
    """The niceness of the local Ray's GCS server (a child of this process), or '?'."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if "gcs_server" in child.name():
                return _nice(child)
        except psutil.Error:
            continue
    return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=45.0, help="each load phase's length")
    p.add_argument("--idle-s", type=float, default=10.0, help="the idle phase's length")
    p.add_argument("--drain-s", type=float, default=60.0, help="most wait for requests in flight")
    p.add_argument("--phases", default="idle,1,5a,5b", help="comma-separated, in order")
    p.add_argument(
        "--load-nice",
        type=int,
        default=None,
        help="lower this process (the load's clients) to this niceness once the service is up, "
        "the service (Ray's processes, Serve's proxy and replica) keeping the one it started "
        "with (default: no change)",
    )
    p.add_argument(
        "--probe-nice",
        type=int,
        default=None,
        help="the probe's niceness (default: this process's); lower needs root or CAP_SYS_NICE",
    )
    args = p.parse_args(argv)
    phases = [ph.strip() for ph in args.phases.split(",") if ph.strip()]
    unknown = set(phases) - {"idle", "1", "5a", "5b"}
    if unknown:
        p.error(f"unknown phases: {sorted(unknown)}")
    # Serve's replica logs a line a request to stderr, which Ray streams here: off.
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="service-load-") as tmp:
        t0 = time.monotonic()
        svc = start_service(Path(tmp))
        print(f"service up in {time.monotonic() - t0:.0f} s on port {svc.port}", flush=True)
        if args.load_nice is not None:  # this thread sends the load; Ray's threads keep theirs
            os.setpriority(os.PRIO_PROCESS, 0, args.load_nice)
        print(_niceness_line(svc), flush=True)
        try:
            for phase in phases:
                seconds = args.idle_s if phase == "idle" else args.seconds
                rows.append(run_phase(phase, svc, seconds, args.drain_s, args.probe_nice))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                time.sleep(2.0)
            print(_niceness_line(svc))
        finally:
            stop_service()
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
