"""The sampler a job asks for, made for an ask/tell study that may be resumed: ``auto``'s choice
by the space's size, TPE and GP wrapped so that they learn from the trials that chose a
configuration, the guide ahead of a model, and a grid sampler that goes on where a resumed study
stopped. A seeded sampler's seed is offset by the trials the study holds, so a resumed study does
not propose the first driver's configurations again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from optimizer.config import JobConfig
from optimizer.errors import SearchSpaceError
from optimizer.guided import GuidedSampler
from optimizer.sampling import model_sampler
from search_spaces import SearchSpace

__all__ = [
    "StudyGridSampler",
    "auto_sampler",
    "job_sampler",
    "space_distributions",
]


def job_sampler(
    job: JobConfig,
    space: SearchSpace,
    resumed_at: int = 0,
    priors: tuple[FrozenTrial, ...] = (),
) -> optuna.samplers.BaseSampler:
    """The job's sampler; ``resumed_at``: trials the study already holds; ``priors``: a warm
    start's prior observations (the model-based samplers: the forest, TPE, GP).

    TPE and GP are wrapped in :class:`~optimizer.sampling.KnowledgeSampler`, and the forest
    (:class:`~optimizer.rf_sampler.RFSampler`) does the same itself: they learn from the trials
    that chose a configuration (not the param-less baseline) and from ``priors``, and propose no
    configuration the study holds while one is free. ``startup: guided`` puts the guide's moves
    ahead of any of them.

    The grid sampler skips the grid points the study's trials already measured, so a resumed
    grid study goes on where it stopped.

    A seeded sampler restarts its random sequence in every new driver, so a resumed study would
    propose the first driver's configurations again: the seed is offset by the trial count.
    """
    s = job.sampler
    seed = None if s.seed is None else s.seed + resumed_at
    if s.name == "auto":
        s = s.model_copy(update={"name": auto_sampler(job, space)})
    if s.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s.name == "grid":
        return StudyGridSampler(space.grid(), seed=s.seed)
    model: optuna.samplers.BaseSampler
    if s.name == "rf":
        from optimizer.rf_sampler import RFSampler  # SMAC3, imported only where it is asked for

        model = RFSampler(seed=seed, n_startup_trials=s.n_startup_trials, priors=priors)
    else:
        name = "tpe" if s.name == "guided" else s.name
        model = model_sampler(name, seed, s.n_startup_trials, priors)
    if s.name == "guided" or s.startup == "guided":
        cap = None if s.name == "guided" else s.n_startup_trials
        return GuidedSampler(space_distributions(space), model, max_guided=cap)
    return model


def auto_sampler(job: JobConfig, space: SearchSpace) -> str:
    """The sampler ``auto`` picks by size: ``grid`` where the trial budget covers every
    configuration of the space (the baseline besides), else the random forest (``rf``: the
    measured best; benchmarks/RESULTS.md, "Search strategies")."""
    try:
        points = math.prod(len(v) for v in space.grid().values())
    except SearchSpaceError:
        return "rf"  # continuous, conditional or too large to list
    return "grid" if job.trials is not None and job.trials >= points + 1 else "rf"


def space_distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    """The distributions a trial of ``space`` suggests (its params active by default)."""
    probe = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = probe.ask()
    space.suggest(trial)
    return dict(trial.distributions)


class StudyGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler made safe to resume, for an ask/tell loop.

    - Optuna numbers the grid's points in an order shuffled by the seed, and gives trial *n* point
      *n*: a study resumed with another seed (or holding enqueued trials, which take numbers but
      no point) would read its measured points as other ones, measure some twice and never reach
      others. Here a point's number is its place in the grid's own order (the same in every
      driver), the seed only picks which unmeasured point comes next, and a point that any
      finished or running trial holds (enqueued ones too, matched by their values) counts as taken.
    - Once every point is measured Optuna calls ``study.stop()``, which only ``study.optimize``
      allows (a RuntimeError from ``tell`` otherwise); the driver asks :meth:`is_exhausted`
      before it launches instead.
    """

    def __init__(self, search_space: dict[str, list[Any]], seed: int | None = None) -> None:
        super().__init__(search_space, seed=seed)
        self._all_grids = list(itertools.product(*self._search_space.values()))
        self._index = {point: i for i, point in enumerate(self._all_grids)}

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if "grid_id" in trial.system_attrs or "fixed_params" in trial.system_attrs:
            return
        free = self._get_unvisited_grid_ids(study) or list(range(len(self._all_grids)))
        grid_id = int(self._rng.rng.choice(sorted(free)))
        study._storage.set_trial_system_attr(trial._trial_id, "search_space", self._search_space)
        study._storage.set_trial_system_attr(trial._trial_id, "grid_id", grid_id)

    def _get_unvisited_grid_ids(self, study: optuna.Study) -> list[int]:
        taken = {
            self._index.get(tuple(t.params.get(name, _NO_VALUE) for name in self._param_names))
            for t in study._storage.get_all_trials(study._study_id, deepcopy=False)
            if t.state.is_finished() or t.state == TrialState.RUNNING
        }
        return [i for i in range(len(self._all_grids)) if i not in taken]

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        return None


_NO_VALUE = object()
