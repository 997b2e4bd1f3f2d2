"""``vllm-autotune spec-sweep STUDY_DIR``: the break-even acceptance of speculative decoding."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

__all__ = ["register"]


def _lengths(text: str) -> list[float]:
    try:
        values = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: give lengths like 1,1.5,2,2.5,3") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: acceptance lengths are >= 1 (1 = no draft token accepted)"
        )
    return values


def register(sub: Any) -> None:
    """Add ``spec-sweep`` to the main parser's subparsers."""
    p = sub.add_parser(
        "spec-sweep",
        help="re-measure a configuration with speculative decoding at several acceptance "
        "lengths and with speculation off: the break-even length; STUDY_DIR/spec_sweep.json",
    )
    p.add_argument("dir", help="study folder")
    p.add_argument(
        "--trial", type=int, default=None, help="this trial (default: what export picks)"
    )
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=[1.0, 1.5, 2.0, 2.5, 3.0],
        help="acceptance lengths to measure, comma-separated (default 1,1.5,2,2.5,3)",
    )
    p.add_argument("--runner", default="ray", choices=["ray", "local"])
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="measure every row again, even one whose exact engine arguments a trial of the "
        "study ran (by default that trial is the row: no server start)",
    )
    p.set_defaults(func=cmd_spec_sweep)


def cmd_spec_sweep(ns: argparse.Namespace) -> int:
    """Exit 0 with the sweep's table, 3 when speculation off or every length went unmeasured."""
    from optimizer.cli_support import console, load_study_dir, make_runner
    from optimizer.speculation.sweep import SWEEP_FILE, run_sweep

    folder = Path(ns.dir)
    saved, study = load_study_dir(folder)
    doc = run_sweep(
        folder,
        saved,
        study,
        ns.lengths,
        lambda plan: make_runner(ns.runner, plan, None),
        trial=ns.trial,
        progress=lambda line: console.print(f"[dim]{escape(line)}[/]"),
        reuse=not ns.remeasure,
    )
    console.print(sweep_table(doc))
    console.print(escape(doc["answer"]))
    console.print(f"wrote {folder / SWEEP_FILE}")
    rows = doc["rows"]
    measured = rows[0][doc["figure"]] is not None and any(r[doc["figure"]] for r in rows[1:])
    return 0 if measured else 3


def sweep_table(doc: dict[str, Any]) -> Table:
    """One row per run: the acceptance length, the figure, P95 TPOT, the status, and where it
    was measured (now, or the study's trial with the same engine arguments)."""
    figure = doc["figure"]
    table = Table(title=f"speculative decoding of trial {doc['trial']}: {figure} by acceptance")
    for column in ("acceptance length", figure, _tpot_column(figure), "status", "measured"):
        table.add_column(
            column, justify="right" if column not in ("status", "measured") else "left"
        )
    for row in doc["rows"]:
        length = row["acceptance_length"]
        table.add_row(
            "off" if length is None else f"{length:g}",
            _num(row[figure]),
            _num(row["p95_tpot_ms"]),
            escape(str(row["status"])),
            "now"
            if row.get("reused_trial") is None
            else f"in the study, trial {row['reused_trial']}",
        )
    return table


def _num(value: Any) -> str:
    return (
        "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"
    )


def _tpot_column(figure: str) -> str:
    return "P95 TPOT ms (nominal load)" if figure == "capacity_rps" else "P95 TPOT ms"
