"""What a model-based sampler (TPE, GP) learns from: the trials that chose a configuration, and
the prior observations a warm start brings.

:class:`KnowledgeSampler` wraps Optuna's sampler and shows it the study through a view that

- leaves out trials that set no param: the baseline (vLLM's defaults, enqueued without params)
  is measured like any trial, but it is no point of the search space. Optuna's GP sampler
  intersects the search spaces of all finished trials, so one param-less trial made its
  relative search space empty and every GP proposal after the baseline a uniform random draw;
- puts the prior trials first: an earlier study's told trials, rebuilt on this study's search
  space (:func:`optimizer.warm_start.prior_trials`), numbered -1 so they never meet a trial of
  this study (and do not end Optuna's search-space scans, which stop below their cursor).
  They count toward the sampler's startup trials and its good/bad split
  like trials of this study; they are not in the study (no report, front or MLflow run lists
  them) and are never measured here;

and it never proposes a configuration the study already holds (measured, running or waiting)
when it can propose another: in a small discrete space TPE converges and keeps proposing its
best point, which the driver refuses as a duplicate (no server starts, the trial count is
spent) and which TPE, not learning from the refusal, proposes again. A proposal that repeats a
held configuration is asked again a few times (the sampler's random draws differ), then
replaced by a configuration nobody holds, drawn by Optuna's random sampler (its laws: a log
scale stays one) until one is free; during the sampler's startup (its own random draws) the
draws skip the held configurations the same way. A conditional space (``when``) is not covered:
a proposal there is compared on the params every trial sets, which few trials hold.

Everything else (storage writes, directions, the study's id) goes to the real study.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import warnings
from collections.abc import Container, Sequence
from typing import Any, cast

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

__all__ = ["MODEL_SAMPLERS", "KnowledgeSampler", "model_sampler"]

MODEL_SAMPLERS = ("tpe", "gp")
"""Samplers that learn from trials (and so from a warm start's priors)."""


def model_sampler(
    name: str,
    seed: int | None,
    n_startup_trials: int,
    priors: Sequence[FrozenTrial] = (),
) -> KnowledgeSampler:
    """TPE or GP as every study runs them, wrapped in :class:`KnowledgeSampler`.

    TPE is multivariate with groups (conditional params form separate groups) and a constant
    liar (parallel trials do not propose the same configuration).
    """
    inner: BaseSampler
    if name == "gp":
        inner = optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials)
    elif name == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            inner = optuna.samplers.TPESampler(
                seed=seed,
                multivariate=True,
                group=True,
                constant_liar=True,
                n_startup_trials=n_startup_trials,
            )
    else:
        raise ValueError(f"{name!r} is not one of {MODEL_SAMPLERS}")
    return KnowledgeSampler(inner, priors, seed=seed)


class _StudyView:
    """A study as the wrapped sampler sees it: the prior trials, then the study's own trials
    that set a param (or are still running). Anything else is the real study's."""

    def __init__(self, study: optuna.Study, priors: Sequence[FrozenTrial]) -> None:
        self._study = study
        self._priors = priors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(
        self,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
        use_cache: bool = False,
    ) -> list[FrozenTrial]:
        own = self._study._get_trials(deepcopy=deepcopy, states=states, use_cache=use_cache)
        return self._merge(own, states, deepcopy)

    def get_trials(
        self, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        own = self._study.get_trials(deepcopy=deepcopy, states=states)
        return self._merge(own, states, deepcopy)

    def _merge(
        self, own: list[FrozenTrial], states: Container[TrialState] | None, deepcopy: bool
    ) -> list[FrozenTrial]:
        priors = [t for t in self._priors if states is None or t.state in states]
        if deepcopy:
            priors = [copy.deepcopy(t) for t in priors]
        kept = [t for t in own if t.params or not t.state.is_finished()]
        return [*priors, *kept]


class KnowledgeSampler(BaseSampler):
    """Optuna's ``inner`` sampler, shown the study without param-less trials and with
    ``priors`` before its own trials (see the module docstring).

    Args:
        inner: A model-based sampler (TPE, GP).
        priors: Finished trials of earlier studies on this search space, numbered -1.
    """

    retries = 2
    """Times a repeated proposal is asked again before a novel one is drawn (GP refits each
    time: kept small)."""

    def __init__(
        self, inner: BaseSampler, priors: Sequence[FrozenTrial] = (), seed: int | None = None
    ) -> None:
        if any(t.number >= 0 for t in priors):
            raise ValueError("prior trials need numbers below zero (-1: see warm_start._prior)")
        self.inner = inner
        self.priors = tuple(priors)
        self._rng = random.Random(seed)
        self._random = optuna.samplers.RandomSampler(seed=seed)
        self.replaced = 0
        """Proposals replaced by a novel configuration (for tests and benchmarks)."""

    def _view(self, study: optuna.Study) -> optuna.Study:
        return cast(optuna.Study, _StudyView(study, self.priors))

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self.inner.infer_relative_search_space(self._view(study), trial)

    def sample_relative(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        search_space: dict[str, BaseDistribution],
    ) -> dict[str, Any]:
        view = self._view(study)
        params = self.inner.sample_relative(view, trial, search_space)
        if not search_space or (params and set(params) != set(search_space)):
            return params
        held = _held(study, trial, search_space)
        if not params:
            # The sampler's startup (its independent random draws): the same random law, over
            # the configurations nobody holds.
            return (self._free(study, trial, search_space, held) if held else None) or params
        for _ in range(self.retries):
            if _key(params, search_space) not in held:
                return params
            params = self.inner.sample_relative(view, trial, search_space)
        if _key(params, search_space) not in held:
            return params
        free = self._free(study, trial, search_space, held)
        if free is None:
            return params  # every configuration is held (or none free was found)
        self.replaced += 1
        return free

    def _free(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        held: set[tuple[Any, ...]],
    ) -> dict[str, Any] | None:
        """A configuration nobody holds: Optuna's random draws (log scales kept) until one is
        free; when the space is nearly all held, uniformly among the free ones listed."""
        names = sorted(space)
        for _ in range(_DRAWS):
            draw = {n: self._random.sample_independent(study, trial, n, space[n]) for n in names}
            if _key(draw, space) not in held:
                return draw
        return _listed_free(space, held, self._rng)

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self.inner.sample_independent(
            self._view(study), trial, param_name, param_distribution
        )

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()
        self._rng.seed()


def _key(params: dict[str, Any], space: dict[str, BaseDistribution]) -> tuple[Any, ...]:
    """A configuration as the space's distributions see it: a stepped float by its step index
    (0.86 and 0.8600000000000001 are one point), a choice by its index."""
    out: list[Any] = []
    for name in sorted(space):
        dist, value = space[name], params[name]
        if isinstance(dist, FloatDistribution) and dist.step is not None:
            out.append(round((float(value) - dist.low) / dist.step))
            continue
        try:
            out.append(dist.to_internal_repr(value))
        except (ValueError, TypeError):
            out.append(repr(value))
    return tuple(out)


def _held(
    study: optuna.Study, trial: FrozenTrial, space: dict[str, BaseDistribution]
) -> set[tuple[Any, ...]]:
    """The configurations of ``space`` the study's other trials hold (told, running, waiting;
    a failed or refused proposal holds nothing), read on the space's params: a trial whose other
    params could vary is left out (it is not the same configuration)."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
    held = set()
    for t in study._get_trials(deepcopy=False, states=states, use_cache=False):
        params = t.params or t.system_attrs.get("fixed_params") or {}
        if t.number == trial.number or not set(space) <= set(params):
            continue
        others = set(params) - set(space)
        if any(k not in t.distributions or not t.distributions[k].single() for k in others):
            continue
        held.add(_key(params, space))
    return held


_DRAWS = 2_000
_ENUMERABLE = 100_000


def _values(dist: BaseDistribution) -> list[Any] | None:
    """Every value of a discrete distribution that it contains (None: continuous)."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution):
        return list(range(dist.low, dist.high + 1, 1 if dist.log else dist.step))
    if isinstance(dist, FloatDistribution) and dist.step is not None:
        count = round((dist.high - dist.low) / dist.step)
        values = [min(dist.high, dist.low + i * dist.step) for i in range(count + 1)]
        return [v for v in values if dist._contains(dist.to_internal_repr(v))]
    return None


def _listed_free(
    space: dict[str, BaseDistribution], held: set[tuple[Any, ...]], rng: random.Random
) -> dict[str, Any] | None:
    """A configuration of ``space`` nobody holds, uniformly among all of them listed (None:
    none free, or the space is continuous or too large to list)."""
    names = sorted(space)
    values = [_values(space[n]) for n in names]
    lists = [v for v in values if v is not None]
    if len(lists) < len(values) or math.prod(len(v) for v in lists) > _ENUMERABLE:
        return None
    free = []
    for combo in itertools.product(*lists):
        point = dict(zip(names, combo, strict=True))
        if _key(point, space) not in held:
            free.append(point)
    return rng.choice(free) if free else None
