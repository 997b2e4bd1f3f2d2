"""Warm start: a new study begins with the best configurations of earlier studies.

A job may name earlier study folders (``warm_start.studies``: the same model, a similar trace).
From each, the ``top`` best measured configurations (a single objective: by its value, the
best first; several: the feasible Pareto front first, then the other feasible trials by the
first objective) are enqueued right after the baseline, restricted to the flags of this
study's search space. A configuration outside this space (a value it cannot take) is skipped
with a note, as is one already enqueued.

What the sampler learns from them is what it learns from any trial: they are measured again
here, on this study's trace and machine, and told like every other trial. The earlier trials
themselves are not given to the sampler as observations (no meta-learning sampler is
shipped: OptunaHub's needs network access to load); plan.json and report.md say where each
warm-start configuration came from.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from optimizer.errors import ConfigError, SearchSpaceError
from optimizer.study_folder import storage_url_of
from optimizer.trial_view import TrialView
from search_spaces import SearchSpace

__all__ = ["WarmStart", "warm_start_configs"]


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
        study = _open(folder, f"warm_start.studies[{i}]")
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


def _open(folder: Path, key: str) -> optuna.Study:
    plan_file = folder / "plan.json"
    if not plan_file.is_file():
        raise ConfigError(
            f"{key}: {folder} is not a study folder (no plan.json); name a folder "
            "`vllm-autotune tune` wrote"
        )
    plan = json.loads(plan_file.read_text())
    try:
        return optuna.load_study(study_name=plan["study"], storage=storage_url_of(plan, folder))
    except Exception as exc:  # a missing or foreign storage: say which, no traceback
        raise ConfigError(
            f"{key}: cannot open the study in {folder}: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None


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
