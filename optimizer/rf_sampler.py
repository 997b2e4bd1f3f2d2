"""SMAC3's random-forest Bayesian optimisation as an Optuna sampler (:class:`RFSampler`).

The tuner's default sampler (``sampler.name: rf``; the verdict in benchmarks/RESULTS.md,
"Search strategies"). ``smac==2.4.1`` (BSD-3; its forest is scikit-learn's) is a dependency;
it is imported here alone, inside the functions that use it, so a job that names another
sampler runs where SMAC is not installed (the GPU machine's staged wheels).

The sampler keeps no knowledge between proposals: each proposal rebuilds SMAC's from the study,
so a study resumed in a new process, or shared by several drivers, continues as one would.

- Its relative search space is the intersection of the distributions of the finished trials
  that set a param (the param-less baseline is no point of the space), single-valued ones left
  out, as Optuna's GP sampler. Categorical choices go to SMAC as indices, a stepped int or
  float as the index of its step; ints and floats keep their log scale.
- A warm start's prior trials (``priors``: earlier studies' told trials rebuilt on this space,
  :func:`optimizer.warm_start.prior_trials`) are observations like the study's own: they count
  toward the startup below and toward the space, as :class:`optimizer.sampling.KnowledgeSampler`
  gives them to TPE and GP. They are not held: the warm start's best are measured here
  (enqueued), but SMAC proposes no configuration it has observed, a prior's included.
- Before ``n_startup_trials`` measured trials (complete or pruned) on that space, it proposes
  nothing itself: Optuna's random draws (``startup``), over the configurations no other trial
  holds once one is held.
- Every told trial on the space is one observation, in SMAC's minimising scale (a maximised
  objective negated): a complete feasible trial its values; an infeasible one (a constraint
  above 0, read from :attr:`FrozenTrial.constraints`: Optuna's ``constraints`` list or
  ``set_constraint``'s keys), a failed or a pruned one a penalty worse than every feasible cost
  (:func:`_penalty`), graded by the violation; a failed trial only where no measured one has
  its configuration (a refused duplicate). A configuration told more than once is one
  observation, its costs averaged. Running and waiting trials are marked running, so SMAC
  proposes none of them. The penalty keeps an infeasible region's better values from leading
  the search, but SMAC's forest does not learn to keep out of it: after seeing it, it proposed
  there about as often as random draws do (tests/unit/test_rf_sampler.py says where).
- Several objectives are one cost by ParEGO (a random weighting, new for each proposal).
- SMAC proposes with the hyperparameter-optimisation facade's parts: a random forest of 10
  trees on log-scaled costs, log expected improvement maximised by local and sorted random
  search, one candidate in five a random configuration (SMAC's interleaving, counted as the
  model's); no initial design (the startup above is it). On a listed space of at most 4,096
  configurations the acquisition is evaluated on every one of them instead (an acquisition
  maximiser of SMAC's kind, :func:`_listed_search`): exact, where the local and random search
  samples 10,000 random challengers from a few hundred points, and several times cheaper. Its
  random state is seeded from the sampler's seed and the trial's number, so a seeded study
  repeats, resumed or not.
- The first of SMAC's candidates that no other trial holds (:func:`optimizer.sampling._held`:
  told, running or waiting) is proposed (``model``). Where SMAC gives no free one (its
  ``ConfigurationSpaceExhaustedException`` comes early in a small discrete space, long before
  the space is measured) a free random configuration is (``random``); where every
  configuration is held, Optuna's random draws.

Proposals are counted by origin in :attr:`RFSampler.origins` and stored on their trial (system
attr :data:`optimizer.sampling.ORIGIN_ATTR`), as :class:`optimizer.sampling.KnowledgeSampler`
does. SMAC's files go to a temporary folder, removed after each proposal; its log is silenced
(it never configures logging).
"""

from __future__ import annotations

import logging
import math
import random
import tempfile
from collections import Counter, defaultdict
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler, RandomSampler
from optuna.search_space import intersection_search_space
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from optimizer.sampling import (
    _RANKED,
    _free_list,
    _held,
    _key,
    as_priors,
    free_draw,
    note_origin,
)

if TYPE_CHECKING:
    from ConfigSpace import Configuration, ConfigurationSpace
    from smac import HyperparameterOptimizationFacade
    from smac.acquisition.maximizer.abstract_acquisition_maximizer import (
        AbstractAcquisitionMaximizer,
    )

__all__ = ["RF_ORIGINS", "RFSampler"]

RF_ORIGINS = ("startup", "model", "random", "enqueued")
"""Where a proposal came from: Optuna's random startup, SMAC's candidate, a free random
configuration in place of SMAC's held or missing ones, a configuration fixed before the trial."""

_CANDIDATES = 16
"""SMAC's candidates tried for a free one before a free random configuration is taken."""


_RANDOM_SHARE = 0.2
"""SMAC's share of interleaved random configurations (its facade's default)."""

Key = tuple[Any, ...]


class RFSampler(BaseSampler):
    """SMAC3's random-forest Bayesian optimisation (see the module docstring).

    Args:
        seed: Seeds Optuna's random draws and SMAC (with each trial's number); None: random.
        n_startup_trials: Measured trials on the search space before SMAC proposes.
        priors: Finished trials of earlier studies on this search space, numbered -1
            (:func:`optimizer.warm_start.prior_trials`).
    """

    def __init__(
        self,
        seed: int | None = None,
        n_startup_trials: int = 4,
        priors: Sequence[FrozenTrial] = (),
    ) -> None:
        self.priors = as_priors(priors)
        self._seed = seed
        self._n_startup_trials = n_startup_trials
        self._rng = random.Random(seed)
        self._random = RandomSampler(seed=seed)
        self.origins: Counter[str] = Counter()
        """Proposals by origin (:data:`RF_ORIGINS`), for reports, tests and benchmarks."""

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        states = (TrialState.COMPLETE, TrialState.PRUNED)
        own = study._get_trials(deepcopy=False, states=states)
        finished = [*self.priors, *(t for t in own if t.params)]
        space = intersection_search_space(finished, include_pruned=True)
        return {name: dist for name, dist in space.items() if not dist.single()}

    def sample_relative(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        search_space: dict[str, BaseDistribution],
    ) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:
            return {}  # counted in before_trial
        if not search_space:
            self._note(study, trial, "startup")  # Optuna's draws: the first trial
            return {}
        trials = study._get_trials(deepcopy=False, use_cache=False)
        held = _held(study, trial, search_space)
        told = _told([*self.priors, *trials], search_space)
        measured = [t for t in told if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        if len(measured) < self._n_startup_trials:
            self._note(study, trial, "startup")
            return (self._free(study, trial, search_space, held) if held else None) or {}
        observations = _observations(told, search_space, study.directions)
        busy = held - set(observations)  # running or waiting: held, not told
        candidates = _smac_candidates(
            search_space, observations, busy, len(study.directions), self._smac_seed(trial)
        )
        for params in candidates:
            if _key(params, search_space) not in held:
                candidates.close()  # SMAC's temporary folder goes now
                self._note(study, trial, "model")
                return params
        free = self._free(study, trial, search_space, held)
        self._note(study, trial, "random")
        return free or {}  # {}: every configuration is held; Optuna's draws

    def _smac_seed(self, trial: FrozenTrial) -> int:
        if self._seed is None:
            return self._rng.randrange(2**31)
        return random.Random(f"{self._seed}:{trial.number}").randrange(2**31)

    def _note(self, study: optuna.Study, trial: FrozenTrial, origin: str) -> None:
        note_origin(self.origins, study, trial, origin)

    def _free(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        held: set[Key],
    ) -> dict[str, Any] | None:
        return free_draw(self._random, self._rng, study, trial, space, held)

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if "fixed_params" in trial.system_attrs:
            self._note(study, trial, "enqueued")

    def reseed_rng(self) -> None:
        self._random.reseed_rng()
        self._rng.seed()


def _told(trials: Sequence[FrozenTrial], space: dict[str, BaseDistribution]) -> list[FrozenTrial]:
    """The told trials (complete, pruned, failed) that set every param of ``space`` from its
    distributions; a failed one only where no complete or pruned trial measured its
    configuration (a driver fails a duplicate it refuses: no news of the configuration)."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    told = [
        t
        for t in trials
        if t.state in states and all(t.distributions.get(n) == d for n, d in space.items())
    ]
    measured = {_key(t.params, space) for t in told if t.state != TrialState.FAIL}
    return [t for t in told if t.state != TrialState.FAIL or _key(t.params, space) not in measured]


def _observations(
    told: Sequence[FrozenTrial],
    space: dict[str, BaseDistribution],
    directions: Sequence[StudyDirection],
) -> dict[Key, list[float]]:
    """Each told configuration's cost (one per objective, minimised), by its key: feasible
    values as they are, every other trial :func:`_penalty`; repeats averaged."""
    signs = np.array([1.0 if d == StudyDirection.MINIMIZE else -1.0 for d in directions])
    feasible: list[tuple[Key, np.ndarray]] = []
    infeasible: list[tuple[Key, float]] = []
    for t in told:
        key = _key(t.params, space)
        violation = _violation(t)
        if violation == 0.0 and t.values is not None:
            feasible.append((key, signs * np.asarray(t.values, dtype=float)))
        else:
            infeasible.append((key, violation))
    costs = np.vstack([c for _, c in feasible]) if feasible else np.empty((0, len(signs)))
    grouped: dict[Key, list[np.ndarray]] = defaultdict(list)
    for key, cost in feasible:
        grouped[key].append(cost)
    for key, violation in infeasible:
        grouped[key].append(_penalty(costs, violation, len(signs)))
    return {key: np.mean(cs, axis=0).tolist() for key, cs in grouped.items()}


def _violation(trial: FrozenTrial) -> float:
    """How far a told trial is from feasible: 0 (complete, finite values, every constraint met),
    the sum of its constraints above 0, inf (failed, pruned or without finite values)."""
    if trial.state != TrialState.COMPLETE or trial.values is None:
        return math.inf
    if not all(math.isfinite(v) for v in trial.values):
        return math.inf
    return float(sum(max(0.0, c) for c in trial.constraints.values()))


def _penalty(feasible: np.ndarray, violation: float, n_objectives: int) -> np.ndarray:
    """An infeasible (failed, pruned) trial's cost: per objective, the worst feasible cost plus
    one to two spans of the feasible costs (the range, else the worst's size, else 1), more the
    larger the violation (``v / (1 + v)``: bounded, so SLO margins in any unit and the failed
    trials' huge ones keep the feasible costs apart). Without a feasible trial, 1 to 2."""
    grade = 1.0 if math.isinf(violation) else violation / (1.0 + violation)
    if feasible.shape[0] == 0:
        return np.full(n_objectives, 1.0 + grade)
    worst, best = feasible.max(axis=0), feasible.min(axis=0)
    span = worst - best
    span = np.where(span > 0, span, np.maximum(np.abs(worst), 1.0))
    return np.asarray(worst + span * (1.0 + grade), dtype=float)


def _smac_candidates(
    space: dict[str, BaseDistribution],
    observations: dict[Key, list[float]],
    busy: set[Key],
    n_objectives: int,
    seed: int,
) -> Generator[dict[str, Any], None, None]:
    """SMAC's candidates in its order of preference (at most :data:`_CANDIDATES`), as Optuna
    params; none told or busy. Ends early where SMAC finds no new configuration."""
    from ConfigSpace import Configuration
    from smac.main.exceptions import ConfigurationSpaceExhaustedException
    from smac.runhistory.dataclasses import TrialInfo

    logging.getLogger("smac").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="rf-sampler-") as folder:
        cs = _configspace(space)
        listed = _listed(space)
        every = None if listed is None else [
            Configuration(cs, values=_smac_values(key, space)) for key in listed
        ]  # fmt: skip
        smac = _facade(cs, n_objectives, seed, Path(folder), len(observations), every)
        for key, cost in observations.items():
            config = Configuration(cs, values=_smac_values(key, space))
            smac.runhistory.add(config=config, cost=cost if n_objectives > 1 else cost[0], seed=0)
        for key in busy:
            try:
                config = Configuration(cs, values=_smac_values(key, space))
            except (TypeError, ValueError):
                continue  # a waiting trial's fixed value outside the space: no point of it
            smac.runhistory.add_running_trial(TrialInfo(config=config, seed=0))
        selector = iter(smac.intensifier.config_selector)
        for _ in range(_CANDIDATES):
            try:
                config = next(selector)
            except (ConfigurationSpaceExhaustedException, StopIteration):
                return
            yield _params(dict(config), space)


def _facade(
    cs: ConfigurationSpace,
    n_objectives: int,
    seed: int,
    folder: Path,
    n_points: int,
    every: list[Configuration] | None = None,
) -> HyperparameterOptimizationFacade:
    """SMAC's hyperparameter-optimisation facade for ask-and-tell, without initial design, its
    forest on one thread, ParEGO for several objectives; files under ``folder``.

    The forest is the facade's (``get_model``) with one change that changes no tree: at most
    ``n_points`` leaves (a tree of ``n_points`` observations has no more), not SMAC's 2**20,
    for which scikit-learn allocates each tree's nodes up front (0.2 s a tree). ``every``: the
    space's every configuration where it is listed; SMAC's acquisition is then evaluated on each
    (:func:`_listed_search`) in place of its local and random search."""
    from smac import HyperparameterOptimizationFacade as HPO
    from smac import Scenario
    from smac.model.random_forest import RandomForest
    from smac.multi_objective.parego import ParEGO

    objectives: str | list[str] = (
        "cost" if n_objectives == 1 else [f"cost_{i}" for i in range(n_objectives)]
    )
    scenario = Scenario(
        cs,
        deterministic=True,
        objectives=objectives,
        n_trials=1_000_000,
        seed=seed,
        output_directory=folder,
    )
    model = RandomForest(
        configspace=cs, log_y=True, n_trees=10, ratio_features=1.0, min_samples_split=2,
        min_samples_leaf=1, max_leaf_nodes=max(2, n_points), seed=seed, n_jobs=1,
    )  # fmt: skip
    maximizer: AbstractAcquisitionMaximizer
    if every is not None:
        maximizer = _listed_search(cs, every, seed)
    else:
        search = HPO.get_acquisition_maximizer(scenario)
        # SMAC's local search starts from list(set(configurations)): an order of string hashes,
        # new in each process (PYTHONHASHSEED). In the configurations' own order, a seed repeats.
        starts = search._local_search._get_initial_points
        setattr(  # noqa: B010 (mypy refuses an assignment to a method)
            search._local_search,
            "_get_initial_points",
            lambda *args, **kwargs: sorted(starts(*args, **kwargs), key=_in_order),
        )
        maximizer = search
    return HPO(
        scenario,
        None,
        model=model,
        acquisition_maximizer=maximizer,
        initial_design=HPO.get_initial_design(scenario, n_configs=0),
        random_design=HPO.get_random_design(scenario, probability=_RANDOM_SHARE),
        multi_objective_algorithm=ParEGO(scenario) if n_objectives > 1 else None,
        logging_level=False,  # an int would reconfigure the root logger
        overwrite=True,  # else it asks on stdin about an earlier run
    )


def _listed(space: dict[str, BaseDistribution]) -> list[Key] | None:
    """Every configuration of ``space`` (its keys) where it is listed and holds at most
    :data:`optimizer.sampling._RANKED` of them; else None."""
    every = _free_list(space, set(), limit=_RANKED)
    return None if every is None else [_key(params, space) for params in every]


def _listed_search(
    cs: ConfigurationSpace, every: list[Configuration], seed: int
) -> AbstractAcquisitionMaximizer:
    """An acquisition maximiser of SMAC's kind that evaluates SMAC's acquisition on every
    configuration of a listed space and returns them best first (ties in a seeded random order,
    as SMAC's own sort): exact where the local and random search (10,000 random challengers)
    only samples a space of a few hundred points, and much cheaper."""
    from smac.acquisition.maximizer.abstract_acquisition_maximizer import (
        AbstractAcquisitionMaximizer,
    )

    class ListedSearch(AbstractAcquisitionMaximizer):
        def _maximize(
            self, previous_configs: list[Configuration], n_points: int
        ) -> list[tuple[float, Configuration]]:
            return self._sort_by_acquisition_value(list(every))

    return ListedSearch(cs, challengers=len(every), seed=seed)


def _in_order(config: Any) -> tuple[float, ...]:
    """A configuration's place in an order that no hash decides: its vector's."""
    return tuple(float(v) for v in np.nan_to_num(config.get_array(), nan=-1.0))


def _configspace(space: dict[str, BaseDistribution]) -> ConfigurationSpace:
    """The space as SMAC's: a choice by its index, a stepped param by its step's index."""
    from ConfigSpace import Categorical, ConfigurationSpace, Float, Integer

    cs = ConfigurationSpace()
    for name in sorted(space):
        dist = space[name]
        if isinstance(dist, CategoricalDistribution):
            cs.add(Categorical(name, items=list(range(len(dist.choices)))))
        elif isinstance(dist, IntDistribution) and dist.step == 1:
            cs.add(Integer(name, bounds=(dist.low, dist.high), log=dist.log))
        elif isinstance(dist, IntDistribution):
            cs.add(Integer(name, bounds=(0, (dist.high - dist.low) // dist.step)))
        elif isinstance(dist, FloatDistribution) and dist.step is not None:
            cs.add(Integer(name, bounds=(0, round((dist.high - dist.low) / dist.step))))
        elif isinstance(dist, FloatDistribution):
            cs.add(Float(name, bounds=(dist.low, dist.high), log=dist.log))
        else:
            raise TypeError(f"{name}: {type(dist).__name__} is not supported")
    return cs


def _smac_values(key: Key, space: dict[str, BaseDistribution]) -> dict[str, Any]:
    """A configuration's key (:func:`optimizer.sampling._key`) as SMAC's values."""
    out: dict[str, Any] = {}
    for name, k in zip(sorted(space), key, strict=True):
        dist = space[name]
        if isinstance(dist, CategoricalDistribution):
            out[name] = int(k)
        elif isinstance(dist, IntDistribution):
            out[name] = (int(k) - dist.low) // dist.step if dist.step != 1 else int(k)
        elif isinstance(dist, FloatDistribution) and dist.step is not None:
            out[name] = int(k)  # the key holds the step's index
        elif isinstance(dist, FloatDistribution):
            out[name] = min(max(float(k), dist.low), dist.high)
        else:
            raise TypeError(f"{name}: {type(dist).__name__} is not supported")
    return out


def _params(values: dict[str, Any], space: dict[str, BaseDistribution]) -> dict[str, Any]:
    """SMAC's values as Optuna params (the inverse of :func:`_smac_values`)."""
    out: dict[str, Any] = {}
    for name, dist in space.items():
        value = values[name]
        if isinstance(dist, CategoricalDistribution):
            out[name] = dist.choices[int(value)]
        elif isinstance(dist, IntDistribution):
            out[name] = int(value) if dist.step == 1 else dist.low + int(value) * dist.step
        elif isinstance(dist, FloatDistribution) and dist.step is not None:
            out[name] = min(dist.high, dist.low + int(value) * dist.step)
        else:
            out[name] = float(value)
    return out
