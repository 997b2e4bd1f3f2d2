"""``vllm-autotune regress STUDY_DIR``: the command, its tables and its exit code."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

__all__ = ["figure_table", "register", "stack_table"]

_STYLE = {"worse": "bold red", "better": "green", "within noise": "", "n/a": "dim"}


def register(sub: Any) -> None:
    """Add ``regress`` to the main parser's subparsers."""
    p = sub.add_parser(
        "regress",
        help="after an upgrade: re-measure the exported configuration and the baseline with "
        "what is installed now, against what the study recorded; STUDY_DIR/regress.json",
    )
    p.add_argument("dir", help="study folder")
    p.add_argument(
        "--trial", type=int, default=None, help="check this trial (default: what export picks)"
    )
    p.add_argument("--runs", type=int, default=3, help="runs of each configuration (default 3)")
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="re-measure the baseline too (default: yes)",
    )
    p.add_argument(
        "--min-change",
        type=float,
        default=5.0,
        metavar="PCT",
        help="the smallest change of a median that counts, in percent (default 5; a capacity's "
        "floor is at least its search's bracket width)",
    )
    p.add_argument("--runner", default="ray", choices=["ray", "local"])
    p.set_defaults(func=cmd_regress)


def cmd_regress(ns: argparse.Namespace) -> int:
    """Exit 0 when no figure moved beyond the noise for the worse, 4 when one did, 3 when a
    configuration could not be measured (every replay invalid: the client could not keep up)."""
    from optimizer.cli_support import console, load_study_dir, make_runner
    from optimizer.regress.workflow import REGRESS_FILE, RegressOptions, run_regress

    options = RegressOptions(
        trial=ns.trial, runs=ns.runs, baseline=ns.baseline, min_change_pct=ns.min_change
    )
    options.check()  # before the study is opened: a bad option fails at once
    folder = Path(ns.dir)
    saved, study = load_study_dir(folder)
    doc = run_regress(
        folder,
        saved,
        study,
        options,
        lambda plan: make_runner(ns.runner, plan, None),
        progress=lambda line: console.print(f"[dim]{escape(line)}[/]"),
    )
    console.print(stack_table(doc))
    for label, conf in doc["configurations"].items():
        console.print(figure_table(label, conf, doc["runs"]))
        for failure in [*conf["failures"], *conf["unscored"]]:
            console.print(f"  [yellow]{label} {escape(failure)}[/]")
    for gain in doc["gain_vs_baseline"]:
        console.print(f"gain over the baseline, {gain['figure']}: {_gain_text(gain)}")
    ok = not doc["regressed"] and doc["measured"]
    console.print(f"[{'bold green' if ok else 'bold red'}]{escape(doc['verdict'])}[/]")
    for line in doc["worse"]:
        console.print(f"  [red]worse:[/] {escape(line)}")
    console.print(f"wrote {folder / REGRESS_FILE}")
    return 4 if doc["regressed"] else (0 if doc["measured"] else 3)


def _gain_text(gain: dict[str, Any]) -> str:
    def pct(v: Any) -> str:
        return "- (from 0)" if v is None else f"{v:+.1f}%"

    return f"study {pct(gain['recorded_pct'])}, now {pct(gain['now_pct'])}"


def stack_table(doc: dict[str, Any]) -> Table:
    """What was installed at the study and what is installed now, a row per item."""
    then, now = doc["installed"]["study"], doc["installed"]["now"]
    table = Table(title="installed")
    for col in ("", "at the study", "now"):
        table.add_column(col)
    keys = list(dict.fromkeys([*then, *now]))
    for key in keys:
        a, b = then.get(key, "not recorded"), now.get(key, "-")
        changed = key in then and a != b
        table.add_row(key, escape(a), f"[bold yellow]{escape(b)}[/]" if changed else escape(b))
    return table


def _num(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:,.4g}"


def _runs(values: list[float]) -> str:
    if len(values) < 2:
        return ""
    return f" ({len(values)} runs {_num(min(values))}..{_num(max(values))})"


def figure_table(label: str, conf: dict[str, Any], runs: int) -> Table:
    """One configuration: figure, recorded, now (median of the runs), change, beyond noise."""
    table = Table(title=f"{label} (trial {conf['trial']}): recorded vs now, median of {runs}")
    for col in ("figure", "recorded", "now", "change", "noise", "beyond the noise?"):
        table.add_column(col, justify="right" if col != "figure" else "left")
    for row in conf["figures"]:
        change = row["change_pct"]
        if change is None and row["recorded"] == 0 and row["now"] is not None:
            change_text = "from 0" if row["now"] else "0"
        else:
            change_text = "-" if change is None else f"{change:+.1f}%"
        noise = row["noise_pct"]
        noise_text = f"±{noise:.1f}%" if noise is not None else f"±{_num(row['noise'])}"
        if row["moved"] == "n/a":
            noise_text = "-"
        table.add_row(
            row["figure"],
            _num(row["recorded"]) + _runs(row["recorded_runs"]),
            _num(row["now"]) + _runs(row["now_runs"]),
            change_text,
            noise_text,
            _moved_cell(row["moved"]),
        )
    slos = conf["slos"]
    met_now = f"{sum(slos['now'])}/{len(slos['now'])} runs" if slos["now"] else "-"
    recorded = {True: "met", False: "missed", None: "-"}[slos["recorded"]]
    table.add_row("SLOs met", recorded, met_now, "", "", _moved_cell(slos["moved"]))
    return table


def _moved_cell(moved: str) -> str:
    text = {"worse": "yes, worse", "better": "yes, better", "within noise": "no"}.get(moved, moved)
    return f"[{_STYLE[moved]}]{text}[/]" if _STYLE.get(moved) else text
