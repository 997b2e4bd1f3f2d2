"""Where a server's start goes, and what the cuts of issue 16 save: phases side by side.

For a job's model, environment and engine arguments, each configuration (the baseline, then
``--configs`` overrides) is started and stopped, one server at a time, in these plans:

- ``cold``: each start with empty compile caches of its own (vLLM's, Inductor's, Triton's):
  what the first trials of a study pay on a fresh machine;
- ``shared``: the configurations in turn on one cache folder (as the trials of a study share
  the study's cache), then the first configuration again (a resumed study, a re-validation);
- ``pairs``: on that cache, each configuration started plain, then preloaded (below), so the
  two see the same cache;
- ``preload``: on that warm cache, each start from an interpreter that imported vLLM before
  the start was asked for (:mod:`optimizer.engine.preload`; the imports overlapped with a
  sleep that stands for the previous trial's replay, and their time is printed beside);
- ``parity``: the first configuration, plain start then preloaded start, each measured by a
  full trial replay of the job's trace: P95 TTFT, P95 TPOT, throughput side by side.

Every start prints one line (and one JSON line to ``--out``/starts.jsonl, kept if the run is
cut short); the end prints the median seconds per phase of each plan.

Usage:
    python -m benchmarks.startup_phases JOB.yaml [--plans cold,shared,preload,parity]
        [--configs '[{"max-num-seqs": 64}]'] [--out runs/startup-phases]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from optimizer.config import load_job
from optimizer.engine.defaults import compile_cache_env
from optimizer.engine.process import EngineProcess
from optimizer.engine.startup import PHASES, phase_label
from optimizer.study import prepare
from optimizer.trial import run_trial
from optimizer.types import EngineConfig

_DEFAULT_CONFIGS = '[{"max-num-seqs": 64, "max-num-batched-tokens": 4096}, {"max-num-seqs": 192}]'


def _start(
    engine_cfg: EngineConfig,
    args: dict[str, Any],
    cache: Path,
    log: Path,
    *,
    preload: bool,
    timeout_s: float,
) -> dict[str, Any]:
    config = EngineConfig(
        model=engine_cfg.model,
        args={**engine_cfg.args, **args},
        env={**engine_cfg.env, **compile_cache_env(cache)},
    )
    engine = EngineProcess(config, log_path=log, startup_timeout_s=timeout_s, preload=preload)
    row: dict[str, Any] = {"args": args, "preload": preload}
    try:
        if preload:
            engine.prepare()
            while not (log.parent / (log.name + ".go.ready")).exists():
                time.sleep(0.1)  # stands for the previous trial's replay
            row["ready"] = json.loads((log.parent / (log.name + ".go.ready")).read_text())
        engine.start()
        row.update(
            startup_s=round(engine.startup_s or 0.0, 2),
            preload_s=round(engine.preload_s, 2) if engine.preload_s else None,
            **engine.startup_phases,
        )
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        engine.stop()
    return row


def _parity(plan: Any, out: Path, cache: Path, timeout_s: float) -> list[dict[str, Any]]:
    rows = []
    for i, preload in enumerate((False, True)):
        spec = plan.trial_spec(
            i, dict(plan.baseline_args), workdir=out / f"parity-{i}", seed=900_000, early_stop=False
        )
        from dataclasses import replace

        spec = replace(
            spec,
            capacity=None,
            engine=EngineConfig(
                model=spec.engine.model,
                args=spec.engine.args,
                env={**spec.engine.env, **compile_cache_env(cache)},
            ),
        )
        engine = EngineProcess(
            spec.engine,
            log_path=Path(spec.workdir) / "engine.log",
            startup_timeout_s=timeout_s,
            preload=preload,
        )
        if preload:
            engine.prepare()
        result = run_trial(spec, engine=engine)
        s = result.summary
        rows.append(
            {
                "plan": "parity",
                "preload": preload,
                "status": result.status.value,
                "startup_s": round(result.startup_s or 0.0, 2),
                "p95_ttft_ms": s.get("p95_ttft_ms"),
                "p95_tpot_ms": s.get("p95_tpot_ms"),
                "output_throughput": s.get("output_throughput"),
                "completed": s.get("completed"),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job")
    ap.add_argument("--plans", default="cold,shared,preload,parity")
    ap.add_argument("--configs", default=_DEFAULT_CONFIGS, help="JSON list of argument overrides")
    ap.add_argument("--out", default="runs/startup-phases")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--preload-first",
        action="store_true",
        help="pairs: the preloaded start first (it then meets the colder cache: conservative)",
    )
    ns = ap.parse_args()
    console = Console(width=160)
    job, base = load_job(ns.job)
    plan = prepare(job, base)
    configs: list[dict[str, Any]] = [{}, *json.loads(ns.configs)]
    engine_cfg = EngineConfig(
        model=plan.engine.model, args=dict(plan.baseline_args), env=dict(plan.engine.env)
    )
    out = Path(ns.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    shared = Path(tempfile.mkdtemp(prefix="shared-cache-", dir=out))
    record = out / "starts.jsonl"
    rows: list[dict[str, Any]] = []
    console.print(f"model {plan.engine.model}, baseline {plan.baseline_args}, out {out}")

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        with open(record, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        phases = row.get("phases") or {}
        console.print(
            f"{row['plan']:8} {json.dumps(row.get('args', {})):60.60} "
            f"{row.get('startup_s', '-'):>7} s  preload {row.get('preload_s') or '-'}  "
            + " ".join(f"{k}={v:.1f}" for k, v in phases.items())
            + (f"  reported {row.get('reported')}" if row.get("reported") else "")
            + (f"  [red]{row['error']}[/]" if row.get("error") else "")
        )

    plans = ns.plans.split(",")
    for name in ("cold", "shared", "preload", "pairs"):
        if name not in plans:
            continue
        order = [*configs, configs[0]] if name == "shared" else configs
        for k, args in enumerate(order):
            cache = Path(tempfile.mkdtemp(prefix="cold-", dir=out)) if name == "cold" else shared
            # pairs: a plain start, then a preloaded one, of each configuration on one cache.
            pair = ("preload", "plain") if ns.preload_first else ("plain", "preload")
            for label in pair if name == "pairs" else (name,):
                row = _start(
                    engine_cfg,
                    args,
                    cache,
                    out / f"{label}-{k}" / "engine.log",
                    preload=label == "preload",
                    timeout_s=ns.timeout,
                )
                keep({"plan": label, "again": name == "shared" and k == len(configs), **row})
    if "parity" in plans:
        for row in _parity(plan, out, shared, ns.timeout):
            keep(row)

    table = Table(title="startup by phase: median seconds per plan")
    table.add_column("phase")
    started = [r for r in rows if r.get("phases") and not r.get("again")]
    names = [
        n for n in ("cold", "shared", "plain", "preload") if any(r["plan"] == n for r in started)
    ]
    for n in names:
        table.add_column(n, justify="right")
    for phase in (*PHASES, "total"):
        cells = []
        for n in names:
            docs = [r for r in started if r["plan"] == n]
            vals = [
                r["startup_s"] if phase == "total" else r["phases"].get(phase, 0.0) for r in docs
            ]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        table.add_row(phase_label(phase) if phase != "total" else "total", *cells)
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
