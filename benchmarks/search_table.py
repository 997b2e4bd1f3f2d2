"""The measured table of the offline search-efficiency benchmark, and the offline study that
replays it (:mod:`benchmarks.search_efficiency` runs the strategies and prints the results).

The table (``benchmarks/capacity_table.py``'s JSON) holds every grid point's measured repeats.
An offline study (:class:`OfflineStudy`) answers a trial of a configuration with a draw from its
repeats, replayed through the project's own capacity search
(:func:`optimizer.capacity.search.search_capacity`, racing and the estimate included): a step at
scale ``s`` passes when ``s`` is at most the drawn measurement's capacity, and its margin is read
off that measurement's recorded steps. A step is charged the replay seconds the table recorded
for a step of its kind (full or stopped early) at that scale: the drawn measurement's, else
another repeat's of the configuration; a scale no repeat recorded (a race step at the
incumbent's scale, mostly) is interpolated between the measurement's recorded steps
(:class:`TableServer`; ``step_seconds="scale"``: the 1 / scale model of the runs before issue
34). A trial is charged its recorded server start, the recorded per-step overhead (drain,
prefix-cache reset, warm-up, stop) and its steps: racing and early stops save what they save on
the real machine. Each measurement carries the symptom the tuning guide read at it
(``capacity_table.py``'s ``symptom``): a told trial's symptom is its drawn measurement's
(:attr:`OfflineStudy.symptoms`), and :meth:`OfflineStudy.baseline_trial` is the measured
baseline as the Optuna study holds it (a param-less trial with its engine arguments), which
:class:`optimizer.guided.GuidedSampler` starts from.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial

from objectives.presets import FAILED_CONSTRAINT
from optimizer.capacity.search import StepOutcome, search_capacity
from optimizer.types import CapacitySettings

STEP_SECONDS = ("recorded", "scale")
# Where a step's seconds came from (TableServer.sources), most faithful first.
SOURCES = ("recorded", "another repeat", "interpolated", "scale model")
_STOPPED_SHARE = 0.5  # a stopped-early step's share of a full one when the table recorded none


@dataclass(frozen=True)
class Measurement:
    """One measured capacity trial of a configuration, from the table."""

    capacity_scale: float
    rps_per_scale: float
    startup_s: float
    steps: tuple[Mapping[str, Any], ...]
    symptom: str | None = None  # what the guide read there (optimizer.guided.SYMPTOMS)

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
    step_seconds: str = "recorded"  # or "scale": the 1 / scale model of earlier runs
    merged: tuple[str, ...] = ()  # grid params whose labels were pooled (--merge)
    baseline_args: dict[str, Any] = field(default_factory=dict)  # its engine arguments
    # Grid labels refused before any server started (an invalid combination): a study is told
    # 0 for them at no GPU time, as the real driver tells a rejected trial.
    refused: frozenset[str] = frozenset()
    # The SLOs the table's job judged on: a refused label, or a step that measured nothing, is
    # told every one violated (FAILED_CONSTRAINT each), as the driver tells it.
    slos: int = 1

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


def load_table(
    doc: Mapping[str, Any],
    *,
    partial: bool = False,
    merge: tuple[str, ...] = (),
    step_seconds: str = "recorded",
) -> Table:
    """The table from ``capacity_table.py``'s JSON (every grid point measured or refused as an
    invalid combination, unless partial).

    ``merge``: grid params whose values are labels of one engine configuration (on the CPU
    build of the first table, ``kv-cache-memory-bytes`` did not act): the configurations that
    differ only in them are one grid point, their measurements pooled as its repeats and its
    truth their mean. ``step_seconds``: how a step is charged (:class:`TableServer`).
    """
    if step_seconds not in STEP_SECONDS:
        raise ValueError(f"step_seconds {step_seconds!r} is not one of {STEP_SECONDS}")
    configs: dict[str, list[Measurement]] = {}
    raw: dict[str, list[Mapping[str, Any]]] = {}
    grid: dict[str, set[Any]] = {}
    baseline = ""
    baseline_args: dict[str, Any] = {}
    overheads: list[float] = []
    for entry in doc["configs"].values():
        ms = entry["measurements"]
        params = {k: v for k, v in entry["params"].items() if k not in merge}
        is_base = any(m["baseline"] for m in ms)
        if not is_base:
            for k, v in params.items():
                grid.setdefault(k, set()).add(json.dumps(v))
        key = "baseline" if is_base else json.dumps(dict(sorted(params.items())), sort_keys=True)
        baseline = "baseline" if is_base else baseline
        baseline_args = dict(entry.get("args") or {}) if is_base else baseline_args
        configs.setdefault(key, []).extend(_measurement(m) for m in ms)
        raw.setdefault(key, []).extend(ms)
        for m in ms:
            replay = sum(s["replay_s"] for s in m["steps"])
            overheads.append(
                max(0.0, m["wall_s"] - m["startup_s"] - replay) / (len(m["steps"]) + 1)
            )
    refused = set()
    for entry in (doc.get("refused") or {}).values():
        params = {k: v for k, v in entry["params"].items() if k not in merge}
        for k, v in params.items():
            grid.setdefault(k, set()).add(json.dumps(v))
        refused.add(json.dumps(dict(sorted(params.items())), sort_keys=True))
    truth = {k: statistics.fmean(m["capacity_rps"] for m in ms) for k, ms in raw.items()}
    table = Table(
        grid={k: sorted((json.loads(v) for v in vs), key=_order) for k, vs in grid.items()},
        configs=configs,
        truth=truth,
        baseline=baseline,
        step_overhead_s=statistics.median(overheads) if overheads else 0.0,
        step_seconds=step_seconds,
        merged=tuple(merge),
        baseline_args=baseline_args,
        refused=frozenset(refused - set(configs)),
    )
    missing = (
        math.prod(len(v) for v in table.grid.values())
        - (len(configs) - bool(baseline))
        - len(table.refused)
    )
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
        symptom=m.get("symptom"),
    )


class TableServer:
    """One drawn measurement answering a capacity search (``measure(scale, attempt)``).

    A step's margin is read off the measurement's recorded steps. Its seconds
    (``step_seconds="recorded"``, the default) are what the table recorded for a step at that
    scale and of that kind (full, or stopped early): the drawn measurement's own step, else one
    of the configuration's other repeats (``repeats``). A step at a scale no repeat recorded
    (a race step at the incumbent's scale, mostly) is interpolated between the measurement's
    recorded steps of its kind, log seconds linear in log scale: as 1 / scale below the lowest
    recorded scale (a slow replay lasts the trace), flat above the highest (a fast one costs its
    requests' own time: the recorded seconds stop falling near x8). Only a kind the measurement
    never recorded falls back to the 1 / scale model. ``step_seconds="scale"`` is that model for
    every step (the runs before issue 34): the median recorded ``replay_s * scale``, over the
    scale, a stopped-early step the share of a full one that recorded early stops took.
    ``sources`` counts where each step's seconds came from (:data:`SOURCES`).
    """

    def __init__(
        self,
        m: Measurement,
        repeats: tuple[Measurement, ...] = (),
        step_seconds: str = "recorded",
    ) -> None:
        self.m = m
        self.step_seconds = step_seconds
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
        self.own = _recorded(m.steps)
        self.others = _recorded(s for r in repeats for s in r.steps)
        exact = {k: math.log(float(s["scale"])) for s in m.steps for k in [_step_key(s)]}
        self.curve = {  # per kind: (log scale, log seconds), a repeated scale's mean
            kind: sorted(
                (exact[(k, x)], math.log(statistics.fmean(v)))
                for (k, x), v in self.own.items()
                if k is kind
            )
            for kind in (False, True)
        }
        self.sources: Counter[str] = Counter()
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

    def step_s(self, scale: float, stopped: bool) -> float:
        """The seconds a step at ``scale`` (stopped early or not) is charged; counts its source."""
        model = self.full_unit_s * (self.early_share if stopped else 1.0) / scale
        if self.step_seconds == "scale":
            self.sources["scale model"] += 1
            return model
        key = (stopped, _log_key(scale))
        for source, records in (("recorded", self.own), ("another repeat", self.others)):
            if key in records:
                self.sources[source] += 1
                return statistics.fmean(records[key])
        curve = self.curve[stopped]
        if not curve:
            self.sources["scale model"] += 1
            return model
        self.sources["interpolated"] += 1
        x = math.log(scale)
        xs, ys = [p[0] for p in curve], [p[1] for p in curve]
        if x < xs[0]:
            return math.exp(ys[0] + xs[0] - x)  # as 1 / scale below the lowest recorded scale
        return math.exp(float(np.interp(x, xs, ys)))  # flat above the highest

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
        self.seconds += self.step_s(scale, stopped)
        return StepOutcome(scale, {"deciding": margin}, stopped_early=stopped)


def _log_key(scale: float) -> float:
    """A step's scale as a lookup key: the search's scales are powers and geometric means of
    the start, recomputed here as in the recorded search up to rounding."""
    return round(math.log(scale), 4)


def _recorded(steps: Any) -> dict[tuple[bool, float], list[float]]:
    """Recorded replay seconds by (stopped early, scale), steps with no seconds left out."""
    out: dict[tuple[bool, float], list[float]] = {}
    for s in steps:
        if float(s["replay_s"]) > 0:
            out.setdefault(_step_key(s), []).append(float(s["replay_s"]))
    return out


def _step_key(step: Mapping[str, Any]) -> tuple[bool, float]:
    return bool(step["stopped_early"]), _log_key(float(step["scale"]))


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
    step_sources: Counter[str] = field(default_factory=Counter)  # where step seconds came from
    curve_keys: list[str] = field(default_factory=list)  # the found configuration per trial
    lower_bounds: int = 0  # told trials whose search ended with no failing step (hi unknown)
    seed: int = -1
    origins: Counter[str] = field(default_factory=Counter)  # measured trials by origin
    refused_held: int = 0  # proposals of a configuration already measured (nothing measured)
    refused_invalid: int = 0  # proposals of a label refused as invalid (told 0, no GPU time)


# Reading a run: what it had found when, and the table's top decile.


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


def found_key_at(run: Run, seconds: float, start: str) -> str:
    """The configuration the run returns after ``seconds`` (``start``: before any trial)."""
    key = start
    for (at, _truth), found in zip(run.curve, run.curve_keys, strict=True):
        if at > seconds:
            break
        key = found
    return key


def top_decile(table: Table, share: float = 0.1) -> set[str]:
    """The grid points in the table's top ``share`` by true mean capacity: the best
    ``ceil(share * points)`` of them, ties at the last one's value included (the baseline, not a
    grid point, never is)."""
    points = sorted((v for k, v in table.truth.items() if k != table.baseline), reverse=True)
    if not points:
        return set()
    cut = points[max(1, math.ceil(share * len(points))) - 1]
    return {k for k, v in table.truth.items() if k != table.baseline and v >= cut}


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics (``statistics.median`` at 0.5);
    inf where it reaches an unreached seed's inf (never nan)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo, frac = math.floor(pos), pos - math.floor(pos)
    if frac == 0:
        return ordered[lo]
    a, b = ordered[lo], ordered[lo + 1]
    return b if math.isinf(b) else a + frac * (b - a)


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
        self.symptoms: dict[str, str | None] = {}  # per measured key: its drawn measurement's
        self.upper_rps = 0.0
        # The last told trial's constraint, as the driver tells a capacity trial
        # (optimizer.capacity.trial.capacity_constraints): <= 0 where some scale passed, else
        # the lowest step's deciding margin (every SLO violated where that step stopped early).
        self.violation = 0.0

    def measure(self, key: str) -> tuple[float | None, bool]:
        """(told capacity req/s, or None when raced out; raced) for one trial of ``key``."""
        ms = self.table.configs[key]
        m = self.rng.choice(ms)
        server = TableServer(m, tuple(r for r in ms if r is not m), self.table.step_seconds)
        race = self.incumbent_scale if self.racing and self.incumbent_scale > 0 else None
        result = search_capacity(server, replace(self.settings, race_at=race))
        cost = m.startup_s + self.table.step_overhead_s * (server.steps + 1) + server.seconds
        self.seconds += cost
        est = result.estimate.scale
        told = None if result.raced_out else est * m.rps_per_scale
        if told is not None and not math.isfinite(result.hi):
            self.run.lower_bounds += 1  # step limit (or x max_scale) before any step failed
        # A raced-out trial's capacity lies below the race step: the study reports that bound.
        self.upper_rps = (race or 0.0) * m.rps_per_scale
        if told is None or told <= self.best_told:
            self.run.losing_trial_s.append(cost)
        if told is not None and told > self.best_told:
            self.best_told, self.found = told, key
            self.incumbent_scale = est
        self.measured[key] = told
        self.symptoms[key] = m.symptom
        self.violation = 0.0
        if result.scale <= 0 and result.steps:
            low = min(result.steps, key=lambda step: step.scale)
            deciding = low.margins.get("deciding", math.inf)
            self.violation = (
                FAILED_CONSTRAINT * self.table.slos
                if low.stopped_early or not math.isfinite(deciding)
                else max(deciding, 1e-3)
            )
        self.run.trials += 1
        self.run.step_sources.update(server.sources)
        self.run.curve.append((self.seconds, self.table.truth[self.found]))
        self.run.curve_keys.append(self.found)
        return told, result.raced

    def baseline_trial(self) -> FrozenTrial:
        """The measured baseline as a real study holds it: a COMPLETE trial that set no param,
        told its capacity, with its engine arguments (``engine_args``, JSON) and its drawn
        measurement's symptom (``symptom``) as user attrs. Model samplers do not see it
        (:class:`optimizer.sampling.KnowledgeSampler` leaves param-less trials out); the guide
        starts from it."""
        key = self.table.baseline
        told = self.measured.get(key)
        if told is None:
            raise ValueError("the baseline has not been measured (or was raced out)")
        return optuna.trial.create_trial(
            value=told,
            user_attrs={
                "engine_args": json.dumps(self.table.baseline_args, sort_keys=True),
                "symptom": self.symptoms.get(key),
                "baseline": True,
                "status": "complete",
            },
        )
