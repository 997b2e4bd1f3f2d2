"""The feasible Pareto front beside the baseline, as documents: classes, table, CSV, importances.

Every trial falls in one class (:func:`trial_class`): ``pareto``, ``dominated``, ``slo_missed``
(measured, an SLO missed), or the status of a trial that measured nothing (``failed``,
``rejected``, ...). :func:`front_doc` is the front with its gain over the baseline per
objective (from :func:`optimizer.report.front_rows`); :func:`importances` ranks parameters per
objective with Optuna's default evaluator.
"""

from __future__ import annotations

import csv
import io
import math
import warnings
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.report import front_rows
from optimizer.trial_view import TrialView, feasible_front, metric_names

__all__ = [
    "FAILED_STATUSES",
    "best_gains",
    "finite",
    "front_csv",
    "front_doc",
    "front_numbers",
    "importances",
    "trial_class",
]


#: Statuses of trials whose engine or replay produced no measurement.
FAILED_STATUSES = ("failed", "invalid_replay", "driver_died")


def front_numbers(study: optuna.Study) -> set[int]:
    """Numbers of the feasible Pareto front's trials."""
    return {t.number for t in feasible_front(study)}


def trial_class(t: FrozenTrial, front: set[int]) -> str:
    """pareto, dominated, slo_missed, or the status of a trial that measured nothing."""
    status = TrialView(t).status
    if status in ("rejected", *FAILED_STATUSES) or t.state != TrialState.COMPLETE:
        return status
    if not TrialView(t).feasible:
        return "slo_missed"
    return "pareto" if t.number in front else "dominated"


def finite(value: Any) -> float | None:
    """A finite number as float; None for NaN, infinities, booleans and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def front_doc(study: optuna.Study) -> list[dict[str, Any]]:
    names = metric_names(study)
    trials = study.get_trials(deepcopy=False)
    out = []
    for row in front_rows(study):
        out.append(
            {
                "trial": row.number,
                "baseline": row.baseline,
                "feasible": row.feasible,
                "values": dict(zip(names, row.values, strict=False)),
                "gain_pct": dict(zip(names, row.gains_pct, strict=False)),
                "changed": row.changed,
                "engine_args": TrialView(trials[row.number]).engine_args,
            }
        )
    return out


def best_gains(doc: list[dict[str, Any]]) -> dict[str, tuple[float, int]]:
    """Per objective, the front's largest gain over the baseline (percent, positive = better)
    and the trial that has it; objectives without a comparable value are left out.

    Args:
        doc: :func:`front_doc`.
    """
    out: dict[str, tuple[float, int]] = {}
    for row in doc:
        if row["baseline"]:
            continue
        for name, gain in row["gain_pct"].items():
            if gain is None or not math.isfinite(gain):
                continue
            if name not in out or gain > out[name][0]:
                out[name] = (float(gain), int(row["trial"]))
    return out


def front_csv(study: optuna.Study, doc: list[dict[str, Any]]) -> str:
    names = metric_names(study)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(
        ["trial", "baseline", "feasible", *names, *(f"gain_pct_{n}" for n in names), "changed"]
    )
    for r in doc:
        w.writerow(
            [
                r["trial"],
                r["baseline"],
                r["feasible"],
                *(r["values"].get(n) for n in names),
                *("" if r["gain_pct"].get(n) is None else r["gain_pct"][n] for n in names),
                "; ".join(f"{k}={v}" for k, v in sorted(r["changed"].items())),
            ]
        )
    return buf.getvalue()


def importances(study: optuna.Study) -> dict[str, Any]:
    """Importances per objective (Optuna's default evaluator) over feasible measured trials.

    Needs at least 2 such trials with parameters; otherwise (or when the evaluator refuses,
    e.g. every value equal) the entry explains why.
    """
    usable = [t for t in study.get_trials(deepcopy=False) if TrialView(t).feasible]
    usable = [t for t in usable if t.params]
    if len(usable) < 2:
        return {"note": f"{len(usable)} feasible trials with parameters; importances need 2"}
    tmp = optuna.create_study(directions=study.directions)
    tmp.add_trials(usable)
    out: dict[str, Any] = {}
    for i, name in enumerate(metric_names(study)):
        try:
            sign = -1.0 if study.directions[i] == optuna.study.StudyDirection.MAXIMIZE else 1.0

            def target(t: FrozenTrial, i: int = i, sign: float = sign) -> float:
                return sign * float(t.values[i])  # evaluators rank params for low targets

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name] = optuna.importance.get_param_importances(tmp, target=target)
        except Exception as exc:  # too few distinct values, a constant target, ...
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out
