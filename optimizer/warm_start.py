"""Warm start: a new study begins with the best configurations of earlier studies.

A job may name earlier study folders (``warm_start.studies``: the same model, a similar trace).
From each, the ``top`` best measured configurations (a single objective: by its value, the
best first; several: the feasible Pareto front first, then the other feasible trials by the
first objective) are enqueued right after the baseline, restricted to the flags of this
study's search space. A configuration outside this space (a value it cannot take) is skipped
with a note, as is one already enqueued.

They are measured again here, on this study's trace and machine, and told like every other
trial. With ``priors`` (the default) a model-based sampler (TPE, GP) also gets the earlier
studies' told trials as prior observations (:func:`prior_trials`, given through
:class:`optimizer.sampling.KnowledgeSampler`): each rebuilt on this study's search space with the
values it was told there (a failure's placeholder too: it teaches the sampler what crashed), so
the sampler's startup and its split into good and bad configurations begin from what the
earlier studies learnt. Only studies with the same objectives (names and directions) and SLOs
qualify, and only trials whose configuration this space can express. The values come from another
trace or machine: comparable only as the job's "same model, a similar trace" promises, which is
why the best of them are measured again. No meta-learning sampler is shipped (OptunaHub's
needs network access to load). plan.json and report.md say where each warm-start
configuration came from and how many prior trials the sampler was given.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.errors import ConfigError, SearchSpaceError
from optimizer.study_folder import storage_url_of
from optimizer.trial_view import TrialView
from search_spaces import SearchSpace

__all__ = ["Priors", "WarmStart", "prior_trials", "warm_start_configs"]


@dataclass(frozen=True)
class WarmStart:
    """One configuration taken from an earlier study.

    Attributes:
        folder: The earlier study's folder, as the job names it.
        trial: Its trial number there.
        args: Engine arguments enqueued here (the flags of this study's space).
        measured: What it measured there, e.g. ``capacity_rps 1.5``.
    """

    folder: str
    trial: int
    args: dict[str, Any]
    measured: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "trial": self.trial,
            "args": self.args,
            "measured": self.measured,
        }


def warm_start_configs(
    folders: list[str], base: Path, top: int, space: SearchSpace
) -> tuple[list[WarmStart], list[str]]:
    """The configurations to enqueue and one note per one skipped.

    Raises:
        ConfigError: A folder is not a study folder, or its study cannot be opened.
    """
    out: list[WarmStart] = []
    notes: list[str] = []
    seen: set[str] = set()
    for i, name in enumerate(folders):
        folder = (base / name).resolve()
        study, _plan = _open(folder, f"warm_start.studies[{i}]")
        for trial in _best(study, top):
            view = TrialView(trial)
            try:
                params = space.enqueue_params(view.engine_args)
            except SearchSpaceError as exc:
                notes.append(f"warm start: {name} trial {trial.number} skipped: {exc}")
                continue
            args = {k: v for k, v in view.engine_args.items() if k in params}
            key = json.dumps(args, sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            out.append(WarmStart(name, trial.number, args, _measured(study, trial)))
    return out, notes


def _open(folder: Path, key: str) -> tuple[optuna.Study, dict[str, Any]]:
    """An earlier study and its plan.json."""
    plan_file = folder / "plan.json"
    if not plan_file.is_file():
        raise ConfigError(
            f"{key}: {folder} is not a study folder (no plan.json); name a folder "
            "`vllm-autotune tune` wrote"
        )
    plan = json.loads(plan_file.read_text())
    try:
        study = optuna.load_study(study_name=plan["study"], storage=storage_url_of(plan, folder))
    except Exception as exc:  # a missing or foreign storage: say which, no traceback
        raise ConfigError(
            f"{key}: cannot open the study in {folder}: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    return study, plan


def _best(study: optuna.Study, top: int) -> list[FrozenTrial]:
    """The best measured, feasible trials, best first."""
    feasible = [t for t in study.get_trials(deepcopy=False) if TrialView(t).feasible]
    sign = [1.0 if d == optuna.study.StudyDirection.MAXIMIZE else -1.0 for d in study.directions]

    def score(t: FrozenTrial) -> float:
        value = (t.values or [math.nan])[0]
        return -math.inf if value is None or math.isnan(value) else sign[0] * value

    front = {t.number for t in study.best_trials} if len(study.directions) > 1 else set()
    ordered = sorted(feasible, key=lambda t: (t.number not in front, -score(t), t.number))
    return [t for t in ordered if not TrialView(t).is_baseline][:top]


def _measured(study: optuna.Study, trial: FrozenTrial) -> str:
    names = study.metric_names or [f"objective {i}" for i in range(len(study.directions))]
    values = trial.values or []
    return ", ".join(f"{n} {v:.4g}" for n, v in zip(names, values, strict=False))


@dataclass(frozen=True)
class Priors:
    """Earlier studies' told trials, rebuilt on this study's search space.

    Attributes:
        trials: Complete trials, each numbered -1 (see :func:`_prior`): params and
            distributions of this space, the values and constraints told there, in the order
            the studies are named.
        per_study: ``{folder: trials taken}``, as the job names the folders.
        notes: One line per study or trial left out, and why.
    """

    trials: tuple[FrozenTrial, ...] = ()
    per_study: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"trials": len(self.trials), "per_study": self.per_study, "notes": list(self.notes)}


def prior_trials(
    folders: list[str],
    base: Path,
    space: SearchSpace,
    objectives: list[tuple[str, optuna.study.StudyDirection]],
    slos: list[str],
) -> Priors:
    """The told trials of the earlier studies in ``folders`` as prior observations.

    Each keeps the values and the constraints (SLO margins) it was told there, so a sampler
    that reads constraints (GP) sees the same kind of trial as this study's.

    Args:
        folders: Study folders, relative to ``base``.
        space: This study's search space (the trials are rebuilt on it).
        objectives: This study's (metric, direction) pairs, in order.
        slos: This study's SLOs as written (its constraints, in order).

    Raises:
        ConfigError: A folder is not a study folder, or its study cannot be opened.
    """
    trials: list[FrozenTrial] = []
    per_study: dict[str, int] = {}
    notes: list[str] = []
    for i, name in enumerate(folders):
        folder = (base / name).resolve()
        study, plan = _open(folder, f"warm_start.studies[{i}]")
        theirs = list(zip(study.metric_names or [], study.directions, strict=False))
        their_slos = plan.get("slos", [])
        why = ""
        if theirs != objectives:
            why = (
                f"its objectives {_objectives_text(theirs)} are not this study's "
                f"{_objectives_text(objectives)}"
            )
        elif their_slos != slos:
            why = f"its SLOs {their_slos} are not this study's {slos}"
        if why:
            notes.append(f"warm start: {name}: no prior trials for the sampler: {why}")
            continue
        taken = [p for t in study.get_trials(deepcopy=False) if (p := _prior(space, t, name))]
        trials += taken
        per_study[name] = len(taken)
    return Priors(tuple(trials), per_study, tuple(notes))


def _prior(space: SearchSpace, trial: FrozenTrial, name: str) -> FrozenTrial | None:
    """One told trial rebuilt on ``space``, numbered -1 (None: not a told tuned trial, or a
    configuration this space cannot express).

    Every prior is numbered -1: below every trial of a study, and the same for all, because
    Optuna's intersection search space scans trials from the newest back and stops at the
    first number below its cursor (-1 at first): a prior numbered -2 would end its scan.
    """
    view = TrialView(trial)
    if trial.state != TrialState.COMPLETE or view.is_baseline or not trial.values:
        return None
    rebuilt = _on_space(space, view.engine_args)
    if rebuilt is None:
        return None
    params, distributions = rebuilt
    try:
        prior = optuna.trial.create_trial(
            params=params,
            distributions=distributions,
            values=list(trial.values),
            constraints=dict(trial.constraints) if trial.constraints else None,
            user_attrs={"prior_from": f"{name} trial {trial.number}"},
        )
    except ValueError:  # a value off the space's grid (a step it does not lie on)
        return None
    prior.number = -1
    return prior


def _on_space(
    space: SearchSpace, args: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A configuration's params and distributions on ``space`` (None: it cannot say it: a value
    outside the space or off its step grid, or an active param it does not set)."""
    try:
        params = space.enqueue_params(args)
    except SearchSpaceError:
        return None
    trial = optuna.trial.FixedTrial(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FixedTrial warns of an off-grid value: checked below
        try:
            space.suggest(trial)
        except ValueError:
            return None  # an active param the earlier trial never had a value for
    for key, dist in trial.distributions.items():
        if not dist._contains(dist.to_internal_repr(trial.params[key])):
            return None
    return dict(trial.params), dict(trial.distributions)


def _objectives_text(pairs: list[tuple[str, optuna.study.StudyDirection]]) -> str:
    return (
        ", ".join(
            f"{'max' if d == optuna.study.StudyDirection.MAXIMIZE else 'min'}:{n}" for n, d in pairs
        )
        or "(none)"
    )
