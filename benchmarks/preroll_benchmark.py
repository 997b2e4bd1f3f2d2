"""Does a window's pre-roll change what a capacity trial measures? Prefix caching on vs off,
with and without the pre-roll, one configuration, on a windowed conversation trace.

A window cut from the middle of a conversation trace holds later turns of conversations that
began before it: production's server has their prefixes cached, a cold replay does not. The
script writes a seeded synthetic conversation trace (canonical JSONL; sessions arrive as a
Poisson process, each turn's prompt is a shared system prompt, the conversation so far and a
new user message, so turn k + 1 extends turn k's prompt), prepares ``JOB`` (a capacity job on
the CPU build; its trace path and window are replaced by this trace and ``--window``), and
runs four capacity trials of one configuration, each on a freshly started server, in the
order (caching on, pre-roll on), (on, off), (off, on), (off, off). It prints one row per
trial: the window's prefix reuse the replay offers (cold, or after the pre-roll), the
capacity with its bracket, the steps, the nominal P95 TTFT and the server's prefix-cache hit
rate over the whole trial (its ``vllm:prefix_cache_hits/queries`` counters: warm-up,
pre-rolls and steps together).

``--compare preroll`` (issue 34) runs three trials with prefix caching on instead: no pre-roll
(cold), the stretch back to the window's oldest prefix reference (the default until issue 34:
every request of it), the window's warm set (today's default: one prefill-only request per
prefix chain the window reuses, sent once per server and kept between steps while the KV cache
holds it and the steps since, :class:`~optimizer.capacity.measure.StepRunner`), and the warm
set sent before every step after a prefix-cache reset (how it was sent until then), with the
pre-roll's prompt tokens and seconds per step (0 for a step that kept it) beside the rest.

``--trace FILE`` replays a recorded trace instead (any format the importers read, e.g. the
Mooncake conversation trace with its prefix blocks), shaped as the job says (its length scale,
clip, output cap), with only the window replaced. ``--stretch-steps N`` gives the stretch's
trial at most N capacity steps (on a real trace one step of it can take minutes), and that
row's pre-roll is sent uncut, as the old default sent it: today's trial cuts any pre-roll to
the server's KV cache. ``--plan-only`` prints what each row would send and starts nothing;
``--rows warm`` runs only the rows whose label has that word; ``--args '{"FLAG": null}'``
drops a job's engine argument.

Usage:
    python benchmarks/preroll_benchmark.py examples/cpu-capacity.yaml [--compare preroll] \
        [--args '{"max-num-seqs": 16}'] [--window 270:300] [--max-send-lag-ms 500] [--max-scale 256]
        [--ttft-slo-ms 500] [--tpot-slo-ms 50] [--trace FILE] [--max-steps 12]
        [--start-scale 0.5] [--stretch-steps 1] [--plan-only] [--rows cold,warm]
        [--out runs/preroll-benchmark]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from optimizer.config import load_job
from optimizer.study import prepare
from optimizer.trial import run_trial
from optimizer.types import Trace, TraceRequest
from optimizer.workload.formats import read_trace, write_trace
from optimizer.workload.shaping import ShapeSpec, covering_preroll_s, preroll_trace, shape
from optimizer.workload.stats import prefix_reuse_ratio

BLOCK = 64


def conversations(
    seed: int = 0,
    duration_s: float = 360.0,
    session_rate: float = 0.3,
    systems: int = 16,
    system_tokens: int = 64,
    max_len: int = 1900,
) -> Trace:
    """Seeded conversations: a session picks one of ``systems`` system prompts; turn k's prompt
    is that prompt, the earlier turns (user messages and answers) and a new user message
    (lognormal, median 80 tokens); answers median 40 tokens; think time exponential, mean 45 s;
    a session ends after 2-9 turns or when its next prompt would exceed ``max_len``."""
    rng = np.random.default_rng(seed)
    requests: list[TraceRequest] = []
    t = 0.0
    session = 0
    while True:
        t += float(rng.exponential(1.0 / session_rate))
        if t >= duration_s:
            break
        system = int(rng.integers(systems))
        history = system_tokens
        at = t
        for _ in range(int(rng.integers(2, 10))):
            user = max(8, int(rng.lognormal(np.log(80), 0.6)))
            answer = max(4, min(200, int(rng.lognormal(np.log(40), 0.5))))
            prompt = history + user
            if prompt + answer > max_len or at >= duration_s:
                break
            n_blocks = -(-prompt // BLOCK)
            sys_blocks = system_tokens // BLOCK
            blocks = tuple(
                system * 100 + j if j < sys_blocks else 1_000_000 + session * 1000 + j
                for j in range(n_blocks)
            )
            requests.append(TraceRequest(round(at, 3), prompt, answer, blocks, f"c{session}"))
            history = prompt + answer
            at += float(rng.exponential(45.0))
        session += 1
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(tuple(requests), block_size=BLOCK, source=f"synthetic conversations, seed {seed}")


def _job(
    job_path: str,
    trace_path: Path,
    window: tuple[float, float],
    out: Path,
    ns: argparse.Namespace,
) -> Path:
    """The job file with this trace and window (written next to the trace)."""
    doc: dict[str, Any] = yaml.safe_load(Path(job_path).read_text())
    base = Path(job_path).resolve().parent
    model = doc.get("model", {})
    if "path" in model and not Path(model["path"]).is_absolute():
        model["path"] = str((base / model["path"]).resolve())
    doc["trace"]["path"] = str(trace_path.resolve())
    if ns.trace:
        # A recorded trace: the job's shaping (length scale, clip, output cap), this window,
        # the default pre-roll (the warm set).
        doc["trace"].pop("format", None)
        shaping = dict(doc["trace"].get("shaping") or {})
        shaping.pop("preroll_s", None)
        shaping["window_s"] = list(window)
        doc["trace"]["shaping"] = shaping
    else:
        doc["trace"]["format"] = "canonical"
        doc["trace"]["shaping"] = {"window_s": list(window), "max_model_len": 2048}
    doc["trace"]["max_send_lag_ms"] = ns.max_send_lag_ms
    capacity = doc.setdefault("capacity", {})
    capacity.update(max_scale=ns.max_scale, max_steps=ns.max_steps)
    if ns.start_scale is not None:
        capacity["start_scale"] = ns.start_scale
    for metric, bound in (("p95_ttft_ms", ns.ttft_slo_ms), ("p95_tpot_ms", ns.tpot_slo_ms)):
        if bound is not None:
            slos = [s for s in doc["objectives"]["slos"] if not s.startswith(metric)]
            doc["objectives"]["slos"] = [f"{metric}<={bound:g}", *slos]
    doc["out"] = str((out / "study").resolve())
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job")
    ap.add_argument("--args", default=None, help="engine arguments (JSON) over the baseline's")
    ap.add_argument("--window", default="270:300", metavar="START:END")
    ap.add_argument("--out", default="runs/preroll-benchmark")
    ap.add_argument(
        "--max-send-lag-ms",
        type=float,
        default=500.0,
        help="the client's lag bound (a shared 2-core machine cannot keep 50 ms)",
    )
    ap.add_argument(
        "--max-scale",
        type=float,
        default=256.0,
        help="the search's ceiling (the window is short: a warm cache carries x32)",
    )
    ap.add_argument(
        "--ttft-slo-ms", type=float, default=None, help="replace the job's P95 TTFT SLO"
    )
    ap.add_argument(
        "--tpot-slo-ms", type=float, default=None, help="replace the job's P95 TPOT SLO"
    )
    ap.add_argument("--trace", default=None, help="a recorded trace instead of the synthetic one")
    ap.add_argument("--max-steps", type=int, default=12, help="capacity steps per trial")
    ap.add_argument("--start-scale", type=float, default=None, help="the search's first scale")
    ap.add_argument(
        "--stretch-steps",
        type=int,
        default=None,
        help="--compare preroll: at most this many steps for the stretch's trial (uncut)",
    )
    ap.add_argument("--plan-only", action="store_true", help="print the rows, start nothing")
    ap.add_argument(
        "--rows",
        default=None,
        help="only the rows whose label contains one of these words (comma-separated: "
        "cold,stretch,warm)",
    )
    ap.add_argument(
        "--compare",
        choices=["caching", "preroll"],
        default="caching",
        help="caching: prefix caching on/off x pre-roll on/off; preroll: cold / the stretch / "
        "the warm set, caching on",
    )
    ns = ap.parse_args()
    out = Path(ns.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    start, end = (float(v) for v in ns.window.split(":"))
    if ns.trace:
        trace_path = Path(ns.trace)
    else:
        trace_path = out / "conversations.jsonl"
        write_trace(conversations(), trace_path)
    job, base = load_job(str(_job(ns.job, trace_path, (start, end), out, ns)))
    plan = prepare(job, base)
    for line in plan.trace_notes:
        print(line)
    args = {**plan.baseline_args, **(json.loads(ns.args) if ns.args else {})}
    args = {k: v for k, v in args.items() if v is not None}  # null drops a job's argument
    runs = _runs(ns.compare, plan.trace, (start, end), job if ns.trace else None)
    if ns.rows:
        wanted = [w.strip() for w in ns.rows.split(",") if w.strip()]
        runs = [r for r in runs if any(w in r[1] for w in wanted)]
        if not runs:
            raise SystemExit(f"--rows {ns.rows!r}: no row's label contains any of {wanted}")
    for caching, label, warm in runs:
        sent = preroll_trace(replace(plan.trace, preroll=warm))
        tokens = sum(r.input_tokens for r in sent.requests)
        print(
            f"row {label!r}: prefix caching {'on' if caching else 'off'}, pre-roll of "
            f"{len(warm)} requests sends {len(sent)} ({tokens:,}"
            f" prompt tokens), uncut, "
            f"{'before each step' if 'every' in label else 'once per server (again where evicted)'}"
            f"; window reuse offered "
            f"{prefix_reuse_ratio(plan.trace, warm):.1%}",
            flush=True,
        )
    if ns.plan_only:
        return 0
    rows = []
    for i, (caching, label, warm) in enumerate(runs):
        preroll = bool(warm)
        spec = plan.trial_spec(
            i,
            {**args, "enable-prefix-caching": caching},
            workdir=out / f"trial-{i}",
            seed=810_000 + i,
        )
        spec = replace(spec, trace=replace(spec.trace, preroll=warm))
        old_default = ns.compare == "preroll" and "stretch" in label
        if old_default and ns.stretch_steps is not None and spec.capacity is not None:
            spec = replace(spec, capacity=replace(spec.capacity, max_steps=ns.stretch_steps))
        t0 = time.monotonic()
        if old_default:
            # The old default sent its whole stretch whatever the server's KV cache; today's
            # trial cuts every pre-roll to it. This row measures the old behaviour.
            with _uncut_preroll():
                result = run_trial(spec)
        elif "every step" in label:
            with _warm_set_every_step():
                result = run_trial(spec)
        else:
            result = run_trial(spec)
        cap = dict(result.capacity or {})
        metrics = result.server_metrics or {}
        queries = metrics.get("vllm:prefix_cache_queries_total", 0.0)
        steps = list(cap.get("steps") or [])
        rows.append(
            {
                "prefix_caching": caching,
                "preroll": preroll,
                "preroll_kind": label,
                "preroll_tokens_per_step": _mean(steps, "preroll_tokens"),
                "preroll_s_per_step": _mean(steps, "preroll_s"),
                "replay_s_per_step": _mean(steps, "replay_s"),
                "warm_set_kept_steps": sum(s.get("warm_set") == "kept" for s in steps),
                "preroll_requests": len(spec.trace.preroll),
                "window_reuse": prefix_reuse_ratio(spec.trace, spec.trace.preroll),
                "status": result.status.value,
                "capacity_rps": cap.get("rps"),
                "rps_lo": cap.get("rps_lo"),
                "rps_hi": cap.get("rps_hi"),
                "steps": len(cap.get("steps") or []),
                "nominal_p95_ttft_ms": result.summary.get("nominal_p95_ttft_ms"),
                "hit_rate": metrics.get("vllm:prefix_cache_hits_total", 0.0) / queries
                if queries
                else None,
                "wall_s": time.monotonic() - t0,
                "message": result.message,
            }
        )
        print(json.dumps(rows[-1], default=str), flush=True)
        # Each row as it ends: a run cut off later keeps the rows it finished.
        (out / "rows.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    _print(rows, plan.trace, args, out)
    return 0


def _runs(
    compare: str, trace: Trace, window: tuple[float, float], job: Any = None
) -> list[tuple[bool, str, tuple[TraceRequest, ...]]]:
    """(prefix caching, pre-roll label, pre-roll requests) of each trial. ``job``: a job on a
    recorded trace (the stretch is cut from it with the job's shaping); None: the synthetic
    conversations."""
    if compare == "caching":
        warm = trace.preroll
        return [
            (True, "default", warm),
            (True, "none", ()),
            (False, "default", warm),
            (False, "none", ()),
        ]
    if job is None:
        whole = conversations()
        covered = covering_preroll_s(whole, *window)
        stretch, _ = shape(whole, ShapeSpec(window_s=window, preroll_s=covered, max_model_len=2048))
    else:
        whole, _ = read_trace(job.trace.path, job.trace.format)
        covered = covering_preroll_s(whole, *window)
        spec = ShapeSpec(**{**job.trace.shaping.model_dump(), "preroll_s": covered})
        stretch, _ = shape(whole, spec)
    return [
        (True, "none (cold)", ()),
        (True, f"the {covered:.0f} s stretch", stretch.preroll),
        (True, "warm set, kept between steps", trace.preroll),
        (True, "warm set, sent every step", trace.preroll),
    ]


@contextlib.contextmanager
def _uncut_preroll() -> Iterator[None]:
    """run_trial without today's cut of the pre-roll to the server's KV cache (prefix caching
    stays on for every row of ``--compare preroll``, so nothing else of it changes)."""
    import optimizer.trial as trial_module

    saved = trial_module.bounded_preroll
    trial_module.bounded_preroll = lambda spec, account, effective: (spec, {})
    try:
        yield
    finally:
        trial_module.bounded_preroll = saved


@contextlib.contextmanager
def _warm_set_every_step() -> Iterator[None]:
    """run_trial with the pre-roll sent before every step after a prefix-cache reset (the
    StepRunner's ``keep_warm_set=False``: how steps were warmed before they kept it)."""
    import functools

    import optimizer.capacity.trial as capacity_trial

    saved = capacity_trial.StepRunner
    capacity_trial.StepRunner = functools.partial(saved, keep_warm_set=False)  # type: ignore[misc]
    try:
        yield
    finally:
        capacity_trial.StepRunner = saved  # type: ignore[misc]


def _mean(steps: list[dict[str, Any]], key: str) -> float | None:
    values = [float(s[key]) for s in steps if isinstance(s.get(key), int | float)]
    return sum(values) / len(values) if values else None


def _print(rows: list[dict[str, Any]], trace: Trace, args: dict[str, Any], out: Path) -> None:
    cold = prefix_reuse_ratio(trace)
    warm = prefix_reuse_ratio(trace, trace.preroll)
    table = Table(
        title=f"{len(trace)} requests, pre-roll {len(trace.preroll)}; window prefix reuse "
        f"{cold:.0%} cold, {warm:.0%} after the pre-roll; args {args}"
    )
    for col in (
        "prefix caching",
        "pre-roll",
        "pre-roll tokens / step",
        "pre-roll s / step",
        "kept / steps",
        "window reuse",
        "capacity req/s",
        "bracket req/s",
        "steps",
        "nominal p95 TTFT ms",
        "server hit rate",
        "wall s",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        hi = r["rps_hi"]
        table.add_row(
            "on" if r["prefix_caching"] else "off",
            f"{r['preroll_kind']}: {r['preroll_requests']} requests" if r["preroll"] else "none",
            "-" if r["preroll_tokens_per_step"] is None else f"{r['preroll_tokens_per_step']:,.0f}",
            "-" if r["preroll_s_per_step"] is None else f"{r['preroll_s_per_step']:.2f}",
            f"{r.get('warm_set_kept_steps', 0)} / {r['steps']}",
            f"{r['window_reuse']:.0%}",
            "-" if r["capacity_rps"] is None else f"{r['capacity_rps']:.3g}",
            "-"
            if r["rps_lo"] is None
            else f"[{r['rps_lo']:.3g}, {'-' if hi is None else f'{hi:.3g}'}]",
            str(r["steps"]),
            "-" if r["nominal_p95_ttft_ms"] is None else f"{r['nominal_p95_ttft_ms']:,.0f}",
            "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}",
            f"{r['wall_s']:.0f}",
        )
    Console(width=160).print(table)
    (out / "rows.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
