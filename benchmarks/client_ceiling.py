"""Client ceiling: the highest open-loop request rate a replay client keeps on schedule.

A replay only measures the server if the client sends every request on time (DESIGN §3, §7.2).
This benchmark replays constant-rate traces of short requests against the fake streaming
server (``tests.fakes.openai_stream_server``) on loopback, stepping the rate up, and reports
the P99 send lag at each rate:

* ``ours (client)``: ``sent_s - scheduled_s`` as our replayer records it;
* ``ours (server)`` and ``vllm bench``: lag inferred from the arrival times the fake server
  logs. With a constant interval ``1/R``, request ``i`` should arrive at ``t0 + i/R``; the lag
  of request ``i`` is ``(arrival_i - i/R) - min_j(arrival_j - j/R)``, i.e. relative to the most
  punctual request. The same estimate for both clients makes them comparable. ``vllm bench
  serve`` runs with ``--burstiness inf`` (constant intervals) and a generated tokenizer, in an
  interpreter where ``vllm`` is importable (``--vllm-python``); it is skipped otherwise.

The ceiling is the highest rate whose P99 lag stays under ``--bound-ms`` (default 5 ms).

CPU cost: the client's CPU seconds (user + system, all threads) per step and per request: ours
around ``run_replay`` (prompt and request building included), ``vllm bench serve`` around its
``benchmark()`` coroutine (its test request and metric computation included; interpreter start,
imports and dataset sampling excluded). Both clients run at this process's priority (printed).
``--transport httpx`` measures ours with httpx's own transport instead of the lean one;
``--processes N`` spreads ours over N client processes (their CPU includes their start-up).

Usage::

    python -m benchmarks.client_ceiling [--rates 50,100,200,400,800,1600] [--seconds 5]
        [--vllm-python PATH] [--transport lean|httpx|both]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np

from optimizer.types import Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import run_replay

REPO = Path(__file__).resolve().parents[1]

_VLLM_BENCH_DRIVER = textwrap.dedent(
    """
    import sys, time
    import vllm.benchmarks.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    inner = serve.benchmark
    async def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return await inner(*args, **kwargs)
        finally:
            print(f"CLIENT_CPU_S {time.process_time() - start:.6f}", file=sys.stderr)
    serve.benchmark = timed
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(sys.argv[1:]))
    """
)

_MAKE_TOKENIZER = textwrap.dedent(
    """
    import sys
    from optimizer.engine.models import make_model
    make_model(sys.argv[1], "tiny")
    """
)


def _server_args(itl_ms: float) -> list[str]:
    return ["--port", "0", "--itl-ms", str(itl_ms)]


def start_server(itl_ms: float) -> tuple[subprocess.Popen[str], str]:
    """Start the fake server on a free port; returns the process and its base URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.openai_stream_server", *_server_args(itl_ms)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("listening on"):
        process.kill()
        raise RuntimeError(f"fake server did not start: {line!r}")
    return process, f"http://127.0.0.1:{int(line.split()[-1])}"


def _http(url: str, method: str = "GET") -> bytes:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=30) as response:
        data: bytes = response.read()
        return data


def reset_arrivals(base_url: str) -> None:
    _http(base_url + "/arrivals/reset", "POST")


def arrival_lag_p99_ms(base_url: str, rate_rps: float, n_requests: int) -> float:
    """P99 lag inferred from the server's arrival log (last ``n_requests`` arrivals)."""
    arrivals = sorted(json.loads(_http(base_url + "/arrivals")))[-n_requests:]
    if len(arrivals) < n_requests:
        return float("nan")
    offsets = np.asarray(arrivals) - np.arange(n_requests) / rate_rps
    lags_ms = (offsets - offsets.min()) * 1e3
    return float(np.percentile(lags_ms, 99))


def run_ours(
    base_url: str,
    rate_rps: float,
    seconds: float,
    in_tokens: int,
    out_tokens: int,
    lean: bool = True,
    processes: int = 1,
):
    n = int(rate_rps * seconds)
    trace = Trace(tuple(TraceRequest(i / rate_rps, in_tokens, out_tokens) for i in range(n)))
    reset_arrivals(base_url)
    start = time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = run_replay(
        trace,
        base_url,
        "fake-model",
        vocab=TokenRange(256, 32_000),
        seed=0,
        max_send_lag_ms=5.0,
        lean_transport=lean,
        processes=processes,
    )
    cpu_s = time.process_time() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Client processes (processes > 1): their whole lives, interpreter start and imports too.
    cpu_s += (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    return (
        result.p99_send_lag_ms,
        arrival_lag_p99_ms(base_url, rate_rps, n),
        result.failed,
        cpu_s,
    )


def run_vllm_bench(
    python: str,
    tokenizer_dir: str,
    base_url: str,
    rate_rps: float,
    seconds: float,
    in_tokens: int,
    out_tokens: int,
) -> tuple[float, float, str]:
    n = int(rate_rps * seconds)
    reset_arrivals(base_url)
    args = [
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", "fake-model", "--tokenizer", tokenizer_dir,
        "--dataset-name", "random", "--random-input-len", str(in_tokens),
        "--random-output-len", str(out_tokens), "--ignore-eos",
        "--num-prompts", str(n), "--request-rate", str(rate_rps), "--burstiness", "inf",
        "--num-warmups", "0", "--disable-tqdm", "--seed", "0",
    ]  # fmt: skip
    completed = subprocess.run(
        [python, "-c", _VLLM_BENCH_DRIVER, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if completed.returncode != 0:
        return float("nan"), float("nan"), completed.stderr.strip().splitlines()[-1][:200]
    cpu = [line for line in completed.stderr.splitlines() if line.startswith("CLIENT_CPU_S ")]
    cpu_s = float(cpu[-1].split()[1]) if cpu else float("nan")
    return arrival_lag_p99_ms(base_url, rate_rps, n), cpu_s, ""


def find_vllm_python(candidate: str | None) -> str | None:
    for python in [candidate, sys.executable]:
        if not python:
            continue
        probe = subprocess.run(
            [python, "-c", "import vllm.benchmarks.serve"], capture_output=True, timeout=300
        )
        if probe.returncode == 0:
            return python
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="50,100,200,400,800,1600")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each step")
    parser.add_argument("--input-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--itl-ms", type=float, default=0.0, help="fake server inter-token delay")
    parser.add_argument("--bound-ms", type=float, default=5.0)
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm importable")
    parser.add_argument(
        "--transport", default="lean", choices=["lean", "httpx", "both"], help="ours: which one"
    )
    parser.add_argument("--skip-vllm", action="store_true", help="measure ours only")
    parser.add_argument(
        "--processes", type=int, default=1, help="ours: client processes (run_replay processes=)"
    )
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    vllm_python = None if args.skip_vllm else find_vllm_python(args.vllm_python)
    tokenizer_dir = None
    if vllm_python:
        tokenizer_dir = tempfile.mkdtemp(prefix="ceiling-tok-")
        made = subprocess.run(
            [vllm_python, "-c", _MAKE_TOKENIZER, tokenizer_dir],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        if made.returncode != 0:
            print("cannot build a tokenizer for vllm bench:", made.stderr[-300:])
            vllm_python = None

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"steps of {args.seconds:g} s, {args.input_tokens} in / {args.output_tokens} out tokens")
    print(f"client niceness (both clients): {os.getpriority(os.PRIO_PROCESS, 0)}")
    variants = {"lean": ["lean"], "httpx": ["httpx"], "both": ["lean", "httpx"]}[args.transport]
    process, base_url = start_server(args.itl_ms)
    rows = []
    alive = {variant: True for variant in variants}
    vllm_alive = True
    strikes: dict[str, bool] = {}
    try:
        for rate in rates:
            row: dict[str, object] = {"rate": rate}
            n = int(rate * args.seconds)
            for variant in variants:
                if not alive[variant]:
                    continue
                client_ms, server_ms, failed, cpu_s = run_ours(
                    base_url,
                    rate,
                    args.seconds,
                    args.input_tokens,
                    args.output_tokens,
                    lean=variant == "lean",
                    processes=args.processes,
                )
                row.update(
                    {
                        f"{variant}_client": client_ms,
                        f"{variant}_server": server_ms,
                        f"{variant}_failed": failed,
                        f"{variant}_cpu_s": cpu_s,
                        f"{variant}_cpu_ms_per_req": 1e3 * cpu_s / n,
                    }
                )
                # Stop stepping a client after two collapsed steps in a row (one can be a
                # transient of a shared machine).
                collapsed = not server_ms < 20 * args.bound_ms
                alive[variant] = not (collapsed and strikes.get(variant, False))
                strikes[variant] = collapsed
            if vllm_python and tokenizer_dir and vllm_alive:
                lag_ms, cpu_s, error = run_vllm_bench(
                    vllm_python,
                    tokenizer_dir,
                    base_url,
                    rate,
                    args.seconds,
                    args.input_tokens,
                    args.output_tokens,
                )
                row.update(
                    vllm=lag_ms,
                    vllm_cpu_s=cpu_s,
                    vllm_cpu_ms_per_req=1e3 * cpu_s / n,
                    vllm_error=error,
                )
                collapsed = bool(error) or not lag_ms < 20 * args.bound_ms
                vllm_alive = not (collapsed and strikes.get("vllm", False))
                strikes["vllm"] = collapsed
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        process.terminate()
        process.wait(timeout=10)
        if tokenizer_dir:
            shutil.rmtree(tokenizer_dir, ignore_errors=True)

    def cell(row: dict[str, object], key: str) -> str:
        value = row.get(key)
        return f"{value:10.2f}" if isinstance(value, float) else f"{'-':>10}"

    print()
    print(f"P99 send lag (ms), bound {args.bound_ms:g} ms; client CPU (ms per request)")
    columns = [(f"{v}_{k}", f"{v}({t})") for v in variants for k, t in (("client", "cli"),)]
    columns += [(f"{v}_server", f"{v}(srv)") for v in variants] + [("vllm", "vllm(srv)")]
    columns += [(f"{v}_cpu_ms_per_req", f"{v} cpu") for v in variants]
    columns += [("vllm_cpu_ms_per_req", "vllm cpu")]
    print(f"{'rate/s':>8} " + " ".join(f"{title:>10}" for _, title in columns))
    for row in rows:
        print(f"{row['rate']:8g} " + " ".join(cell(row, key) for key, _ in columns))

    def ceiling(key: str) -> str:
        kept = [
            float(r["rate"])  # type: ignore[arg-type]
            for r in rows
            if isinstance(r.get(key), float) and float(r[key]) < args.bound_ms  # type: ignore[arg-type]
        ]
        return f"{max(kept):g} req/s" if kept else "below the lowest rate"

    for variant in variants:
        print(f"ceiling ours/{variant} (client-recorded lag): {ceiling(variant + '_client')}")
        print(f"ceiling ours/{variant} (server-observed lag): {ceiling(variant + '_server')}")
    if vllm_python:
        print(f"ceiling vllm bench serve (server-observed lag): {ceiling('vllm')}")
    else:
        print("vllm bench serve: skipped (--skip-vllm, or no interpreter with vllm importable)")


if __name__ == "__main__":
    main()
