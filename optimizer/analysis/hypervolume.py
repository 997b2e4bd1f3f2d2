"""Hypervolume of the feasible trials over the study's course, normalized by the baseline."""

from __future__ import annotations

import math

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.trial_view import TrialView

__all__ = ["hypervolume_history"]


def _hv_scales(trials: list[FrozenTrial]) -> list[float] | None:
    """Objective values the hypervolume is normalized by: the baseline's, or else the first
    measured trial's (None while no trial was measured)."""
    measured = sorted((t for t in trials if TrialView(t).measured), key=lambda t: t.number)
    ref = next((t for t in measured if TrialView(t).is_baseline), measured[0] if measured else None)
    if ref is None or not ref.values:
        return None
    return [abs(v) if math.isfinite(v) and v != 0 else 1.0 for v in ref.values]


def _hypervolume(
    points: list[list[float]], directions: list[optuna.study.StudyDirection], scales: list[float]
) -> float:
    """Hypervolume of feasible points, each objective divided by its scale (see
    :func:`hypervolume_history`)."""
    from optuna._hypervolume import compute_hypervolume

    ref = np.array([0.0 if d == optuna.study.StudyDirection.MAXIMIZE else 2.0 for d in directions])
    losses = []
    for p in points:
        loss = [
            -v / s if d == optuna.study.StudyDirection.MAXIMIZE else v / s
            for v, s, d in zip(p, scales, directions, strict=True)
        ]
        if all(x < r for x, r in zip(loss, ref, strict=True)):
            losses.append(loss)
    if not losses:
        return 0.0
    arr = np.array(losses, dtype=np.float64)
    if arr.shape[1] == 1:
        return float(ref[0] - arr[:, 0].min())
    return float(compute_hypervolume(arr, ref))


def hypervolume_history(
    trials: list[FrozenTrial], directions: list[optuna.study.StudyDirection]
) -> dict[int, float]:
    """Hypervolume of the feasible trials after each trial finished, keyed by trial number.

    Objectives are made dimensionless by dividing each by the baseline's value (or, when the
    baseline measured nothing, the first measured trial's), so the objectives' units do not
    weigh in and the baseline alone scores exactly 1.0. The reference point is twice the
    baseline for a minimized objective and zero for a maximized one: a configuration counts
    once it is less than twice as slow as the baseline on every latency and serves anything.
    The value after trial ``n`` covers the feasible trials that had finished by the time ``n``
    finished (completion order, which is what a live tracker sees, so rebuilding the history
    from the storage gives the same numbers).

    Args:
        trials: All trials of the study.
        directions: The study's directions.

    Returns:
        Trial number -> hypervolume, for every complete trial (empty without a measured trial).
    """
    scales = _hv_scales(trials)
    if scales is None:
        return {}
    done = sorted(
        (t for t in trials if t.state == TrialState.COMPLETE and t.datetime_complete),
        key=lambda t: (t.datetime_complete, t.number),
    )
    out: dict[int, float] = {}
    points: list[list[float]] = []
    for t in done:
        if TrialView(t).feasible and t.values:
            points.append(list(t.values))
        out[t.number] = _hypervolume(points, directions, scales)
    return out
