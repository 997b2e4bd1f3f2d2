"""What a window's pre-roll sends, offline: cold, the stretch back to the window's oldest prefix
reference (the default until issue 34) and the warm set (today's default), for windows of a
trace. No server: request and token counts, and the window's prefix reuse an unbounded cache
would give (the same for the stretch and the warm set when the warm set is complete).

Usage:
    python benchmarks/preroll_offline.py TRACE [--window-s 30] [--at 0.5,0.75]
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from optimizer.types import Trace
from optimizer.workload.formats import read_trace
from optimizer.workload.shaping import covering_preroll_s, preroll, preroll_trace
from optimizer.workload.stats import prefix_reuse_ratio


def rows(trace: Trace, start_s: float, end_s: float) -> list[dict[str, Any]]:
    """One row per kind of pre-roll for the window ``[start_s, end_s)``."""
    window, _ = preroll(trace, start_s, end_s, preroll_s=0)
    covered = covering_preroll_s(trace, start_s, end_s)
    stretch, _ = preroll(trace, start_s, end_s, preroll_s=covered)
    warm, _ = preroll(trace, start_s, end_s)
    out = []
    for kind, shaped in (
        ("none (cold)", window),
        (f"stretch ({covered:.0f} s)", stretch),
        ("warm set", warm),
    ):
        sent = preroll_trace(shaped)
        out.append(
            {
                "window": f"[{start_s:.0f}, {end_s:.0f})",
                "window_requests": len(window),
                "kind": kind,
                "requests_sent": len(sent),
                "tokens_sent": sum(r.input_tokens for r in sent.requests),
                "window_reuse": prefix_reuse_ratio(window, shaped.preroll),
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--at", default="0.5,0.75", help="window starts, as fractions of the trace")
    ns = ap.parse_args()
    trace, _ = read_trace(ns.trace)
    span = trace.requests[-1].arrival_s
    table = Table(title=f"{ns.trace}: {len(trace)} requests over {span:.0f} s")
    for col in ("window", "requests", "pre-roll", "requests sent", "tokens sent", "reuse"):
        table.add_column(col, justify="left" if col == "pre-roll" else "right")
    for at in (float(x) for x in ns.at.split(",")):
        for r in rows(trace, at * span, at * span + ns.window_s):
            table.add_row(
                r["window"],
                str(r["window_requests"]),
                r["kind"],
                f"{r['requests_sent']:,}",
                f"{r['tokens_sent']:,}",
                f"{r['window_reuse']:.1%}",
            )
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
