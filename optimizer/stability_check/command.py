"""``vllm-autotune stability STUDY_DIR``: the command and its verdict table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

__all__ = ["check_study", "register", "report_check", "verdict_table"]

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
    p.add_argument(
        "--replot",
        action="store_true",
        help="run nothing: make the plots of the stored check again (and log it to MLflow)",
    )
    p.add_argument(
        "--rejudge",
        action="store_true",
        help="run nothing: judge the stored check again with the verdict rules installed now "
        "(its plan, records and samples), then plot and log it as --replot does",
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not log the check to MLflow")
    p.set_defaults(func=cmd_stability)


def cmd_stability(ns: argparse.Namespace) -> int:
    """Exit 0 when the chosen configuration is stable and no worse than the baseline, 4 when
    it is not."""
    from optimizer.cli_support import load_study_dir
    from optimizer.errors import ConfigError
    from optimizer.stability.options import stability_options
    from optimizer.stability.stored import read_stability

    folder = Path(ns.dir)
    saved, study = load_study_dir(folder)
    mlflow = not ns.no_mlflow
    if ns.replot or ns.rejudge:
        doc = read_stability(folder)
        if doc is None:
            raise ConfigError(
                f"{folder}: no stability.json to plot; run `vllm-autotune stability {folder}`"
            )
        if ns.rejudge:
            from optimizer.stability_check.rejudge import rejudge

            doc = rejudge(folder, saved, doc)
        return report_check(folder, saved, doc, mlflow=mlflow)
    options = stability_options(
        trial=ns.trial,
        minutes=ns.minutes,
        fraction=ns.fraction,
        burst_factor=ns.burst_factor,
        burst_s=ns.burst_s,
        recovery_s=ns.recovery_s,
        long_s=ns.long_s,
        window_s=ns.window_s,
        baseline=not ns.no_baseline,
    )
    return check_study(folder, saved, study, options, mlflow=mlflow)


def check_study(
    folder: Path, saved: dict[str, Any], study: Any, options: Any, *, mlflow: bool = True
) -> int:
    """Run the check (the ``stability`` command, and ``tune``'s stage when the job asks for
    it), then :func:`report_check`."""
    from optimizer.cli_support import console
    from optimizer.stability_check.workflow import run_study_stability

    doc = run_study_stability(
        folder, saved, study, options, progress=lambda line: console.print(f"[dim]{line}[/]")
    )
    return report_check(folder, saved, doc, mlflow=mlflow)


def report_check(
    folder: Path, saved: dict[str, Any], doc: dict[str, Any], *, mlflow: bool = True
) -> int:
    """The check's plots (into its run folder), its verdict table, and the check logged to the
    study's MLflow parent run when the job has MLflow on; 0 when stable and no worse than the
    baseline, else 4."""
    from optimizer.cli_support import console, err_console
    from optimizer.stability.plots import plot_stability

    try:
        plots = plot_stability(folder, doc)
    except Exception as exc:  # a plot never hides the verdicts
        plots = []
        err_console.print(f"[yellow]stability plots failed:[/] {type(exc).__name__}: {exc}")
    console.print(verdict_table(doc))
    for line in doc.get("worse_than_baseline") or []:
        console.print(f"[bold red]worse than the baseline:[/] {escape(line)}")
    console.print(f"status: {doc.get('status')}; the check: {folder / 'stability.json'}")
    if plots:
        console.print("plots: " + ", ".join(str(p) for p in plots))
    if mlflow and (saved.get("job") or {}).get("mlflow", {}).get("enabled", True):
        from optimizer.tracking import log_stability

        where = log_stability(folder)
        if where is not None:
            console.print(f"[dim]logged to the study's MLflow parent run: {where}[/]")
    return 0 if doc.get("status") == "stable" and not doc.get("worse_than_baseline") else 4


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
