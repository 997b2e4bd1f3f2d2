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
  them) and are never measured here.

Everything else (storage writes, directions, the study's id) goes to the real study.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any, cast

import optuna
from optuna.distributions import BaseDistribution
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

    def __init__(self, inner: BaseSampler, priors: Sequence[FrozenTrial] = ()) -> None:
        numbers = [t.number for t in priors]
        if any(n >= 0 for n in numbers) or len(set(numbers)) != len(numbers):
            raise ValueError("prior trials need distinct numbers below zero")
        self.inner = inner
        self.priors = tuple(priors)

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
        return self.inner.sample_relative(self._view(study), trial, search_space)

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
