"""What a model-based sampler (TPE, GP) learns from: the trials that chose a configuration, and
the prior observations a warm start brings.

:class:`KnowledgeSampler` wraps Optuna's sampler and shows it the study through a view that

- leaves out trials that set no param: the baseline (vLLM's defaults, enqueued without params)
  is measured like any trial, but it is no point of the search space. Optuna's GP sampler
  intersects the search spaces of all finished trials, so one param-less trial made its
  relative search space empty and every GP proposal after the baseline a uniform random draw;
- puts the prior trials first: an earlier study's told trials, rebuilt on this study's search
  space (:func:`optimizer.warm_start.prior_trials`), numbered below zero so they never meet a
  trial of this study. They count toward the sampler's startup trials and its good/bad split
  like trials of this study; they are not in the study (no report, front or MLflow run lists
  them) and are never measured here;

and it never proposes a configuration the study already holds (measured, running or waiting)
when it can propose another: in a small discrete space TPE converges and keeps proposing its
best point, which the driver refuses as a duplicate (no server starts, the trial count is
spent) and which TPE, not learning from the refusal, proposes again. A proposal that repeats a
held configuration is asked again a few times (the sampler's random draws differ), then
replaced by a configuration nobody holds, drawn uniformly; during the sampler's startup (its
uniform random draws) the draw is uniform over the configurations nobody holds. Discrete spaces
only: a continuous one does not repeat itself.

Everything else (storage writes, directions, the study's id) goes to the real study.
"""

from __future__ import annotations

import itertools
import math
import random
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

__all__ = ["KnowledgeSampler"]


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

    @property
    def trials(self) -> list[FrozenTrial]:
        return self.get_trials()

    def _merge(
        self, own: list[FrozenTrial], states: Container[TrialState] | None, deepcopy: bool
    ) -> list[FrozenTrial]:
        priors = [t for t in self._priors if states is None or t.state in states]
        if deepcopy:
            priors = [_copy(t) for t in priors]
        kept = [t for t in own if t.params or not t.state.is_finished()]
        return [*priors, *kept]


def _copy(trial: FrozenTrial) -> FrozenTrial:
    import copy

    return copy.deepcopy(trial)


class KnowledgeSampler(BaseSampler):
    """Optuna's ``inner`` sampler, shown the study without param-less trials and with
    ``priors`` before its own trials (see the module docstring).

    Args:
        inner: A model-based sampler (TPE, GP).
        priors: Finished trials of earlier studies on this search space, numbered below zero.
    """

    retries = 4
    """Times a repeated proposal is asked again before a novel one is drawn."""

    def __init__(
        self, inner: BaseSampler, priors: Sequence[FrozenTrial] = (), seed: int | None = None
    ) -> None:
        numbers = [t.number for t in priors]
        if any(n >= 0 for n in numbers) or len(set(numbers)) != len(numbers):
            raise ValueError("prior trials need distinct numbers below zero")
        self.inner = inner
        self.priors = tuple(priors)
        self._rng = random.Random(seed)
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
            # The sampler's startup (independent uniform draws): uniform over what nobody holds.
            return (_novel(search_space, held, self._rng) if held else None) or params
        for _ in range(self.retries):
            if _key(params, search_space) not in held:
                return params
            params = self.inner.sample_relative(view, trial, search_space)
        if _key(params, search_space) not in held:
            return params
        novel = _novel(search_space, held, self._rng)
        if novel is None:
            return params  # every configuration is held (or the space is continuous)
        self.replaced += 1
        return novel

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
    return tuple(repr(params[name]) for name in sorted(space))


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


_ENUMERABLE = 100_000


def _values(dist: BaseDistribution) -> list[Any] | None:
    """Every value of a discrete distribution (None: continuous)."""
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution) and not dist.log:
        return list(range(dist.low, dist.high + 1, dist.step))
    if isinstance(dist, IntDistribution):
        return list(range(dist.low, dist.high + 1))
    if isinstance(dist, FloatDistribution) and dist.step is not None:
        count = round((dist.high - dist.low) / dist.step)
        return [dist.low + i * dist.step for i in range(count + 1)]
    return None


def _novel(
    space: dict[str, BaseDistribution], held: set[tuple[Any, ...]], rng: random.Random
) -> dict[str, Any] | None:
    """A configuration of ``space`` nobody holds, uniformly at random (None: none, or the
    space is continuous or too large to list)."""
    names = sorted(space)
    values = [_values(space[n]) for n in names]
    if any(v is None for v in values):
        return None
    lists = [v for v in values if v is not None]
    if math.prod(len(v) for v in lists) > _ENUMERABLE:
        return None
    free = [
        combo for combo in itertools.product(*lists) if tuple(repr(x) for x in combo) not in held
    ]
    if not free:
        return None
    return dict(zip(names, rng.choice(free), strict=True))
