"""``vllm-autotune stability STUDY_DIR``: the command and its verdict table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

__all__ = ["register", "verdict_table"]

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "n/a": "dim"}


def register(sub: Any) -> None:
    """Add ``stability`` to the main parser's subparsers."""
    p = sub.add_parser(
        "stability",
        help="run the chosen configuration and the baseline under sustained load, a burst "
        "and long inputs; verdicts in STUDY_DIR/stability.json",
    )
    p.add_argument("dir", help="study folder")
    p.add_argument(
        "--trial", type=int, default=None, help="check this trial (default: what export picks)"
    )
    p.add_argument(
        "--minutes", type=float, default=3.0, help="sustained phase, minutes (default 3)"
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=0.7,
        help="capacity studies: load as a fraction of the measured capacity (default 0.7)",
    )
    p.add_argument(
        "--burst-factor", type=float, default=3.0, help="burst rate: x capacity (default 3)"
    )
    p.add_argument("--burst-s", type=float, default=20.0, help="burst seconds (default 20)")
    p.add_argument(
        "--recovery-s",
        type=float,
        default=None,
        help="seconds after the burst (default: 1.5 x the time its backlog takes to drain at "
        "capacity, at least 30)",
    )
    p.add_argument(
        "--long-s", type=float, default=30.0, help="long-input phase seconds (default 30)"
    )
    p.add_argument("--window-s", type=float, default=10.0, help="latency window (default 10)")
    p.add_argument("--no-baseline", action="store_true", help="do not run the baseline")
    p.set_defaults(func=cmd_stability)


def cmd_stability(ns: argparse.Namespace) -> int:
    """Exit 0 when the chosen configuration is stable and no worse than the baseline, 4 when
    it is not."""
    from optimizer.cli import _load_study_dir, console
    from optimizer.stability.plan import PlanSettings
    from optimizer.stability.workflow import StabilityOptions, run_study_stability

    folder = Path(ns.dir)
    saved, study = _load_study_dir(folder)
    options = StabilityOptions(
        trial=ns.trial,
        fraction=ns.fraction,
        burst_factor=ns.burst_factor,
        settings=PlanSettings(
            sustained_s=ns.minutes * 60,
            burst_s=ns.burst_s,
            recovery_s=30.0 if ns.recovery_s is None else ns.recovery_s,
            long_input_s=ns.long_s,
            window_s=ns.window_s,
        ),
        auto_recovery=ns.recovery_s is None,
        baseline=not ns.no_baseline,
    )
    doc = run_study_stability(
        folder, saved, study, options, progress=lambda line: console.print(f"[dim]{line}[/]")
    )
    console.print(verdict_table(doc))
    for line in doc["worse_than_baseline"]:
        console.print(f"[bold red]worse than the baseline:[/] {escape(line)}")
    console.print(f"status: {doc['status']}; wrote {folder / 'stability.json'}")
    return 0 if doc["status"] == "stable" and not doc["worse_than_baseline"] else 4


def _peaks(phases: dict[str, Any]) -> str:
    parts = []
    for name, st in phases.items():
        kv, waiting = st.get("kv_usage_peak"), st.get("waiting_peak")
        kv_text = "-" if kv is None else f"{kv:.0%}"
        wait_text = "-" if waiting is None else f"{waiting:g}"
        parts.append(f"{name} {kv_text}/{wait_text}")
    return ", ".join(parts) or "-"


def verdict_table(doc: dict[str, Any]) -> Table:
    """One row per verdict, a column per run (chosen, baseline)."""
    runs = doc.get("runs") or {}
    table = Table(title=f"stability of trial {doc.get('trial')}: {doc.get('status')}")
    table.add_column("verdict")
    for label in runs:
        table.add_column(label)
    names: list[str] = []
    for run in runs.values():
        names += [v["name"] for v in run.get("verdicts", []) if v["name"] not in names]
    for name in names:
        cells = []
        for run in runs.values():
            v = next((v for v in run.get("verdicts", []) if v["name"] == name), None)
            if v is None:
                cells.append("-")
                continue
            style = _STYLE.get(v["status"], "")
            cells.append(f"[{style}]{v['status']}[/] {escape(v['text'])}")
        table.add_row(name, *cells)
    table.add_row("peak KV / waiting", *(_peaks(run.get("phases") or {}) for run in runs.values()))
    lags = []
    for run in runs.values():
        lag = run.get("p99_send_lag_ms")
        kept = "" if run.get("schedule_kept", True) else " (schedule NOT kept: a lighter load)"
        lags.append("-" if lag is None else f"P99 send lag {lag:,.0f} ms{kept}")
    table.add_row("client", *lags)
    failures = [run.get("failure") or "" for run in runs.values()]
    if any(failures):
        table.add_row("server", *(escape(f) or "served" for f in failures))
    return table
