"""Which search finds the best configuration for the least GPU time, against a measured table.

Offline studies: an Optuna sampler (or the tuning guide's one-parameter-at-a-time procedure)
proposes configurations of the table's grid; the table answers each with a draw from that
configuration's measured repeats (``benchmarks/capacity_table.py``). The draw is replayed
through the project's own capacity search (:func:`optimizer.capacity.search.search_capacity`,
racing and the estimate included): a step at scale ``s`` passes when ``s`` is at most the
drawn measurement's capacity, its margin is read off that measurement's recorded steps, and
its seconds are the recorded replay seconds at that scale (replay time goes as 1 / scale; a
step the real search stopped early costs the share of a full step that recorded early stops
took). A trial is charged its recorded server start, the recorded per-step overhead (drain,
prefix-cache reset, warm-up, stop) and its steps: racing and early stops save what they save
on the real machine, no more.

The first trial of every strategy is vLLM's defaults (the table's baseline), as in a real
study; it is the first incumbent for racing. What a strategy "has found" after t hours is the
configuration with its best told capacity; its quality is that configuration's mean over the
table's repeats (the truth), as a share of the table's best mean.

Strategies: ``tpe-racing`` (TPE with racing at the incumbent), ``tpe`` (without racing),
``gp``, ``random``, ``grid`` (every point in a random order), ``one-at-a-time`` (the tuning
guide: memory, then max-num-seqs, then the batched-token budget, then prefix caching, each
value tried with the others fixed at the best so far; max-model-len is not in the grid), and
with ``--warm-from FOLDER`` ``tpe-warm``: ``tpe-racing`` warm-started as a job's ``warm_start``
does it (:mod:`optimizer.warm_start`): the earlier study's 3 best configurations measured first
after the baseline, and its told trials given to TPE as prior observations. The earlier
study's own GPU time is not charged (it was spent before).

Output: a PNG of best-so-far vs GPU-hours (mean over seeds with a 95 % band) and a table:
GPU-hours to reach 90 / 95 / 99 % of the table's best (median over seeds; seeds that never
reached it counted), the gap to the best at half the grid's budget, and the mean GPU time of a
losing trial.

Usage:
    python -m benchmarks.search_efficiency benchmarks/data/capacity_table_cpu.json \
        --seeds 20 --png docs/search_efficiency_cpu.png
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from optimizer.capacity.search import StepOutcome, search_capacity
from optimizer.types import CapacitySettings

STRATEGIES = ("tpe-racing", "tpe", "gp", "random", "grid", "one-at-a-time")
WARM = "tpe-warm"
# The tuning guide's order; each name is a grid param when the table's grid has it.
GUIDE_ORDER = (
    "max-model-len",
    "kv-cache-memory-bytes",
    "gpu-memory-utilization",
    "max-num-seqs",
    "enable-chunked-prefill",
    "max-num-batched-tokens",
    "enable-prefix-caching",
)
_STOPPED_SHARE = 0.5  # a stopped-early step's share of a full one when the table recorded none


@dataclass(frozen=True)
class Measurement:
    """One measured capacity trial of a configuration, from the table."""

    capacity_scale: float
    rps_per_scale: float
    startup_s: float
    steps: tuple[Mapping[str, Any], ...]

    def cost_s(self, step_overhead_s: float) -> float:
        """What this measurement cost with today's search (as recorded)."""
        replay = sum(float(s["replay_s"]) for s in self.steps)
        return self.startup_s + step_overhead_s * (len(self.steps) + 1) + replay


@dataclass
class Table:
    """The grid, each configuration's measurements, the baseline, the truth."""

    grid: dict[str, list[Any]]
    configs: dict[str, list[Measurement]]
    truth: dict[str, float]
    baseline: str
    step_overhead_s: float

    @property
    def best(self) -> float:
        return max(self.truth.values())

    def key(self, params: Mapping[str, Any]) -> str:
        return json.dumps({k: params[k] for k in sorted(self.grid)}, sort_keys=True)

    def full_grid_s(self) -> float:
        """GPU-seconds of measuring every grid point once with today's search (mean draw)."""
        return sum(
            statistics.fmean(m.cost_s(self.step_overhead_s) for m in ms)
            for k, ms in self.configs.items()
            if k != self.baseline
        )


def load_table(doc: Mapping[str, Any], *, partial: bool = False) -> Table:
    """The table from ``capacity_table.py``'s JSON (every grid point measured, unless partial)."""
    configs: dict[str, list[Measurement]] = {}
    truth: dict[str, float] = {}
    grid: dict[str, set[Any]] = {}
    baseline = ""
    overheads: list[float] = []
    for entry in doc["configs"].values():
        ms = entry["measurements"]
        params = entry["params"]
        is_base = any(m["baseline"] for m in ms)
        if not is_base:
            for k, v in params.items():
                grid.setdefault(k, set()).add(json.dumps(v))
        key = "baseline" if is_base else json.dumps(dict(sorted(params.items())), sort_keys=True)
        baseline = "baseline" if is_base else baseline
        configs[key] = [_measurement(m) for m in ms]
        truth[key] = statistics.fmean(m["capacity_rps"] for m in ms)
        for m in ms:
            replay = sum(s["replay_s"] for s in m["steps"])
            overheads.append(
                max(0.0, m["wall_s"] - m["startup_s"] - replay) / (len(m["steps"]) + 1)
            )
    table = Table(
        grid={k: sorted((json.loads(v) for v in vs), key=_order) for k, vs in grid.items()},
        configs=configs,
        truth=truth,
        baseline=baseline,
        step_overhead_s=statistics.median(overheads) if overheads else 0.0,
    )
    missing = math.prod(len(v) for v in table.grid.values()) - (len(configs) - bool(baseline))
    if not baseline or (missing and not partial):
        raise SystemExit(
            f"the table lacks {missing} grid point(s)"
            + ("" if baseline else " and the baseline")
            + ": measure them (or pass --partial, which is not a result)"
        )
    return table


def _order(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, value)


def _measurement(m: Mapping[str, Any]) -> Measurement:
    return Measurement(
        capacity_scale=float(m["capacity_scale"]),
        rps_per_scale=float(m["rps_per_scale"]),
        startup_s=float(m["startup_s"]),
        steps=tuple(m["steps"]),
    )


class TableServer:
    """One drawn measurement answering a capacity search (``measure(scale, attempt)``)."""

    def __init__(self, m: Measurement) -> None:
        self.m = m
        full = [s for s in m.steps if not s["stopped_early"] and s.get("margin") is not None]
        by_scale: dict[float, list[float]] = {}
        for s in full:  # a repeated step: its margins' mean
            by_scale.setdefault(math.log(s["scale"]), []).append(float(s["margin"]))
        self.points = sorted((x, statistics.fmean(ms)) for x, ms in by_scale.items())
        per_unit = [s["replay_s"] * s["scale"] for s in full if s["replay_s"] > 0]
        self.full_unit_s = statistics.median(per_unit) if per_unit else 20.0
        early = [s for s in m.steps if s["stopped_early"] and s["replay_s"] > 0]
        self.early_share = (
            statistics.median(s["replay_s"] * s["scale"] / self.full_unit_s for s in early)
            if early
            else _STOPPED_SHARE
        )
        self.stop_above = min((s["scale"] for s in early), default=math.inf)
        self.seconds = 0.0
        self.steps = 0

    def margin(self, scale: float) -> float:
        """The recorded margins, linear in log scale, extended with the end segments' slopes;
        ``scale / capacity - 1`` where fewer than two scales were measured in full."""
        x, c = math.log(scale), self.m.capacity_scale
        xs, ys = [p[0] for p in self.points], [p[1] for p in self.points]
        if len(set(xs)) < 2:
            return scale / c - 1.0 if c > 0 else 1.0
        if xs[0] <= x <= xs[-1]:
            return float(np.interp(x, xs, ys))
        return _extend(x, xs, ys)

    def __call__(self, scale: float, attempt: int) -> StepOutcome:
        self.steps += 1
        c = self.m.capacity_scale
        passed = c > 0 and scale <= c
        margin = self.margin(scale)
        if passed and not margin <= 0:
            margin = -1e-3
        if not passed and not margin > 0:
            margin = 1e-3
        stopped = not passed and (scale >= self.stop_above or margin > 1.0)
        unit = self.full_unit_s * (self.early_share if stopped else 1.0)
        self.seconds += unit / scale
        return StepOutcome(scale, {"deciding": margin}, stopped_early=stopped)


def _extend(x: float, xs: list[float], ys: list[float]) -> float:
    i = 0 if x < xs[0] else len(xs) - 2
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return ys[i] + slope * (x - xs[i])


@dataclass
class Run:
    """One offline study: (GPU-seconds so far, truth of the found configuration) per trial."""

    curve: list[tuple[float, float]] = field(default_factory=list)
    losing_trial_s: list[float] = field(default_factory=list)
    trials: int = 0


class OfflineStudy:
    """Charges and answers trials from the table; keeps the incumbent and the curve."""

    def __init__(
        self, table: Table, settings: CapacitySettings, racing: bool, rng: random.Random
    ) -> None:
        self.table, self.settings, self.racing, self.rng = table, settings, racing, rng
        self.seconds = 0.0
        self.incumbent_scale = 0.0
        self.best_told = -math.inf
        self.found = table.baseline
        self.run = Run()
        self.measured: dict[str, float | None] = {}
        self.upper_rps = 0.0

    def measure(self, key: str) -> tuple[float | None, bool]:
        """(told capacity req/s, or None when raced out; raced) for one trial of ``key``."""
        m = self.rng.choice(self.table.configs[key])
        server = TableServer(m)
        race = self.incumbent_scale if self.racing and self.incumbent_scale > 0 else None
        result = search_capacity(server, replace(self.settings, race_at=race))
        cost = m.startup_s + self.table.step_overhead_s * (server.steps + 1) + server.seconds
        self.seconds += cost
        est = result.estimate.scale
        told = None if result.raced_out else est * m.rps_per_scale
        # A raced-out trial's capacity lies below the race step: the study reports that bound.
        self.upper_rps = (race or 0.0) * m.rps_per_scale
        if told is None or told <= self.best_told:
            self.run.losing_trial_s.append(cost)
        if told is not None and told > self.best_told:
            self.best_told, self.found = told, key
            self.incumbent_scale = est
        self.measured[key] = told
        self.run.trials += 1
        self.run.curve.append((self.seconds, self.table.truth[self.found]))
        return told, result.raced


@dataclass(frozen=True)
class Warm:
    """An earlier study to warm-start from: its best configurations (table keys, best first)
    and its told trials on the table's grid (prior observations, numbered below zero)."""

    top: tuple[str, ...]
    priors: tuple[Any, ...]


def load_warm(folder: Path, table: Table, job_file: Path, top: int = 3) -> Warm:
    """What ``warm_start: {studies: [folder], top: 3}`` in ``job_file`` (the grid's job) takes
    from an earlier study folder, through the product's own functions, on the table's grid."""
    from optuna.distributions import CategoricalDistribution

    from optimizer.config import WarmStartSection, load_job
    from optimizer.study import _job_space, _with_warm_start, job_objectives

    job, _base = load_job(job_file)
    # The grid's job, as a TPE study warm-started from the folder.
    section = WarmStartSection(studies=[str(folder.resolve())], top=top)
    tpe = job.sampler.model_copy(update={"name": "tpe"})
    job = job.model_copy(update={"warm_start": section, "sampler": tpe})
    space = _job_space(job)
    _job, configs, _notes, priors = _with_warm_start(job, Path("."), space, job_objectives(job))
    dists = {k: CategoricalDistribution(v) for k, v in table.grid.items()}
    on_grid = []
    for p in priors.trials:  # the same points under the table's distributions (choice order)
        t = optuna.trial.create_trial(
            params={k: p.params[k] for k in table.grid}, distributions=dists, values=p.values
        )
        t.number = p.number
        on_grid.append(t)
    return Warm(tuple(table.key(c.args) for c in configs), tuple(on_grid))


def _sampler(
    name: str, table: Table, seed: int, warm: Warm | None = None
) -> optuna.samplers.BaseSampler:
    # TPE and GP as a study runs them (the product's KnowledgeSampler: a warm start's priors;
    # never a held configuration while a free one is left).
    from optimizer.sampling import model_sampler

    if name in ("tpe-racing", "tpe", WARM):
        priors = warm.priors if name == WARM and warm else ()
        return model_sampler("tpe", seed, 4, priors)
    if name == "gp":
        return model_sampler("gp", seed, 4)
    if name == "grid":
        return optuna.samplers.GridSampler(table.grid, seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def run_sampler(
    name: str,
    table: Table,
    settings: CapacitySettings,
    seed: int,
    budget_s: float,
    warm: Warm | None = None,
) -> Run:
    """One offline study of an Optuna sampler until the budget or the grid is spent."""
    if name == WARM and warm is None:
        raise SystemExit(f"{WARM} needs --warm-from FOLDER (an earlier study of this grid)")
    racing = name in ("tpe-racing", WARM)
    study_ = OfflineStudy(table, settings, racing=racing, rng=random.Random(seed))
    study_.measure(table.baseline)
    study = optuna.create_study(direction="maximize", sampler=_sampler(name, table, seed, warm))
    for key in warm.top if name == WARM and warm else ():
        study.enqueue_trial(json.loads(key))
    repeats = 0
    while study_.seconds < budget_s and len(study_.measured) <= len(table.configs) and repeats < 50:
        trial = study.ask()
        params = {k: trial.suggest_categorical(k, v) for k, v in table.grid.items()}
        key = table.key(params)
        if key in study_.measured or key not in table.configs:
            # A real study starts no engine twice for one configuration; a partial table (no
            # result) has points nobody measured.
            repeats += 1
            study.tell(trial, state=TrialState.FAIL)
            continue
        repeats = 0
        told, _raced = study_.measure(key)
        if told is None:
            trial.report(study_.upper_rps, 0)  # as the real driver tells a raced-out trial
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, told)
    return study_.run


def run_one_at_a_time(table: Table, settings: CapacitySettings, seed: int, budget_s: float) -> Run:
    """The tuning guide by hand: one parameter at a time, in its order, from the defaults."""
    study_ = OfflineStudy(table, settings, racing=False, rng=random.Random(seed))
    study_.measure(table.baseline)
    current = {k: _nearest_default(k, v) for k, v in table.grid.items()}
    start_key = table.key(current)
    best = (study_.measure(start_key)[0] or 0.0) if start_key in table.configs else 0.0
    for name in [n for n in GUIDE_ORDER if n in table.grid] + sorted(
        set(table.grid) - set(GUIDE_ORDER)
    ):
        start = dict(current)  # this parameter's values are tried from where it started
        for value in table.grid[name]:
            candidate = {**start, name: value}
            key = table.key(candidate)
            if key in study_.measured or key not in table.configs or study_.seconds >= budget_s:
                continue
            told = study_.measure(key)[0] or 0.0
            if told > best:
                best, current = told, candidate
    return study_.run


_DEFAULTS = {"max-num-seqs": 128, "max-num-batched-tokens": 2048, "enable-prefix-caching": True}


def _nearest_default(name: str, values: list[Any]) -> Any:
    """The grid value closest to vLLM's default (the guide starts from the defaults)."""
    default = _DEFAULTS.get(name)
    if default is None:
        numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        return max(numeric) if numeric else values[0]
    if isinstance(default, bool):
        return default if default in values else values[0]
    return min(values, key=lambda v: abs(math.log(v / default)))


def run_strategy(
    name: str,
    table: Table,
    settings: CapacitySettings,
    seed: int,
    budget_s: float,
    warm: Warm | None = None,
) -> Run:
    if name == "one-at-a-time":
        return run_one_at_a_time(table, settings, seed, budget_s)
    return run_sampler(name, table, settings, seed, budget_s, warm)


def best_at(run: Run, seconds: float, start: float) -> float:
    """The truth of what the run had found after ``seconds`` (``start``: before any trial)."""
    value = start
    for at, truth in run.curve:
        if at > seconds:
            break
        value = truth
    return value


def time_to(run: Run, target: float) -> float:
    """GPU-seconds until the found configuration's truth reached ``target`` (inf: never)."""
    return next((at for at, truth in run.curve if truth >= target), math.inf)


def summarize_runs(
    table: Table, runs: Mapping[str, list[Run]], budget_s: float
) -> list[dict[str, Any]]:
    """A row per strategy: hours to 90/95/99 % of the best, the gap at half the grid's GPU
    time (mean and 95 % interval over seeds), the mean GPU time of a losing trial."""
    best, rows = table.best, []
    start = table.truth[table.baseline]
    for name, rs in runs.items():
        row: dict[str, Any] = {"strategy": name, "seeds": len(rs)}
        for q in (0.90, 0.95, 0.99):
            times = [time_to(r, q * best) for r in rs]
            row[f"h_to_{round(q * 100)}"] = statistics.median(times) / 3600
            row[f"reached_{round(q * 100)}"] = sum(math.isfinite(t) for t in times)
        gaps = [1 - best_at(r, budget_s / 2, start) / best for r in rs]
        row["gap_half"], row["gap_half_ci"] = _mean_ci(gaps)
        losing = [s for r in rs for s in r.losing_trial_s]
        row["losing_trial_s"] = statistics.fmean(losing) if losing else math.nan
        row["trials"] = statistics.fmean(r.trials for r in rs)
        rows.append(row)
    return rows


def _mean_ci(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def curves(
    table: Table, runs: Mapping[str, list[Run]], budget_s: float, points: int = 200
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per strategy: hours, mean share of the best found, its 95 % half-width."""
    xs = np.linspace(0, budget_s, points)
    start = table.truth[table.baseline]
    out = {}
    for name, rs in runs.items():
        shares = np.array([[best_at(r, x, start) / table.best for x in xs] for r in rs])
        half = 1.96 * shares.std(axis=0, ddof=1) / math.sqrt(len(rs)) if len(rs) > 1 else 0 * xs
        out[name] = (xs / 3600, shares.mean(axis=0), half)
    return out


def plot(
    curve: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]], path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, (hours, mean, half) in curve.items():
        ax.plot(hours, 100 * mean, label=name)
        ax.fill_between(hours, 100 * (mean - half), 100 * (mean + half), alpha=0.2)
    for q in (90, 95, 99):
        ax.axhline(q, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("GPU-hours (server-hours on the CPU build), as measured")
    ax.set_ylabel("found configuration's capacity, % of the table's best")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(
    table: Table,
    settings: CapacitySettings,
    strategies: list[str],
    seeds: int,
    budget_s: float,
    progress: Callable[[str], None] = lambda _line: None,
    warm: Warm | None = None,
) -> dict[str, list[Run]]:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    runs: dict[str, list[Run]] = {}
    for name in strategies:
        runs[name] = [
            run_strategy(name, table, settings, seed, budget_s, warm) for seed in range(seeds)
        ]
        progress(f"{name}: {seeds} seeds")
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", type=Path)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--budget", type=float, default=1.0, help="times the grid's GPU time")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the rows and curves here")
    ap.add_argument(
        "--partial", action="store_true", help="allow unmeasured grid points (no result)"
    )
    ap.add_argument("--job", type=Path, default=Path("benchmarks/data/cpu-capacity-grid.yaml"))
    ap.add_argument(
        "--warm-from",
        type=Path,
        default=None,
        help=f"an earlier study folder of this grid, for the {WARM} strategy",
    )
    ns = ap.parse_args(argv)
    table = load_table(json.loads(ns.table.read_text()), partial=ns.partial)
    settings = _settings(ns.job)
    budget = ns.budget * table.full_grid_s()
    warm = load_warm(ns.warm_from, table, ns.job) if ns.warm_from else None
    if warm is not None:
        print(
            f"warm start from {ns.warm_from}: {len(warm.priors)} prior trials, "
            f"{len(warm.top)} configurations enqueued"
        )
    runs = run_all(table, settings, ns.strategies.split(","), ns.seeds, budget, print, warm)
    rows = summarize_runs(table, runs, table.full_grid_s())
    print(
        f"table: {len(table.configs)} configurations; best {table.best:.3g} req/s; "
        f"the grid's GPU time {table.full_grid_s() / 3600:.2f} h"
    )
    print(
        f"{'strategy':>14} {'trials':>6} {'h to 90%':>9} {'h to 95%':>9} {'h to 99%':>9} "
        f"{'gap at half grid':>17} {'losing trial s':>14}"
    )
    for r in rows:
        print(
            f"{r['strategy']:>14} {r['trials']:6.1f} "
            + " ".join(
                f"{r[f'h_to_{q}']:6.2f}{'' if r[f'reached_{q}'] == r['seeds'] else '*':1}  "
                for q in (90, 95, 99)
            )
            + f" {100 * r['gap_half']:7.1f}% ±{100 * r['gap_half_ci']:4.1f}"
            + f" {r['losing_trial_s']:14.0f}"
        )
    print("* some seeds never reached it within the budget (median over all, unreached = inf)")
    print_found_at(table, runs)
    if ns.png:
        plot(curves(table, runs, budget), ns.png, f"{ns.table.name}: {ns.seeds} seeds each")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 0


def found_at(
    table: Table,
    runs: Mapping[str, list[Run]],
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0),
) -> dict[str, list[tuple[float, float]]]:
    """Per strategy and fraction of the grid's GPU time: the found configuration's truth as a
    share of the table's best, mean over seeds and its 95 % half-width."""
    full, start = table.full_grid_s(), table.truth[table.baseline]
    out: dict[str, list[tuple[float, float]]] = {}
    for name, rs in runs.items():
        out[name] = []
        for f in fractions:
            v = [best_at(r, f * full, start) / table.best for r in rs]
            half = 1.96 * statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else math.nan
            out[name].append((statistics.fmean(v), half))
    return out


def print_found_at(table: Table, runs: Mapping[str, list[Run]]) -> None:
    print("found, % of the table's best, at 10 / 25 / 50 / 100 % of the grid's GPU time:")
    for name, cells in found_at(table, runs).items():
        print(f"{name:>14} " + " ".join(f"{100 * m:5.0f} ±{100 * h:3.0f}" for m, h in cells))


def _settings(job: Path) -> CapacitySettings:
    from optimizer.config import load_job

    loaded, _base = load_job(job)
    return loaded.capacity.settings()


if __name__ == "__main__":
    sys.exit(main())
