"""Choose the configuration to export from a study's feasible Pareto front.

An explicit policy picks it: ``max-throughput`` (subject to the study's SLOs, the default),
``min-ttft``, ``min-tpot``, ``knee``, ``weighted``, or an explicit trial number. Ties go to the
configuration that changes fewer defaults against the baseline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial

from optimizer.errors import ConfigError
from optimizer.report import changed_args
from optimizer.trial_view import TrialView, baseline_of, feasible_front

__all__ = ["POLICIES", "default_policy", "parse_weights", "select_trial"]

POLICIES = (
    "max-throughput",
    "max-capacity",
    "min-ttft",
    "min-tpot",
    "knee",
    "weighted",
    "trial",
)


def _metric_index(study: optuna.Study, metric: str) -> int:
    names = list(study.metric_names or [])
    if metric not in names:
        raise ConfigError(
            f"this study has no objective {metric!r} (objectives: {', '.join(names) or 'unnamed'})"
        )
    return names.index(metric)


def _knee(front: list[FrozenTrial], directions: Sequence[StudyDirection]) -> FrozenTrial:
    """The front point closest to the ideal point after min-max normalization."""
    values = [[float(v) for v in (t.values or ())] for t in front]
    normalized = []
    for j, d in enumerate(directions):
        col = [v[j] for v in values]
        lo, hi = min(col), max(col)
        span = (hi - lo) or 1.0
        # 0 = best, 1 = worst, whatever the direction.
        normalized.append(
            [((c - lo) / span) if d == StudyDirection.MINIMIZE else ((hi - c) / span) for c in col]
        )
    dist = [
        math.sqrt(sum(normalized[j][i] ** 2 for j in range(len(directions))))
        for i in range(len(front))
    ]
    return front[dist.index(min(dist))]


def parse_weights(items: Sequence[str]) -> dict[str, float]:
    """``OBJECTIVE=NUMBER`` items (``--weight``, the ``weight`` query value) as weights.

    Raises:
        ConfigError: An item without ``=`` or whose value is not a number.
    """
    weights: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            weights[key] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"weight {item!r}: expected OBJECTIVE=NUMBER")
    return weights


def default_policy(study: optuna.Study) -> str:
    """``max-capacity`` for a capacity study, ``max-throughput`` otherwise."""
    return "max-capacity" if "capacity_rps" in (study.metric_names or []) else "max-throughput"


def select_trial(
    study: optuna.Study,
    policy: str = "max-throughput",
    *,
    trial_number: int | None = None,
    weights: Mapping[str, float] | None = None,
) -> FrozenTrial:
    """Pick the configuration to export.

    Args:
        study: The study.
        policy: One of :data:`POLICIES`.
        trial_number: With ``trial``: the trial to export.
        weights: With ``weighted``: objective name -> weight; the score is the weighted sum of
            objectives normalized over the front (higher is better).

    Raises:
        ConfigError: Unknown policy, no feasible trial, or an unusable trial number.
    """
    trials = study.get_trials(deepcopy=False)
    # Ties: fewer changes against the baseline, feasible or not (its effective settings say
    # which flags are vLLM's own defaults).
    baseline = baseline_of(study)
    if policy == "trial":
        if trial_number is None or not 0 <= trial_number < len(trials):
            raise ConfigError(f"--trial {trial_number}: no such trial (0..{len(trials) - 1})")
        chosen = trials[trial_number]
        if not TrialView(chosen).measured:
            raise ConfigError(
                f"trial {trial_number} did not complete a measurement: nothing to export"
            )
        return chosen
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}")
    front = feasible_front(study)
    if not front:
        raise ConfigError(
            "no trial meets every SLO: nothing to export (relax the SLOs or tune longer)"
        )

    def fewer_changes(t: FrozenTrial) -> int:
        return len(changed_args(t, baseline))

    def best_by(metric: str, maximize: bool) -> FrozenTrial:
        i = _metric_index(study, metric)
        sign = -1.0 if maximize else 1.0
        return min(
            front, key=lambda t: (sign * float((t.values or [])[i]), fewer_changes(t), t.number)
        )

    if policy == "max-throughput":
        return best_by("output_throughput", maximize=True)
    if policy == "max-capacity":
        return best_by("capacity_rps", maximize=True)
    if policy == "min-ttft":
        return best_by("p95_ttft_ms", maximize=False)
    if policy == "min-tpot":
        return best_by("p95_tpot_ms", maximize=False)
    if policy == "knee":
        return _knee(sorted(front, key=lambda t: (fewer_changes(t), t.number)), study.directions)
    if not weights:
        raise ConfigError("the weighted policy needs weights, e.g. --weight output_throughput=2")
    names = list(study.metric_names or [])
    unknown = [k for k in weights if k not in names]
    if unknown:
        raise ConfigError(
            f"weights for unknown objectives {unknown}; objectives: {', '.join(names)}"
        )

    def score(t: FrozenTrial) -> float:
        total = 0.0
        for j, (name, d) in enumerate(zip(names, study.directions, strict=True)):
            col = [float((f.values or [])[j]) for f in front]
            lo, hi = min(col), max(col)
            x = (float((t.values or [])[j]) - lo) / ((hi - lo) or 1.0)
            total += weights.get(name, 0.0) * (1.0 - x if d == StudyDirection.MINIMIZE else x)
        return total

    return max(front, key=lambda t: (score(t), -fewer_changes(t), -t.number))
