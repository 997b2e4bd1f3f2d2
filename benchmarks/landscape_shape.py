"""The shape of a measured landscape: how peaked it is, how noisy, and whether its best joint
configuration is the best of each parameter alone (issue 41, item 2: a sampler has room where
the median configuration carries at most 60-70 % of the best, the noise is near 5 % and the
parameters interact).

    python -m benchmarks.landscape_shape benchmarks/data/capacity_table_cpu_v2.json \\
        benchmarks/data/capacity_table_cpu_v3.json

reads tables of ``capacity_table.py`` (through :func:`benchmarks.search_table.load_table`) and
prints one column per table:

- the grid: its parameters and values, the points measured and the labels refused before a
  server started (an invalid combination);
- the best point's capacity (the mean of its repeats) and the baseline's (vLLM's defaults);
- how peaked: the median point over the best (measured points; and over every label, a refused
  one counted 0), and how many points reach 95 % of the best;
- the noise: the median coefficient of variation (sample standard deviation over mean) of the
  points measured more than once, and how many those are;
- the parameters alone: each parameter's value of the highest mean capacity over the measured
  points that have it (its main effect), these values put together, and that configuration's
  capacity and rank; the parameters whose value there differs from the best point's.

With ``--agree`` (two tables of one grid, e.g. one measured on another kind of machine, or a part
of the grid measured again) it also prints how far the second agrees with the first on the
points both measured: Spearman's rank correlation of their capacities, the median ratio (second
over first) and how many of the first's top decile of those points are in the second's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.search_table import Table, load_table

__all__ = ["Agreement", "Shape", "agreement", "main", "shape_of"]


@dataclass(frozen=True)
class Shape:
    """What :func:`shape_of` reads off one table (see the module docstring)."""

    grid: dict[str, list[Any]]
    points: int
    refused: int
    best_rps: float
    best: dict[str, Any]
    baseline_rps: float
    median_over_best: float
    median_over_best_all: float
    near_best: int
    repeated: int
    median_cv: float | None
    alone: dict[str, Any]
    alone_rps: float | None  # None: that combination is refused (or was not measured)
    alone_rank: int | None  # 1: the best point
    differs: list[str]


def shape_of(table: Table, near: float = 0.95) -> Shape:
    """The shape of ``table`` (see the module docstring); ``near``: the share of the best a point
    must reach to count as near it."""
    points = {k: v for k, v in table.truth.items() if k != table.baseline}
    if not points:
        raise SystemExit("the table has no measured grid point")
    best_key = max(points, key=lambda k: points[k])
    best = points[best_key]
    ordered = sorted(points.values(), reverse=True)
    every = list(points.values()) + [0.0] * len(table.refused)
    cvs = []
    for key in points:
        caps = [m.capacity_scale * m.rps_per_scale for m in table.configs[key]]
        if len(caps) > 1 and statistics.fmean(caps) > 0:
            cvs.append(statistics.stdev(caps) / statistics.fmean(caps))
    params = {k: json.loads(k) for k in points}
    alone = {}
    for name, values in table.grid.items():
        means = {}
        for value in values:
            have = [points[k] for k, p in params.items() if p[name] == value]
            if have:
                means[json.dumps(value)] = statistics.fmean(have)
        alone[name] = json.loads(max(means, key=lambda v: means[v]))
    alone_key = table.key(alone)
    alone_rps = points.get(alone_key)
    best_params = params[best_key]
    return Shape(
        grid=table.grid,
        points=len(points),
        refused=len(table.refused),
        best_rps=best,
        best=best_params,
        baseline_rps=table.truth.get(table.baseline, float("nan")),
        median_over_best=statistics.median(points.values()) / best if best else float("nan"),
        median_over_best_all=statistics.median(every) / best if best else float("nan"),
        near_best=sum(1 for v in points.values() if v >= near * best),
        repeated=len(cvs),
        median_cv=statistics.median(cvs) if cvs else None,
        alone=alone,
        alone_rps=alone_rps,
        alone_rank=None if alone_rps is None else 1 + sum(1 for v in ordered if v > alone_rps),
        differs=[n for n in table.grid if alone[n] != best_params[n]],
    )


@dataclass(frozen=True)
class Agreement:
    """How far a second table agrees with a first on the points both measured."""

    common: int
    spearman: float
    median_ratio: float  # second over first
    top: int  # the first's top decile of the common points (at least one point)
    top_shared: int  # how many of those are in the second's top decile


def agreement(first: Table, second: Table) -> Agreement:
    """The second table against the first on the grid points both measured (baselines apart)."""
    from scipy.stats import spearmanr

    common = sorted(
        k for k in first.truth if k in second.truth and first.baseline != k != second.baseline
    )
    if len(common) < 3:
        raise SystemExit(
            f"the tables share {len(common)} measured grid points: too few to compare "
            "(two tables of one grid, --merge alike?)"
        )
    a = [first.truth[k] for k in common]
    b = [second.truth[k] for k in common]
    top = max(1, round(len(common) / 10))
    by_a = set(sorted(common, key=first.truth.__getitem__, reverse=True)[:top])
    by_b = set(sorted(common, key=second.truth.__getitem__, reverse=True)[:top])
    ratios = [y / x for x, y in zip(a, b, strict=True) if x > 0]
    return Agreement(
        common=len(common),
        spearman=float(spearmanr(a, b).statistic),
        median_ratio=statistics.median(ratios) if ratios else float("nan"),
        top=top,
        top_shared=len(by_a & by_b),
    )


def _short(params: Mapping[str, Any]) -> str:
    names = {
        "max-num-seqs": "seqs",
        "max-num-batched-tokens": "budget",
        "enable-chunked-prefill": "chunked",
        "enable-prefix-caching": "prefix",
        "block-size": "block",
        "kv-cache-memory-bytes": "KV MiB",
    }
    out = []
    for k, v in params.items():
        if k == "kv-cache-memory-bytes" and isinstance(v, int):
            v = v // 2**20
        out.append(f"{names.get(k, k)} {json.dumps(v)}")
    return ", ".join(out)


def render(names: Sequence[str], shapes: Sequence[Shape]) -> str:
    """The shapes side by side, one row per reading."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f} %"

    rows: list[tuple[str, list[str]]] = [
        ("parameters (values)", [
            ", ".join(f"{k} {len(v)}" for k, v in s.grid.items()) for s in shapes
        ]),
        ("points measured", [str(s.points) for s in shapes]),
        ("labels refused", [str(s.refused) for s in shapes]),
        ("best, req/s", [f"{s.best_rps:.2f}" for s in shapes]),
        ("best point", [_short(s.best) for s in shapes]),
        ("baseline, req/s", [f"{s.baseline_rps:.2f}" for s in shapes]),
        ("median / best", [pct(s.median_over_best) for s in shapes]),
        ("median / best, refused as 0", [pct(s.median_over_best_all) for s in shapes]),
        ("points at 95 % of the best", [str(s.near_best) for s in shapes]),
        ("points repeated", [str(s.repeated) for s in shapes]),
        ("median CV of repeats", [pct(s.median_cv) for s in shapes]),
        ("each parameter's best alone", [_short(s.alone) for s in shapes]),
        ("  its capacity, req/s", [
            "refused" if s.alone_rps is None else f"{s.alone_rps:.2f}" for s in shapes
        ]),
        ("  its rank", ["-" if s.alone_rank is None else str(s.alone_rank) for s in shapes]),
        ("  differs from the best in", [", ".join(s.differs) or "nothing" for s in shapes]),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    lines = [" " * width + " | " + " | ".join(names)]
    for label, cells in rows:
        lines.append(f"{label:<{width}} | " + " | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="+", type=Path, help="capacity_table.py's JSON files")
    ap.add_argument(
        "--merge",
        default="",
        help="grid params pooled into one point, as search_efficiency.py's --merge",
    )
    ap.add_argument("--partial", action="store_true", help="allow unmeasured grid points")
    ap.add_argument("--json", type=Path, default=None, help="write the shapes here")
    ap.add_argument(
        "--agree",
        action="store_true",
        help="two tables of one grid: how far the second agrees with the first (module doc)",
    )
    ns = ap.parse_args(argv)
    if ns.agree and len(ns.tables) != 2:
        raise SystemExit("--agree compares two tables: give exactly two")
    merge = tuple(m for m in ns.merge.split(",") if m)
    tables = []
    for path in ns.tables:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"{path}: {exc}") from exc
        tables.append(load_table(doc, partial=ns.partial, merge=merge))
    shapes = [shape_of(t) for t in tables]
    names = [p.stem for p in ns.tables]
    print(render(names, shapes))
    if ns.agree:
        ag = agreement(tables[0], tables[1])
        print(
            f"\n{names[1]} against {names[0]} on the {ag.common} points both measured: "
            f"Spearman {ag.spearman:.2f}, median ratio {ag.median_ratio:.2f}, "
            f"{ag.top_shared} of the first's top {ag.top} in the second's top {ag.top}"
        )
    if ns.json:
        ns.json.write_text(
            json.dumps({n: asdict(s) for n, s in zip(names, shapes, strict=True)}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
