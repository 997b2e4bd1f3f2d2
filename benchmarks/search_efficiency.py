"""Which search finds the best configuration for the least GPU time, against a measured table.

Offline studies: an Optuna sampler (or the tuning guide's one-parameter-at-a-time procedure)
proposes configurations of the table's grid; the table answers each with a draw from that
configuration's measured repeats, replayed through the project's own capacity search and charged
the GPU time the table recorded (:mod:`benchmarks.search_table`: the table, its server and the
offline study; ``--step-seconds scale``: the 1 / scale model of the runs before issue 34). The
output says how many steps' seconds came from where.

The first trial of every strategy is vLLM's defaults (the table's baseline), as in a real
study; it is the first incumbent for racing, and the Optuna study holds it as the driver does (a
param-less trial with its engine arguments: model samplers leave it out, the guide starts from
it). Every told trial carries its drawn measurement's symptom (``symptom``), which the guide
reads. What a strategy "has found" (returns) after t hours
is the configuration with its best told capacity; its quality is that configuration's mean over
the table's repeats (the truth), as a share of the table's best mean.

Strategies: ``rf-racing`` (SMAC's random forest, :class:`optimizer.rf_sampler.RFSampler`, with
racing at the incumbent: the tuner's default), ``tpe-racing`` (TPE, racing), ``random-racing``
(Optuna's random sampler through the same path, racing included: what racing gives without a
model), ``tpe2-racing`` (TPE after 2 random startup trials, not 4), ``gp-racing`` (GP, racing),
``guided`` (:class:`optimizer.guided.GuidedSampler`: the guide's one-parameter moves from the
incumbent by its symptom while it has one, TPE otherwise; racing), ``tpe-guided`` (TPE whose 4
startup trials are the guide's moves, a job's ``sampler.startup: guided``; racing),
``rf-guided`` (the same with the forest behind the guide: the default sampler with ``startup:
guided``; racing), ``tpe``
(without racing), ``gp``, ``random``, ``grid`` (every point once, in a random order),
``one-at-a-time`` (the tuning guide by hand: memory, then max-num-seqs, then the batched-token
budget, then prefix caching, each value tried with the others fixed at the best so far;
max-model-len is not in the grid), and with ``--warm-from FOLDER`` ``tpe-warm``: ``tpe-racing``
warm-started as a job's ``warm_start`` does it (:mod:`optimizer.warm_start`): the earlier
study's 3 best configurations measured first after the baseline, and its told trials given to
TPE as prior observations. The earlier study's own GPU time is not charged (it was spent
before).

``--merge PARAM``: the configurations that differ only in PARAM are one grid point, their
measurements pooled (on the first CPU table ``kv-cache-memory-bytes`` did not act: 36 labels,
18 engine configurations, and a "best" that rests on one draw of one label).

Output: a PNG of best-so-far vs GPU-hours (mean over seeds with a 95 % band); a table of
GPU-hours to reach 90 / 95 / 99 % of the table's best (median over seeds; seeds that never
reached it counted), the gap to the best at half the grid's budget, and the mean GPU time of a
losing trial; the share of the best found at 10 / 25 / 50 / 100 % of the grid's time; and per
seed set (``--seed-sets 0-19,20-39``: disjoint sets, each a replication, then all together) the
share of the best at 25 / 50 / 100 %, the seeds whose returned configuration is in the table's
top decile by true mean, the returned configuration's true mean capacity, the seeds that reached
the best and the median time to it, the time to 95 % of the best (median and 25-75 % band),
losers' GPU time and the told values that were lower bounds
(the search ended before any step failed); then the differences between strategies per seed set,
paired by seed (:func:`differences`: fixed pairs, and every strategy minus ``random-racing``);
and per strategy its trials by the origin of their proposal (the model's own, its acquisition in
place of a held configuration, a random fallback, the sampler's startup draws:
:class:`optimizer.sampling.KnowledgeSampler`'s ``origins``; the guide's moves; a strategy
without a model, its own draws) and its proposals refused as held (:func:`print_origins`).

``--jobs N`` runs N offline studies at once (worker processes; the same runs as one at a time);
``--runs-dir DIR`` keeps every finished run in DIR and reads it back on the next call with the
same table, settings and budget, so a long call that was stopped resumes (clear DIR after
changing the code).

Usage:
    python -m benchmarks.search_efficiency benchmarks/data/capacity_table_cpu.json \
        --seed-sets 0-19,20-39 --strategies tpe-racing,random-racing,random,tpe
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from benchmarks.search_table import (
    SOURCES,
    STEP_SECONDS,
    OfflineStudy,
    Run,
    Table,
    best_at,
    found_key_at,
    load_table,
    quantile,
    time_to,
    top_decile,
)
from objectives.presets import FAILED_CONSTRAINT
from optimizer.types import CapacitySettings

STRATEGIES = (
    "tpe-racing",
    "random-racing",
    "tpe2-racing",
    "gp-racing",
    "rf-racing",
    "guided",
    "tpe-guided",
    "rf-guided",
    "tpe",
    "gp",
    "random",
    "grid",
    "one-at-a-time",
)
WARM = "tpe-warm"
# optimizer.guided.GuidedSampler in front of TPE (of the forest: rf-guided)
GUIDED = ("guided", "tpe-guided", "rf-guided")
# The strategies that race the incumbent.
RACING = ("tpe-racing", "random-racing", "tpe2-racing", "gp-racing", "rf-racing", *GUIDED, WARM)
# Proposals of a model (KnowledgeSampler) or of the guide: counted by their origin.
MODEL_STRATEGIES = (
    "tpe-racing",
    "tpe2-racing",
    "gp-racing",
    "rf-racing",
    "tpe",
    "gp",
    *GUIDED,
    WARM,
)
# A measured trial's origin (Run.origins): the sampler's (optimizer.sampling.KnowledgeSampler's
# origins, GuidedSampler's guided), "own" (a strategy without a model), the baseline, a warm
# start's enqueued ones.
ORIGINS = ("model", "own", "guided", "acquisition", "random", "startup", "baseline", "enqueued")
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


@dataclass(frozen=True)
class Warm:
    """An earlier study to warm-start from: its best configurations (table keys, best first)
    and its told trials on the table's grid (prior observations, numbered below zero)."""

    top: tuple[str, ...]
    priors: tuple[Any, ...]


def load_warm(folder: Path, table: Table, job_file: Path, top: int = 3) -> Warm:
    """What ``warm_start: {studies: [folder], top: 3}`` in ``job_file`` (the grid's job) takes
    from an earlier study folder, through the product's own functions, on the table's grid."""
    from optuna.distributions import BaseDistribution, CategoricalDistribution

    from optimizer.config import WarmStartSection, load_job
    from optimizer.study import _job_space, _with_warm_start, job_objectives

    job, _base = load_job(job_file)
    # The grid's job, as a TPE study warm-started from the folder.
    section = WarmStartSection(studies=[str(folder.resolve())], top=top)
    tpe = job.sampler.model_copy(update={"name": "tpe"})
    job = job.model_copy(update={"warm_start": section, "sampler": tpe})
    space = _job_space(job)
    _job, configs, _notes, priors = _with_warm_start(job, Path("."), space, job_objectives(job))
    dists: dict[str, BaseDistribution] = {
        k: CategoricalDistribution(v) for k, v in table.grid.items()
    }
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
    # never a held configuration while a free one is left); the guide as a study runs it
    # (sampler "guided", or startup "guided": its first 4 trials the guide's).
    from optuna.distributions import CategoricalDistribution

    from optimizer.guided import GuidedSampler
    from optimizer.sampling import model_sampler

    if name in ("tpe-racing", "tpe", WARM):
        priors = warm.priors if name == WARM and warm else ()
        return model_sampler("tpe", seed, 4, priors)
    if name == "tpe2-racing":
        return model_sampler("tpe", seed, 2)
    if name in ("gp", "gp-racing"):
        return model_sampler("gp", seed, 4)
    if name in GUIDED:  # as optimizer.study_sampler.job_sampler wraps a model
        space = {k: CategoricalDistribution(v) for k, v in table.grid.items()}
        cap = None if name == "guided" else 4
        fallback = _rf(seed) if name == "rf-guided" else model_sampler("tpe", seed, 4)
        return GuidedSampler(space, fallback, max_guided=cap, symptom=_told_symptom)
    if name == "rf-racing":  # SMAC's random forest (optimizer.rf_sampler), as the tuner's default
        return _rf(seed)
    if name in ("random", "random-racing"):
        return optuna.samplers.RandomSampler(seed=seed)
    raise SystemExit(f"unknown strategy {name!r}: one of {', '.join((*STRATEGIES, WARM))}")


def _rf(seed: int) -> optuna.samplers.BaseSampler:
    from optimizer.rf_sampler import RFSampler

    return RFSampler(seed=seed, n_startup_trials=4)


def _told_symptom(trial: optuna.trial.FrozenTrial) -> str | None:
    """The symptom the table recorded for a told trial's drawn measurement (the offline study
    sets it on every measured trial and on the baseline)."""
    symptom = trial.user_attrs.get("symptom")
    return str(symptom) if symptom is not None else None


def _origin_counts(sampler: optuna.samplers.BaseSampler) -> Counter[str] | None:
    """The sampler's proposals so far by origin: a KnowledgeSampler's ``origins``; a
    GuidedSampler's guided proposals (``guided``) and its fallback's; None: it counts none."""
    from optimizer.guided import GuidedSampler

    if isinstance(sampler, GuidedSampler):
        inner = _origin_counts(sampler.fallback) or Counter()
        return inner + Counter({"guided": sampler.guided})
    origins: Counter[str] | None = getattr(sampler, "origins", None)
    return Counter(origins) if origins is not None else None


def run_sampler(
    name: str,
    table: Table,
    settings: CapacitySettings,
    seed: int,
    budget_s: float,
    warm: Warm | None = None,
) -> Run:
    """One offline study of an Optuna sampler until the budget or the grid is spent. Each
    measured trial is counted by its proposal's origin (:func:`_origin`), each proposal of a
    configuration the study has measured (refused: nothing measured) in ``refused_held``, each
    proposal of a label the table refused as invalid (told 0 at no cost, as the real driver
    does) in ``refused_invalid``."""
    if name == WARM and warm is None:
        raise SystemExit(f"{WARM} needs --warm-from FOLDER (an earlier study of this grid)")
    racing = name in RACING  # random-racing: the random sampler through the same path
    study_ = _begin(table, settings, seed, racing)
    sampler = _sampler(name, table, seed, warm)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.add_trial(study_.baseline_trial())  # measured first, as the driver's baseline
    enqueued = list(warm.top) if name == WARM and warm else []
    for key in enqueued:
        study.enqueue_trial(json.loads(key))
    repeats = asked = 0
    # measured holds the baseline, one of table.configs: all measured ends the study.
    while study_.seconds < budget_s and len(study_.measured) < len(table.configs) and repeats < 50:
        before = _origin_counts(sampler)
        trial = study.ask()
        params = {k: trial.suggest_categorical(k, v) for k, v in table.grid.items()}
        after = _origin_counts(sampler)
        origin = "enqueued" if asked < len(enqueued) else _origin(name, after, before)
        asked += 1
        key = table.key(params)
        if key in table.refused:
            # The real driver starts no server for an invalid combination and tells it the
            # worst value (capacity 0) with every SLO violated: it costs no GPU time, TPE and
            # GP read it as infeasible, and the sampler holds it.
            study_.run.refused_invalid += 1
            trial.set_user_attr("status", "rejected")
            trial.set_constraint(_CONSTRAINT, FAILED_CONSTRAINT * table.slos)
            study.tell(trial, 0.0)
            continue
        if key in study_.measured or key not in table.configs:
            # A real study starts no engine twice for one configuration; a partial table (no
            # result) has points nobody measured.
            study_.run.refused_held += key in study_.measured
            repeats += 1
            study.tell(trial, state=TrialState.FAIL)
            continue
        repeats = 0
        study_.run.origins[origin] += 1
        told, _raced = study_.measure(key)
        trial.set_user_attr("symptom", study_.symptoms[key])  # what the guide reads
        if told is None:
            trial.report(study_.upper_rps, 0)  # as the real driver tells a raced-out trial
            study.tell(trial, state=TrialState.PRUNED)
        else:
            # As the driver: feasible where some scale passed, else the lowest step's margin.
            trial.set_constraint(_CONSTRAINT, study_.violation)
            study.tell(trial, told)
    return study_.run


# The offline study's one constraint: the sum of the driver's per-SLO constraints where it is
# known (a refused label, a step that measured nothing), else the deciding SLO's margin (the
# table keeps only that one: TPE ranks infeasible trials by the sum of their violations).
_CONSTRAINT = "slos"


def _begin(table: Table, settings: CapacitySettings, seed: int, racing: bool) -> OfflineStudy:
    """An offline study of the seed with its first trial measured: the baseline."""
    study_ = OfflineStudy(table, settings, racing=racing, rng=random.Random(seed))
    study_.run.seed = seed
    study_.measure(table.baseline)
    study_.run.origins["baseline"] += 1
    return study_


def _origin(name: str, origins: Counter[str] | None, before: Counter[str] | None) -> str:
    """The origin of the proposal just asked: the one key the sampler's origin counts
    (:func:`_origin_counts`) gained; ``own`` for a strategy without a
    model (its own draw); ``unattributed`` where a model's sampler counts none (or several)."""
    if name not in MODEL_STRATEGIES:
        return "own"
    if origins is None or before is None:
        return "unattributed"
    gained = origins - before
    return next(iter(gained)) if sum(gained.values()) == 1 else "unattributed"


def run_grid(table: Table, settings: CapacitySettings, seed: int, budget_s: float) -> Run:
    """Every grid point once, in a random order of the seed, until the budget or the grid is
    spent. Not Optuna's GridSampler: it stops the study when the grid is spent, which works
    only inside ``study.optimize`` (this benchmark asks and tells by hand)."""
    study_ = _begin(table, settings, seed, racing=False)
    order = sorted(k for k in table.configs if k != table.baseline)
    random.Random(f"grid order {seed}").shuffle(order)  # not the draws' stream
    for key in order:
        if study_.seconds >= budget_s:
            break
        study_.measure(key)
        study_.run.origins["own"] += 1
    return study_.run


def run_one_at_a_time(table: Table, settings: CapacitySettings, seed: int, budget_s: float) -> Run:
    """The tuning guide by hand: one parameter at a time, in its order, from the defaults."""
    study_ = _begin(table, settings, seed, racing=False)
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
    study_.run.origins["own"] += study_.run.trials - 1  # every trial after the baseline
    return study_.run


_DEFAULTS = {
    "max-num-seqs": 128,
    "max-num-batched-tokens": 2048,
    "enable-prefix-caching": True,
    "enable-chunked-prefill": True,
}


def _nearest_default(name: str, values: list[Any]) -> Any:
    """The grid value closest to vLLM's default (the guide starts from the defaults)."""
    default = _DEFAULTS.get(name)
    if default is None:
        numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        return max(numeric) if numeric else values[0]
    if isinstance(default, bool):
        return default if default in values else values[0]
    # A tie (1,024 and 4,096 around 2,048) goes to the larger: a budget under the context
    # with chunked prefill off is refused.
    return min(values, key=lambda v: (round(abs(math.log(v / default)), 9), -v))


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
    if name == "grid":
        return run_grid(table, settings, seed, budget_s)
    return run_sampler(name, table, settings, seed, budget_s, warm)


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
    seeds: int | Sequence[int],
    budget_s: float,
    progress: Callable[[str], None] = lambda _line: None,
    warm: Warm | None = None,
    *,
    jobs: int = 1,
    cache: RunCache | None = None,
) -> dict[str, list[Run]]:
    """Every strategy, one offline study per seed (``seeds``: a count from 0, or the seeds).

    ``jobs``: offline studies run at once, in worker processes (each study is one seed's, so the
    runs are the same as one after the other). ``cache``: each finished run is written there as
    it ends and read back instead of run again (a long run resumes where it stopped)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    done: dict[tuple[str, int], Run] = {}
    todo: list[tuple[str, int]] = []
    for name in strategies:
        for seed in seed_list:
            cached = cache.get(name, seed) if cache is not None else None
            if cached is not None:
                done[(name, seed)] = cached
            else:
                todo.append((name, seed))
    if cache is not None and done:
        progress(f"{len(done)} runs read from {cache.folder}, {len(todo)} to run")
    left = Counter(name for name, _ in todo)

    def finished(name: str, seed: int, run: Run) -> None:
        done[(name, seed)] = run
        if cache is not None:
            cache.put(name, seed, run)
        left[name] -= 1
        if left[name] == 0:
            progress(f"{name}: {len(seed_list)} seeds")

    if jobs <= 1 or len(todo) <= 1:
        for name, seed in todo:
            finished(name, seed, run_strategy(name, table, settings, seed, budget_s, warm))
    else:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {
                pool.submit(_run_quietly, name, table, settings, seed, budget_s, warm): (name, seed)
                for name, seed in todo
            }
            try:
                for future in as_completed(futures):
                    finished(*futures[future], future.result())
            except BaseException:
                # A failed run (or ^C) ends the call: the queued runs are not started, and the
                # finished ones are kept in the cache already.
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    return {name: [done[(name, seed)] for seed in seed_list] for name in strategies}


def _run_quietly(
    name: str,
    table: Table,
    settings: CapacitySettings,
    seed: int,
    budget_s: float,
    warm: Warm | None,
) -> Run:
    """:func:`run_strategy` in a worker process (Optuna's log silenced there too)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return run_strategy(name, table, settings, seed, budget_s, warm)


def _warm_digest(warm: Warm | None) -> str | None:
    """A digest of a warm start's enqueued configurations and prior trials (None: no warm
    start)."""
    if warm is None:
        return None
    priors = [(t.params, t.values, t.state.name) for t in warm.priors]
    text = json.dumps([list(warm.top), priors], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class RunCache:
    """Finished offline runs in a folder, one JSON file per strategy and seed, valid for one
    table, search settings and budget (``identity``): a run made for another is not read.

    The runs depend on the code too: clear the folder after changing a strategy or the
    offline study."""

    def __init__(self, folder: Path, identity: Mapping[str, Any]) -> None:
        self.folder = folder
        self.identity = json.loads(json.dumps(identity, sort_keys=True, default=str))

    def _path(self, name: str, seed: int) -> Path:
        return self.folder / name / f"seed-{seed}.json"

    def get(self, name: str, seed: int) -> Run | None:
        path = self._path(name, seed)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if doc.get("identity") != self.identity:
            return None
        return run_from_doc(doc["run"])

    def put(self, name: str, seed: int, run: Run) -> None:
        path = self._path(name, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": self.identity, "run": run_to_doc(run)}))
        tmp.replace(path)


def run_to_doc(run: Run) -> dict[str, Any]:
    """A run as JSON (:func:`run_from_doc` reads it back)."""
    return {
        "curve": [list(p) for p in run.curve],
        "losing_trial_s": run.losing_trial_s,
        "trials": run.trials,
        "step_sources": dict(run.step_sources),
        "curve_keys": run.curve_keys,
        "lower_bounds": run.lower_bounds,
        "seed": run.seed,
        "origins": dict(run.origins),
        "refused_held": run.refused_held,
        "refused_invalid": run.refused_invalid,
    }


def run_from_doc(doc: Mapping[str, Any]) -> Run:
    return Run(
        curve=[(float(a), float(b)) for a, b in doc["curve"]],
        losing_trial_s=[float(x) for x in doc["losing_trial_s"]],
        trials=int(doc["trials"]),
        step_sources=Counter(doc["step_sources"]),
        curve_keys=list(doc["curve_keys"]),
        lower_bounds=int(doc["lower_bounds"]),
        seed=int(doc["seed"]),
        origins=Counter(doc["origins"]),
        refused_held=int(doc["refused_held"]),
        refused_invalid=int(doc["refused_invalid"]),
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", type=Path)
    ap.add_argument("--seeds", type=int, default=20, help="seeds 0 .. N-1 (or --seed-sets)")
    ap.add_argument(
        "--seed-sets",
        default=None,
        help='disjoint seed sets, each reported, then all together: "0-19,20-39"',
    )
    ap.add_argument(
        "--merge",
        default="",
        help="grid params whose values label one engine configuration: pooled into one point "
        "(kv-cache-memory-bytes on the first CPU table, where it did not act)",
    )
    ap.add_argument(
        "--step-seconds",
        choices=STEP_SECONDS,
        default="recorded",
        help="a step's seconds: the table's recorded ones (default), or the 1 / scale model",
    )
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--budget", type=float, default=1.0, help="times the grid's GPU time")
    ap.add_argument(
        "--jobs", type=int, default=1, help="offline studies at once (worker processes)"
    )
    ap.add_argument(
        "--runs-dir",
        type=Path,
        default=None,
        help="keep each finished run here and read it back on the next call (resumable); "
        "clear it after changing the code",
    )
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the rows and curves here")
    ap.add_argument(
        "--partial", action="store_true", help="allow unmeasured grid points (no result)"
    )
    ap.add_argument(
        "--job",
        type=Path,
        default=None,
        help="the job that measured the table, for its capacity search settings (default: the "
        "job in benchmarks/data/ whose name is the table's study)",
    )
    ap.add_argument(
        "--warm-from",
        type=Path,
        default=None,
        help=f"an earlier study folder of this grid, for the {WARM} strategy",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    merge = tuple(m for m in ns.merge.split(",") if m)
    doc = json.loads(ns.table.read_text())
    table = load_table(
        doc,
        partial=ns.partial,
        merge=merge,
        step_seconds=ns.step_seconds,
    )
    seed_sets = (
        parse_seed_sets(ns.seed_sets)
        if ns.seed_sets
        else {f"0-{ns.seeds - 1}": list(range(ns.seeds))}
    )
    seeds = sorted({s for ss in seed_sets.values() for s in ss})
    job = ns.job if ns.job is not None else table_job(doc, DATA_DIR)
    settings, table.slos = _job_settings(job)
    budget = ns.budget * table.full_grid_s()
    warm = load_warm(ns.warm_from, table, job) if ns.warm_from else None
    if warm is not None:
        print(
            f"warm start from {ns.warm_from}: {len(warm.priors)} prior trials, "
            f"{len(warm.top)} configurations enqueued"
        )
    cache = None
    if ns.runs_dir is not None:
        identity = {
            "table": hashlib.sha256(ns.table.read_bytes()).hexdigest(),
            "merge": merge,
            "step_seconds": ns.step_seconds,
            "settings": settings,
            "budget_s": budget,
            "slos": table.slos,
            # What the warm start read (the earlier study may have grown since), not its path.
            "warm": _warm_digest(warm),
            "optuna": optuna.__version__,
        }
        cache = RunCache(ns.runs_dir, identity)
    runs = run_all(
        table,
        settings,
        ns.strategies.split(","),
        seeds,
        budget,
        print,
        warm,
        jobs=ns.jobs,
        cache=cache,
    )
    rows = summarize_runs(table, runs, table.full_grid_s())
    print_summary(table, rows)
    print_found_at(table, runs)
    replication = replication_rows(table, runs, seed_sets)
    print_replication(table, replication)
    diffs = differences(replication, pairs_for(list(runs)), budget=ns.budget)
    print_differences(diffs)
    origins = origin_rows(runs)
    print_origins(origins)
    if ns.png:
        plot(curves(table, runs, budget), ns.png, f"{ns.table.name}: {len(seeds)} seeds each")
    if ns.json:
        doc = {
            "rows": rows,
            "replication": replication,
            "differences": diffs,
            "origins": origins,
        }
        ns.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


def print_summary(table: Table, rows: list[dict[str, Any]]) -> None:
    """The table's size and best, then :func:`summarize_runs`'s rows."""
    print(
        f"table: {len(table.configs)} configurations; best {table.best:.3g} req/s; "
        f"the grid's GPU time {table.full_grid_s() / 3600:.2f} h; step seconds {table.step_seconds}"
        + (f"; merged labels of {', '.join(table.merged)}" if table.merged else "")
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


def parse_seed_sets(text: str) -> dict[str, list[int]]:
    """``"0-19,20-39"`` -> {"0-19": [0..19], "20-39": [20..39]}; a set may be one seed. The
    sets must not share a seed (they are replications of each other)."""
    sets: dict[str, list[int]] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        seeds = list(range(int(lo), int(hi or lo) + 1))
        if not seeds:
            raise SystemExit(f"seed set {part!r} is empty")
        sets[part] = seeds
    seen: set[int] = set()
    for name, seeds in sets.items():
        if seen & set(seeds):
            raise SystemExit(f"seed set {name} shares seeds with an earlier set: not disjoint")
        seen |= set(seeds)
    return sets


FRACTIONS = (0.25, 0.5, 1.0)


def replication_rows(
    table: Table,
    runs: Mapping[str, list[Run]],
    seed_sets: Mapping[str, Sequence[int]],
    fractions: tuple[float, ...] = FRACTIONS,
) -> list[dict[str, Any]]:
    """A row per strategy and seed set (and "all" when there is more than one set): the found
    configuration's truth as a share of the best at each fraction of the grid's time (mean and
    95 % half-width), the share of seeds whose returned configuration is in the table's top
    decile (:func:`top_decile`) at each fraction, the returned configuration's true mean capacity
    (req/s) at the whole budget, the seeds that reached the table's best and the median time to
    it (a share of the grid's time; inf: not reached in half the seeds), the mean GPU time of a
    losing trial, the told values that were lower bounds, and where step seconds came from.
    ``per_seed``: each seed's shares and returned capacity (what :func:`differences` pairs)."""
    sets = dict(seed_sets)
    if len(sets) > 1:
        sets["all"] = sorted({s for seeds in seed_sets.values() for s in seeds})
    rows = []
    for name, rs in runs.items():
        for set_name, seeds in sets.items():
            chosen = [r for r in rs if r.seed in set(seeds)]
            if chosen:
                rows.append(_replication_row(table, chosen, fractions, name, set_name))
    return rows


def _replication_row(
    table: Table, chosen: list[Run], fractions: tuple[float, ...], name: str, set_name: str
) -> dict[str, Any]:
    """:func:`replication_rows`'s row of one strategy's runs of one seed set."""
    full, start, top = table.full_grid_s(), table.truth[table.baseline], top_decile(table)
    row: dict[str, Any] = {"strategy": name, "seeds": set_name, "n": len(chosen)}
    row["trials"] = statistics.fmean(r.trials for r in chosen)
    per_seed: dict[int, dict[str, float]] = {r.seed: {} for r in chosen}
    for f in fractions:
        pct = round(f * 100)
        for r in chosen:
            per_seed[r.seed][f"share_{pct}"] = best_at(r, f * full, start) / table.best
        shares = [per_seed[r.seed][f"share_{pct}"] for r in chosen]
        row[f"share_{pct}"], row[f"share_{pct}_ci"] = _mean_ci(shares)
        keys = [found_key_at(r, f * full, table.baseline) for r in chosen]
        row[f"top_decile_{pct}"] = sum(k in top for k in keys)
    for r in chosen:
        per_seed[r.seed]["returned_rps"] = table.truth[found_key_at(r, full, table.baseline)]
    returned = [per_seed[r.seed]["returned_rps"] for r in chosen]
    row["returned_rps"], row["returned_rps_ci"] = _mean_ci(returned)
    to_95 = [time_to(r, 0.95 * table.best) / full for r in chosen]
    for r, t in zip(chosen, to_95, strict=True):
        per_seed[r.seed]["to_95"] = t
    row["reached_95"] = sum(math.isfinite(t) for t in to_95)
    for q, key in ((0.5, "to_95"), (0.25, "to_95_q25"), (0.75, "to_95_q75")):
        row[key] = quantile(to_95, q)
    times = [time_to(r, table.best) for r in chosen]
    row["reached_best"] = sum(math.isfinite(t) for t in times)
    row["median_to_best"] = statistics.median(times) / full
    losing = [s for r in chosen for s in r.losing_trial_s]
    row["losing_trial_s"] = statistics.fmean(losing) if losing else math.nan
    row["lower_bounds"] = sum(r.lower_bounds for r in chosen)
    sources: Counter[str] = Counter()
    for r in chosen:
        sources.update(r.step_sources)
    row["step_sources"] = {k: sources[k] for k in SOURCES}
    row["per_seed"] = per_seed
    return row


def _share_of_grid(value: float) -> str:
    return f"{100 * value:.0f}" if math.isfinite(value) else "never"


def print_replication(table: Table, rows: list[dict[str, Any]]) -> None:
    """The replication table (markdown), then where the steps' seconds came from."""
    top = top_decile(table)
    pcts = [round(f * 100) for f in FRACTIONS]
    print(
        f"top decile: {len(top)} of {len(table.truth) - 1} grid points, true mean >= "
        f"{min(table.truth[k] for k in top):.3g} req/s; the best {table.best:.3g} req/s"
    )
    print(
        "| strategy | seeds | trials | found, % of best, at "
        + " / ".join(f"{p}" for p in pcts)
        + " % of the grid's time | in the top decile at "
        + " / ".join(f"{p}" for p in pcts)
        + " % | returned config's true mean, req/s | time to 95 % of the best, % of the grid's "
        "time: median [25-75 %] | reached the best | median time to it "
        "| losing trial s | lower bounds told |"
    )
    print("|---|---|---:|---|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        n = r["n"]
        share = " / ".join(
            f"{100 * r[f'share_{p}']:.0f} ± {100 * r[f'share_{p}_ci']:.0f}" for p in pcts
        )
        hits = " / ".join(f"{r[f'top_decile_{p}']}" for p in pcts)
        median = r["median_to_best"]
        when = f"{100 * median:.0f} %" if math.isfinite(median) else "not in half"
        band = "-".join(_share_of_grid(r[k]) for k in ("to_95_q25", "to_95_q75"))
        to_95 = f"{_share_of_grid(r['to_95'])} [{band}]"
        print(
            f"| {r['strategy']} | {r['seeds']} | {r['trials']:.1f} | {share} | {hits} of {n} "
            f"| {r['returned_rps']:.1f} ± {r['returned_rps_ci']:.1f} | {to_95} "
            f"| {r['reached_best']} of {n} "
            f"| {when} | {r['losing_trial_s']:.0f} | {r['lower_bounds']} |"
        )
    print("step seconds charged (all seeds of a strategy):")
    for r in rows:
        if r["seeds"] != rows[-1]["seeds"]:
            continue
        src = r["step_sources"]
        total = sum(src.values())
        print(
            f"{r['strategy']:>14}: {total} steps: "
            + ", ".join(f"{src[k]} {k} ({100 * src[k] / max(total, 1):.0f} %)" for k in SOURCES)
        )


PAIRS = (
    ("tpe-racing", "random-racing"),  # what the Bayesian search adds over random, with racing
    ("tpe", "random"),  # the same without racing
    ("random-racing", "random"),  # what racing adds to random search
    ("tpe-racing", "tpe"),  # what racing adds to TPE
)


REFERENCE = "random-racing"  # every strategy is also compared with it (racing without a model)
DEFAULT = "rf-racing"  # and with the tuner's default (sampler.name's default, racing on)


def pairs_for(strategies: Sequence[str]) -> list[tuple[str, str]]:
    """:data:`PAIRS`, then every other strategy minus :data:`REFERENCE`, then every other
    model-based or guided one minus :data:`DEFAULT` (a pair of strategies that did not both run
    gives no row)."""
    out = list(PAIRS)
    out += [(s, REFERENCE) for s in strategies if s != REFERENCE and (s, REFERENCE) not in out]
    out += [
        (s, DEFAULT)
        for s in strategies
        if s in MODEL_STRATEGIES and s != DEFAULT and (s, DEFAULT) not in out
    ]
    return out


def differences(
    rows: list[dict[str, Any]], pairs: Sequence[tuple[str, str]] = PAIRS, budget: float = 1.0
) -> list[dict[str, Any]]:
    """Per pair of strategies that both ran and seed set of :func:`replication_rows`: the first
    minus the second, in points of the table's best at each fraction of the grid's time, in
    points of the grid's time to 95 % of the best (``to_95``; a seed that never reached it
    counts as the whole budget, ``budget`` times the grid's time: a floor of its true time) and
    in req/s of the returned configuration's true mean, paired by seed (the strategies ran the
    same seeds): the mean of the per-seed differences over the seeds both ran (``n``), with the
    95 % half-width of that mean from the per-seed differences' standard deviation and Student's
    t quantile (n - 1 degrees of freedom; nan below 2 seeds). A difference inside it is not one
    this many seeds can tell from noise."""
    by = {(r["strategy"], r["seeds"]): r for r in rows}
    out = []
    for a, b in pairs:
        for (name, seeds), ra in by.items():
            rb = by.get((b, seeds))
            if name != a or rb is None:
                continue
            both = sorted(set(ra["per_seed"]) & set(rb["per_seed"]))
            d: dict[str, Any] = {"pair": f"{a} - {b}", "seeds": seeds, "n": len(both)}
            for key in [f"share_{round(f * 100)}" for f in FRACTIONS] + ["returned_rps"]:
                per = [ra["per_seed"][s][key] - rb["per_seed"][s][key] for s in both]
                d[key], d[f"{key}_ci"] = _paired_ci(per)
            to_95 = [
                min(ra["per_seed"][s]["to_95"], budget) - min(rb["per_seed"][s]["to_95"], budget)
                for s in both
            ]
            d["to_95"], d["to_95_ci"] = _paired_ci(to_95)
            out.append(d)
    return out


def _paired_ci(diffs: list[float]) -> tuple[float, float]:
    """The mean of per-seed differences and its 95 % half-width (Student's t, n - 1 df)."""
    from scipy.stats import t

    if not diffs:
        return math.nan, math.nan
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.nan
    n = len(diffs)
    return mean, float(t.ppf(0.975, n - 1)) * statistics.stdev(diffs) / math.sqrt(n)


def print_differences(diffs: list[dict[str, Any]]) -> None:
    """The differences as a markdown table (points of the best; req/s)."""
    if not diffs:
        return
    pcts = [round(f * 100) for f in FRACTIONS]
    print("paired by seed: the mean per-seed difference ± its 95 % half-width (Student's t)")
    print(
        "| difference | seeds | points of the best at "
        + " / ".join(str(p) for p in pcts)
        + " % of the grid's time | time to 95 % of the best, points of the grid's time"
        " | returned config's true mean, req/s |"
    )
    print("|---|---|---|---:|---:|")
    for d in diffs:
        points = " / ".join(
            f"{100 * d[f'share_{p}']:+.1f} ± {100 * d[f'share_{p}_ci']:.1f}" for p in pcts
        )
        print(
            f"| {d['pair']} | {d['seeds']} | {points} "
            f"| {100 * d['to_95']:+.1f} ± {100 * d['to_95_ci']:.1f} "
            f"| {d['returned_rps']:+.1f} ± {d['returned_rps_ci']:.1f} |"
        )


def origin_rows(runs: Mapping[str, list[Run]]) -> list[dict[str, Any]]:
    """Per strategy: its measured trials by origin (:data:`ORIGINS`, and ``unattributed``) and
    its proposals refused as held, each as the mean per run over seeds and the total."""
    rows = []
    for name, rs in runs.items():
        row: dict[str, Any] = {"strategy": name, "seeds": len(rs)}
        counts = {
            "trials": [r.trials for r in rs],
            "refused_held": [r.refused_held for r in rs],
            "refused_invalid": [r.refused_invalid for r in rs],
        }
        for key in (*ORIGINS, "unattributed"):
            counts[key] = [r.origins[key] for r in rs]
        for key, values in counts.items():
            row[key], row[f"{key}_total"] = statistics.fmean(values), sum(values)
        rows.append(row)
    return rows


def print_origins(rows: list[dict[str, Any]]) -> None:
    """Where the strategies' trials came from (markdown): mean per run (total over seeds)."""

    def cell(row: Mapping[str, Any], *keys: str) -> str:
        mean = sum(row[k] for k in keys)
        return f"{mean:.1f} ({sum(row[f'{k}_total'] for k in keys)})"

    print("trials by the origin of their proposal, mean per run (total over seeds):")
    print(
        "| strategy | trials | model's own | acquisition | random fallback | startup "
        "| the guide's | refused as held | refused as invalid |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [
            cell(r, "trials"),
            cell(r, "model", "own"),
            *(
                cell(r, k)
                for k in (
                    "acquisition",
                    "random",
                    "startup",
                    "guided",
                    "refused_held",
                    "refused_invalid",
                )
            ),
        ]
        print(f"| {r['strategy']} | " + " | ".join(cells) + " |")
    print(
        "trials include the baseline (vLLM's defaults) and a warm start's enqueued ones; "
        "model's own: a strategy without a model (random, grid, one-at-a-time) counts its own "
        "draws there; the guide's: the tuning guide's one-parameter moves (GuidedSampler); "
        "refused as held: proposals of a configuration already measured (no trial); refused "
        "as invalid: proposals of a label the real study refuses before any server starts "
        "(told 0, no GPU time, no trial)"
    )
    for r in rows:
        if r["unattributed_total"] or r["enqueued_total"]:
            print(
                f"{r['strategy']}: {r['enqueued_total']} enqueued, "
                f"{r['unattributed_total']} unattributed (the sampler counted no origin)"
            )


DATA_DIR = Path(__file__).resolve().parent / "data"


def table_job(doc: Mapping[str, Any], data_dir: Path) -> Path:
    """The job that measured a table: the one job file in ``data_dir`` whose ``name`` is the
    study its repeats record (``made_with``). A table of several studies, or of a study with no
    job there, is refused with what to pass instead."""
    import yaml

    studies = sorted({str(m.get("study")) for m in doc.get("made_with", [])})
    if len(studies) != 1:
        raise SystemExit(f"the table's repeats come from studies {studies}: pass --job")
    found = []
    for path in sorted(data_dir.glob("*.yaml")):
        loaded = yaml.safe_load(path.read_text())
        if isinstance(loaded, dict) and loaded.get("name") == studies[0]:
            found.append(path)
    if len(found) != 1:
        raise SystemExit(
            f"{len(found)} job files in {data_dir} are named {studies[0]!r} (the table's study): "
            "pass --job, the job that measured the table"
        )
    return found[0]


def _job_settings(job: Path) -> tuple[CapacitySettings, int]:
    """The job's capacity search settings and the number of SLOs it judged its trials on (a
    refused trial is told each one violated)."""
    from optimizer.config import load_job
    from optimizer.study import job_objectives

    loaded, _base = load_job(job)
    return loaded.capacity.settings(), max(1, len(job_objectives(loaded).slos))


if __name__ == "__main__":
    sys.exit(main())
