"""What a capacity search costs per trial against a fixed-load trial, and how repeatable it is.

One configuration (the job's baseline, or ``--args``) of a job is measured

- once as a fixed-load trial (one replay of the shaped trace, no early stop: the old trial), and
- ``--repeats`` times as a capacity trial (server started once, then the rate search),

each on its own freshly started server with fresh prompts, one after the other, so the
numbers sit side by side in one run. It prints one row per trial (startup, replay, steps,
share of wall time spent replaying, capacity and its bracket) and the spread of the capacity
over the repeats.

Usage:
    python benchmarks/capacity_benchmark.py JOB.yaml [--repeats 3] [--args '{"max-num-seqs": 8}']
        [--out runs/capacity-benchmark]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from optimizer.config import load_job
from optimizer.study import prepare
from optimizer.trial import run_trial


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--args", default=None, help="engine arguments (JSON) instead of the baseline")
    ap.add_argument("--out", default="runs/capacity-benchmark")
    ns = ap.parse_args()
    job, base = load_job(ns.job)
    plan = prepare(job, base)
    if not plan.objectives.is_capacity:
        raise SystemExit(f"{ns.job}: use a job with a capacity objective (preset: capacity)")
    args: dict[str, Any] = (
        {**plan.engine.args, **json.loads(ns.args)} if ns.args else dict(plan.baseline_args)
    )
    out = Path(ns.out) / time.strftime("%Y%m%d-%H%M%S")
    rows = []
    runs = [("fixed-load", 0)] + [("capacity", k) for k in range(ns.repeats)]
    for i, (mode, k) in enumerate(runs):
        spec = plan.trial_spec(
            i, args, workdir=out / f"{mode}-{k}", seed=700_000 + i, early_stop=False
        )
        if mode == "fixed-load":
            from dataclasses import replace

            spec = replace(spec, capacity=None)
        t0 = time.monotonic()
        result = run_trial(spec)
        wall = time.monotonic() - t0
        cap = dict(result.capacity or {})
        rows.append(
            {
                "mode": mode,
                "status": result.status.value,
                "startup_s": result.startup_s or 0.0,
                "replay_s": result.replay_s or 0.0,
                "wall_s": wall,
                "steps": len(cap.get("steps") or []) or 1,
                "capacity_rps": cap.get("rps"),
                "bracket": (cap.get("lo"), cap.get("hi")),
                "p95_ttft_ms": result.summary.get("p95_ttft_ms"),
                "p95_tpot_ms": result.summary.get("p95_tpot_ms"),
            }
        )
        print(json.dumps(rows[-1], default=str), flush=True)
    table = Table(title=f"capacity search vs fixed-load trial: {job.name}, args {args}")
    for col in (
        "mode",
        "status",
        "startup s",
        "replay s",
        "wall s",
        "steps",
        "replay share",
        "capacity req/s",
        "rate bracket",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        lo, hi = r["bracket"]
        table.add_row(
            r["mode"],
            r["status"],
            f"{r['startup_s']:.0f}",
            f"{r['replay_s']:.0f}",
            f"{r['wall_s']:.0f}",
            str(r["steps"]),
            f"{r['replay_s'] / r['wall_s']:.0%}",
            "-" if r["capacity_rps"] is None else f"{r['capacity_rps']:.3g}",
            "-" if lo is None else f"x[{lo:.3g}, {'inf' if hi is None else f'{hi:.3g}'}]",
        )
    console = Console(width=140)
    console.print(table)
    caps = [r["capacity_rps"] for r in rows if r["mode"] == "capacity" and r["capacity_rps"]]
    fixed = rows[0]
    if caps:
        med = statistics.median(caps)
        spread = (max(caps) - min(caps)) / med if med else float("nan")
        console.print(
            f"capacity over {len(caps)} repeats: median {med:.3g} req/s, min {min(caps):.3g}, "
            f"max {max(caps):.3g} (spread {spread:.0%} of the median)"
        )
        cap_wall = statistics.mean(r["wall_s"] for r in rows if r["mode"] == "capacity")
        console.print(
            f"a capacity trial costs {cap_wall / fixed['wall_s']:.1f}x a fixed-load trial's wall "
            f"time ({cap_wall:.0f} s vs {fixed['wall_s']:.0f} s)"
        )
    (out / "rows.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
