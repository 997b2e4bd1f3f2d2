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
best point, which the driver would refuse as a duplicate (no server starts, the trial count is
spent). When the model's proposal repeats a held configuration, the wrapper takes **the model's
best-scoring free configuration**: its own acquisition (TPE's log l(x) - log g(x), GP's
acquisition function) evaluated over the configurations nobody holds (every one of them where
the space lists, else a few hundred free random draws), never a plain random draw while the
model can score; only where the model cannot score (too few trials for it) is a free random
draw taken. The GP on a listed space of at most a few thousand configurations proposes
exactly: its acquisition, fitted once, is evaluated on every configuration (in place of Optuna's
search of the space, which is approximate and costs more), and its best one is taken where
nobody holds it (``model``), else its best free one (``acquisition``). During the sampler's
startup (its own random draws) the draws skip the held configurations the same way. Every
proposal's origin is counted in :attr:`KnowledgeSampler.origins` and stored on its trial
(system attr :data:`ORIGIN_ATTR`): ``startup`` (the sampler's own random start), ``model`` (its
proposal, free as proposed), ``acquisition`` (its best free configuration in place of a held
one), ``random`` (a free random draw in place of a held one), ``enqueued`` (a configuration
fixed before the trial: the baseline, a warm start's), ``guided`` (the tuning guide's move,
:mod:`optimizer.guided`). A conditional space (``when``) is not covered: a proposal there is
compared on the params every trial sets, which few trials hold.

Everything else (storage writes, directions, the study's id) goes to the real study.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import warnings
from collections import Counter
from collections.abc import Container, Sequence
from typing import Any, cast

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler, GPSampler, TPESampler
from optuna.trial import FrozenTrial, TrialState

__all__ = [
    "MODEL_SAMPLERS",
    "ORIGINS",
    "ORIGIN_ATTR",
    "KnowledgeSampler",
    "as_priors",
    "free_draw",
    "model_sampler",
    "note_origin",
]

MODEL_SAMPLERS = ("tpe", "gp", "rf", "guided")
"""Samplers that learn from trials (and so from a warm start's priors; ``guided`` hands over to
TPE; ``rf`` is :class:`optimizer.rf_sampler.RFSampler`, which takes them itself)."""

ORIGIN_ATTR = "vllm_autotune:origin"
"""The trial system attr that says where its configuration came from (one of :data:`ORIGINS`)."""

_TPE_KEY = "tpe:relative_params"  # optuna.samplers._tpe.sampler._RELATIVE_PARAMS_KEY
_GP_KEY = "gp:relative_params"  # optuna.samplers._gp.sampler._RELATIVE_PARAMS_KEY

ORIGINS = ("startup", "model", "acquisition", "random", "enqueued", "guided")
"""Where a proposal came from (see the module docstring)."""


def model_sampler(
    name: str,
    seed: int | None,
    n_startup_trials: int,
    priors: Sequence[FrozenTrial] = (),
) -> KnowledgeSampler:
    """TPE or GP as every study runs them, wrapped in :class:`KnowledgeSampler`.

    TPE is multivariate with groups (conditional params form separate groups) and a constant
    liar (parallel trials do not propose the same configuration). Both can score a list of
    free configurations with their own acquisition (:meth:`_FreeTPESampler.best_of`,
    :meth:`_FreeGPSampler.best_of`).
    """
    inner: BaseSampler
    if name == "gp":
        inner = _FreeGPSampler(seed=seed, n_startup_trials=n_startup_trials)
    elif name == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            inner = _FreeTPESampler(
                seed=seed,
                multivariate=True,
                group=True,
                constant_liar=True,
                n_startup_trials=n_startup_trials,
            )
    else:
        raise ValueError(f"{name!r} is not 'tpe' or 'gp'")
    return KnowledgeSampler(inner, priors, seed=seed)


class _FreeTPESampler(TPESampler):
    """Optuna's TPE that can also score given configurations with its acquisition."""

    relative_key = _TPE_KEY

    def best_of(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        candidates: Sequence[dict[str, Any]],
    ) -> dict[str, Any] | None:
        """The candidate with the highest log l(x) - log g(x) (TPE's acquisition, its
        estimators built as for its own proposal), or None before its startup ends."""
        told = study._get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if not candidates or len(told) < self._n_startup_trials:
            return None
        below, above = self._estimators(study, trial, space)
        samples = {
            name: np.asarray([dist.to_internal_repr(c[name]) for c in candidates], dtype=float)
            for name, dist in space.items()
        }
        scores = self._compute_acquisition_func(samples, below, above)
        chosen = dict(candidates[int(np.argmax(scores))])
        if self._constant_liar:
            # Parallel workers read a running trial's proposal from these attrs, which hold the
            # held configuration TPE first proposed: the replacement goes in its place.
            store_relative(study, trial, chosen, self.relative_key)
        return chosen

    def _estimators(
        self, study: optuna.Study, trial: FrozenTrial, space: dict[str, BaseDistribution]
    ) -> tuple[Any, Any]:
        """l(x) and g(x) exactly as :meth:`TPESampler._sample` builds them (Optuna 5)."""
        from optuna.samplers._tpe.sampler import (
            _split_trials,
            default_gamma,
            default_gamma_multiobjective,
        )

        states = [TrialState.COMPLETE, TrialState.PRUNED]
        if self._constant_liar:
            states.append(TrialState.RUNNING)
        trials = [
            t
            for t in study._get_trials(deepcopy=False, states=states, use_cache=False)
            if t.number != trial.number
        ]
        if self._gamma is None:
            multi = len(study.directions) > 1
            self._gamma = default_gamma_multiobjective if multi else default_gamma
        n = sum(t.state != TrialState.RUNNING for t in trials)
        below, above = _split_trials(study, trials, self._gamma(n))
        return (
            self._build_parzen_estimator(study, space, below, handle_below=True),
            self._build_parzen_estimator(study, space, above, handle_below=False),
        )


class _FreeGPSampler(GPSampler):
    """Optuna's GP sampler that can also score given configurations with its acquisition."""

    relative_key = _GP_KEY
    _candidates: Sequence[dict[str, Any]] | None = None
    _candidate_space: dict[str, BaseDistribution] | None = None
    _order: np.ndarray | None = None

    def rank(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        candidates: Sequence[dict[str, Any]],
    ) -> list[dict[str, Any]] | None:
        """The candidates in the order of the GP's acquisition, highest first, or None before
        its startup ends. One fit, as for its own proposal: :meth:`_optimize_acqf` evaluates
        the candidates instead of searching the space (a stable sort: ties keep the
        candidates' order)."""
        if not candidates:
            return None
        self._candidates, self._candidate_space, self._order = candidates, space, None
        try:
            params = self.sample_relative(study, trial, space)
        finally:
            self._candidates = self._candidate_space = None
        if not params or self._order is None:
            return None
        return [dict(candidates[i]) for i in self._order]

    def best_of(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        candidates: Sequence[dict[str, Any]],
    ) -> dict[str, Any] | None:
        """The candidate with the highest acquisition (the GP fitted as for its own proposal),
        or None before its startup ends; stored as the trial's proposal for parallel workers."""
        ranked = self.rank(study, trial, space, candidates)
        if not ranked:
            return None
        store_relative(study, trial, ranked[0], self.relative_key)
        return ranked[0]

    def _optimize_acqf(self, acqf: Any, best_params: np.ndarray | None) -> np.ndarray:
        if self._candidates is None or self._candidate_space is None:
            return super()._optimize_acqf(acqf, best_params)
        from optuna._gp.search_space import SearchSpace

        cands = self._candidates
        # Optuna reads only len(trials) where the params are given: no trial objects needed.
        normalized = SearchSpace(self._candidate_space).get_normalized_params(
            cast(list[FrozenTrial], [None] * len(cands)), [dict(c) for c in cands]
        )
        scores = np.asarray(acqf.eval_acqf_no_grad(normalized), dtype=float)
        self._order = np.argsort(-scores, kind="stable")
        return cast(np.ndarray, normalized[self._order[0]])


def store_relative(
    study: optuna.Study, trial: FrozenTrial, params: dict[str, Any], key: str
) -> None:
    """Store ``params`` as the trial's relative proposal under ``key`` (the system attrs where
    Optuna's TPE, ``tpe:relative_params``, and GP, ``gp:relative_params``, read a running
    trial's configuration: the constant liar, qLogEI), in place of a held configuration first
    proposed."""
    from optuna.samplers._tpe.sampler import _SYSTEM_ATTR_MAX_LENGTH

    text = json.dumps(params)
    for i in range(0, len(text), _SYSTEM_ATTR_MAX_LENGTH):
        study._storage.set_trial_system_attr(
            trial._trial_id,
            f"{key}:{i // _SYSTEM_ATTR_MAX_LENGTH}",
            text[i : i + _SYSTEM_ATTR_MAX_LENGTH],
        )


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


def as_priors(priors: Sequence[FrozenTrial]) -> tuple[FrozenTrial, ...]:
    """A warm start's prior trials as a model-based sampler keeps them (this module's
    :class:`KnowledgeSampler`, :class:`optimizer.rf_sampler.RFSampler`): numbered below zero, so
    they never meet a trial of the study (ValueError otherwise)."""
    if any(t.number >= 0 for t in priors):
        raise ValueError("prior trials need numbers below zero (-1: see warm_start._prior)")
    return tuple(priors)


class KnowledgeSampler(BaseSampler):
    """Optuna's ``inner`` sampler, shown the study without param-less trials and with
    ``priors`` before its own trials (see the module docstring).

    Args:
        inner: A model-based sampler (TPE, GP).
        priors: Finished trials of earlier studies on this search space, numbered -1.
    """

    candidates = 512
    """Free random draws the model scores where the space is too large (or continuous) to list."""

    def __init__(
        self, inner: BaseSampler, priors: Sequence[FrozenTrial] = (), seed: int | None = None
    ) -> None:
        self.inner = inner
        self.priors = as_priors(priors)
        self._rng = random.Random(seed)
        self._random = optuna.samplers.RandomSampler(seed=seed)
        self.origins: Counter[str] = Counter()
        """Proposals by origin (:data:`ORIGINS`), for reports, tests and benchmarks."""

    @property
    def replaced(self) -> int:
        """Proposals of a held configuration replaced by a free one (acquisition or random)."""
        return self.origins["acquisition"] + self.origins["random"]

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
        if "fixed_params" in trial.system_attrs:
            return {}  # counted in before_trial (its params may never ask the sampler)
        view = self._view(study)
        ranked = self._ranked(view, trial, search_space)
        if ranked is not None:
            return self._first_free(study, trial, search_space, ranked)
        params = self.inner.sample_relative(view, trial, search_space)
        if not search_space or (params and set(params) != set(search_space)):
            if not params:
                self._note(study, trial, "startup")  # independent draws (the first trial)
            return params
        held = _held(study, trial, search_space)
        if not params:
            # The sampler's startup (its independent random draws): the same random law, over
            # the configurations nobody holds.
            self._note(study, trial, "startup")
            return (self._free(study, trial, search_space, held) if held else None) or params
        if _key(params, search_space) not in held:
            self._note(study, trial, "model")
            return params
        best = self._best_free(view, study, trial, search_space, held)
        if best is not None:
            self._note(study, trial, "acquisition")
            return best
        free = self._free(study, trial, search_space, held)
        if free is None:
            self._note(study, trial, "model")
            return params  # every configuration is held (or none free was found)
        self._note(study, trial, "random")
        return free

    def _note(self, study: optuna.Study, trial: FrozenTrial, origin: str) -> None:
        note_origin(self.origins, study, trial, origin)

    def _ranked(
        self, view: optuna.Study, trial: FrozenTrial, space: dict[str, BaseDistribution]
    ) -> list[dict[str, Any]] | None:
        """Every configuration of a listed space in the model's order (its acquisition, one
        fit), where the model ranks (GP) and its startup is over; else None. Shuffled first, so
        that ties fall at random."""
        rank = getattr(self.inner, "rank", None)
        if rank is None or not space:
            return None
        every = _free_list(space, set(), limit=_RANKED)
        if not every:
            return None
        self._rng.shuffle(every)
        return cast("list[dict[str, Any]] | None", rank(view, trial, space, every))

    def _first_free(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        ranked: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The model's exact proposal over a listed space: its best configuration where nobody
        holds it (``model``), else its best free one (``acquisition``), else (all held) its
        best."""
        held = _held(study, trial, space)
        for i, params in enumerate(ranked):
            if _key(params, space) not in held:
                self._note(study, trial, "model" if i == 0 else "acquisition")
                if i:
                    store_relative(study, trial, params, cast(Any, self.inner).relative_key)
                return params
        self._note(study, trial, "model")
        return ranked[0]

    def _best_free(
        self,
        view: optuna.Study,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        held: set[tuple[Any, ...]],
    ) -> dict[str, Any] | None:
        """The model's best-scoring configuration nobody holds (None: the model cannot score,
        or none is free). Candidates are every free configuration where the space lists, else
        :attr:`candidates` free random draws; shuffled, so that ties fall at random."""
        best_of = getattr(self.inner, "best_of", None)
        if best_of is None:
            return None
        free = _free_list(space, held)
        if free is None:
            draws = (self._free(study, trial, space, held) for _ in range(self.candidates))
            free = [d for d in draws if d is not None]
        self._rng.shuffle(free)
        return cast("dict[str, Any] | None", best_of(view, trial, space, free))

    def _free(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        held: set[tuple[Any, ...]],
    ) -> dict[str, Any] | None:
        return free_draw(self._random, self._rng, study, trial, space, held)

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
        if "fixed_params" in trial.system_attrs:
            self._note(study, trial, "enqueued")
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
_RANKED = 4_096
"""The most configurations a listed space may have for the GP to rank them all (its acquisition
evaluated on each: exact, and cheaper than Optuna's search of the space); a larger one is
searched by Optuna, a held proposal replaced by its best of :attr:`KnowledgeSampler.candidates`
free draws."""


def note_origin(
    origins: Counter[str], study: optuna.Study, trial: FrozenTrial, origin: str
) -> None:
    """Count a proposal's origin (one of :data:`ORIGINS`) and store it on its trial."""
    origins[origin] += 1
    study._storage.set_trial_system_attr(trial._trial_id, ORIGIN_ATTR, origin)


def free_draw(
    sampler: optuna.samplers.RandomSampler,
    rng: random.Random,
    study: optuna.Study,
    trial: FrozenTrial,
    space: dict[str, BaseDistribution],
    held: set[tuple[Any, ...]],
) -> dict[str, Any] | None:
    """A configuration nobody holds: ``sampler``'s random draws (log scales kept) until one is
    free; when the space is nearly all held, uniformly (``rng``) among the free ones listed
    (None: none is free)."""
    names = sorted(space)
    for _ in range(_DRAWS):
        draw = {n: sampler.sample_independent(study, trial, n, space[n]) for n in names}
        if _key(draw, space) not in held:
            return draw
    free = _free_list(space, held)
    return rng.choice(free) if free else None


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


def _free_list(
    space: dict[str, BaseDistribution], held: set[tuple[Any, ...]], limit: int = _ENUMERABLE
) -> list[dict[str, Any]] | None:
    """Every configuration of ``space`` nobody holds (None: the space is continuous or has more
    than ``limit`` configurations)."""
    names = sorted(space)
    values = [_values(space[n]) for n in names]
    lists = [v for v in values if v is not None]
    if len(lists) < len(values) or math.prod(len(v) for v in lists) > limit:
        return None
    free = []
    for combo in itertools.product(*lists):
        point = dict(zip(names, combo, strict=True))
        if _key(point, space) not in held:
            free.append(point)
    return free
