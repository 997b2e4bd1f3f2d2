"""Terminal reports on a study: the feasible Pareto front beside the baseline, with the gain
over it (:func:`front_rows`, also the rows of :mod:`optimizer.analysis.front`'s documents), and
the study's status.

Reads only the Optuna storage (the study's source of truth), so ``vllm-autotune show`` works
for a running study, a finished one, and one whose driver died.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.table import Table

from optimizer.trial_view import TrialView, baseline_of, feasible_front, metric_names

__all__ = [
    "FrontRow",
    "StudyStatus",
    "changed_args",
    "front_rows",
    "front_table",
    "gain_pct",
    "status_table",
    "study_slos",
    "study_status",
]

# Without SLOs every told trial carries this one constraint (optimizer.study): not an SLO.
_SERVED = "engine_served"
# Statuses of trials whose engine never served the trace: no SLO was measured.
_NOT_RUN = (
    "rejected",
    "duplicate",
    "failed",
    "cancelled",
    "driver_died",
    "invalid_replay",
    "lost",
)


@dataclass(frozen=True)
class FrontRow:
    """One configuration of the report.

    Attributes:
        number: Trial number.
        baseline: True for the baseline row.
        values: Objective values, in the study's objective order.
        gains_pct: Improvement over the baseline per objective, in percent (positive = better).
        changed: Engine arguments that differ from the baseline's.
        feasible: All SLOs met.
    """

    number: int
    baseline: bool
    values: tuple[float, ...]
    gains_pct: tuple[float | None, ...]
    changed: dict[str, Any]
    feasible: bool


def gain_pct(value: float, base: float, direction: optuna.study.StudyDirection) -> float | None:
    """Improvement of ``value`` over ``base`` in percent; positive is better either way."""
    if base == 0 or math.isnan(base) or math.isnan(value):
        return None
    change = (value - base) / abs(base) * 100.0
    return -change if direction == optuna.study.StudyDirection.MINIMIZE else change


# Flags whose field in the engine's config line has another name.
_EFFECTIVE_ALIASES = {"max_model_len": "max_seq_len"}


def _same_as_logged(value: Any, logged: str) -> bool:
    """True when a flag value equals the text vLLM logged for the field."""
    if isinstance(value, bool):
        return logged in ("True", "False") and (logged == "True") == value
    if value is None:
        return logged == "None"
    if isinstance(value, int | float):
        try:
            return float(logged) == float(value)
        except ValueError:
            return False
    if isinstance(value, str):
        return value in (logged, logged.removeprefix("torch."))
    return False


def changed_args(trial: FrozenTrial, baseline: FrozenTrial | None) -> dict[str, Any]:
    """Engine arguments of ``trial`` that change what the baseline ran with.

    A flag the baseline left unset counts as changed unless the baseline's engine reported the
    same value as its effective setting (``effective_config``: vLLM's own default there, e.g.
    ``enable-prefix-caching=True`` on a build that enables it anyway). Flags whose default vLLM
    does not report (``max-num-seqs``, ...) count as changed.
    """
    base = TrialView(baseline).engine_args if baseline else {}
    effective = TrialView(baseline).effective_config if baseline else {}
    out = {}
    for k, v in TrialView(trial).engine_args.items():
        if k in base:
            if base[k] != v:
                out[k] = v
            continue
        field = k.replace("-", "_")
        logged = effective.get(_EFFECTIVE_ALIASES.get(field, field))
        if logged is None or not _same_as_logged(v, logged):
            out[k] = v
    return out


def front_rows(study: optuna.Study) -> list[FrontRow]:
    """The baseline (first) and the feasible Pareto front, by trial number."""
    # Failed, early-stopped (infeasible) and rejected trials are told placeholder worst values
    # so the sampler avoids them; those are no measurement and are never shown or compared.
    base = baseline_of(study, measured=True)
    base_args = TrialView(base).engine_args if base else {}
    rows = []
    front = feasible_front(study)
    for t in ([base] if base else []) + sorted(front, key=lambda t: t.number):
        if t is None or (t is not base and base is not None and t.number == base.number):
            continue
        values = tuple(float(v) if TrialView(t).measured else math.nan for v in (t.values or ()))
        base_values = (
            base.values
            if base and base.values and TrialView(base).measured
            else [math.nan] * len(values)
        )
        gains: tuple[float | None, ...] = tuple(
            gain_pct(v, b, d)
            for v, b, d in zip(values, base_values, study.directions, strict=False)
        )
        args = TrialView(t).engine_args
        changed = changed_args(t, base)
        changed.update({k: "(default)" for k in base_args if k not in args})
        rows.append(
            FrontRow(
                number=t.number,
                baseline=t is base,
                values=values,
                gains_pct=gains,
                changed=changed if t is not base else {},
                feasible=TrialView(t).feasible,
            )
        )
    return rows


def study_slos(study: optuna.Study) -> list[str]:
    """The study's SLOs, as its trials were told them (constraint names), in order."""
    told = (t for t in study.get_trials(deepcopy=False) if t.constraints)
    first = next(told, None)
    return [k for k in first.constraints if k != _SERVED] if first is not None else []


def _missed(trial: FrozenTrial) -> list[str]:
    return [k for k, v in TrialView(trial).slo_verdicts().items() if not v and k != _SERVED]


def _slo_caption(study: optuna.Study) -> str:
    slos = study_slos(study)
    return "SLOs: " + (", ".join(slos) if slos else "none (feasible: the engine served)")


def front_table(study: optuna.Study, title: str = "Pareto front (feasible) vs baseline") -> Table:
    """The front as a rich table: values, gain over the baseline, what changed."""
    table = Table(
        title=title,
        caption=_slo_caption(study)
        + ". (+x%) better than the baseline, (-x%) worse; ↓ lower is better, ↑ higher is better",
    )
    table.add_column("trial", justify="right")
    names = metric_names(study)
    for name, d in zip(names, study.directions, strict=True):
        arrow = "↓" if d == optuna.study.StudyDirection.MINIMIZE else "↑"
        table.add_column(f"{name} {arrow}", justify="right")
    table.add_column("changed vs baseline", overflow="fold")
    base = baseline_of(study, measured=True)
    for row in front_rows(study):
        cells = []
        for v, g in zip(row.values, row.gains_pct, strict=True):
            text = "-" if math.isnan(v) else f"{v:,.1f}"
            if not row.baseline and g is not None:
                text += f" ({g:+.0f}%)"
            cells.append(text)
        label = f"{row.number} (baseline)" if row.baseline else str(row.number)
        if row.baseline and not row.feasible:
            missed = _missed(base) if base is not None else []
            label += " ✗SLO" + (f" missed: {', '.join(missed)}" if missed else "")
            if all(math.isnan(v) for v in row.values):
                status = TrialView(base).status if base is not None else "-"
                label += f" ({status})"
        changed = ", ".join(f"{k}={v}" for k, v in sorted(row.changed.items())) or "-"
        table.add_row(label, *cells, changed if not row.baseline else "vLLM defaults")
    return table


@dataclass(frozen=True)
class StudyStatus:
    """Counts and bests of a study, for progress displays and the API."""

    done: int
    running: int
    failed: int
    infeasible: int
    front_size: int
    best: dict[str, float]
    by_status: dict[str, int]


def study_status(study: optuna.Study) -> StudyStatus:
    """Count trials by state and status; the best value of each objective among feasible trials."""
    trials = study.get_trials(deepcopy=False)
    statuses = Counter(TrialView(t).status for t in trials if t.state != TrialState.RUNNING)
    feasible = [t for t in trials if TrialView(t).feasible]
    best: dict[str, float] = {}
    for i, (name, d) in enumerate(zip(metric_names(study), study.directions, strict=True)):
        vals = [t.values[i] for t in feasible if t.values]
        if vals:
            best[name] = min(vals) if d == optuna.study.StudyDirection.MINIMIZE else max(vals)
    return StudyStatus(
        done=sum(1 for t in trials if t.state == TrialState.COMPLETE),
        running=sum(1 for t in trials if t.state == TrialState.RUNNING),
        failed=statuses.get("failed", 0)
        + statuses.get("invalid_replay", 0)
        + statuses.get("driver_died", 0),
        infeasible=sum(
            1 for t in trials if t.state == TrialState.COMPLETE and not TrialView(t).feasible
        ),
        front_size=len(feasible_front(study)),
        best=best,
        by_status=dict(statuses),
    )


def status_table(study: optuna.Study) -> Table:
    """Every trial: state, status, failure class, objective values."""
    table = Table(
        title=f"study {study.study_name}",
        caption=_slo_caption(study) + ". * partial: measured until an early stop",
    )
    table.add_column("trial", justify="right")
    table.add_column("status")
    names = metric_names(study)
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("SLOs")
    table.add_column("engine args / failure", overflow="fold")
    for t in study.get_trials(deepcopy=False):
        view = TrialView(t)
        status = view.status + (" (baseline)" if view.is_baseline else "")
        vals = _values(t, names)
        detail = view.failure_class or ", ".join(
            f"{k}={v}" for k, v in sorted(view.engine_args.items()) if k not in ("load-format",)
        )
        table.add_row(str(t.number), status, *vals, _slo_cell(t), detail)
    return table


def _values(t: FrozenTrial, names: list[str]) -> list[str]:
    """A trial's objective values: measured ones, a stopped replay's partial ones (marked *),
    or "-" (placeholders of a failure are never shown)."""
    view = TrialView(t)
    if t.values and view.measured:
        return [f"{v:,.1f}" for v in t.values]
    if view.partial:
        summary = view.summary
        return [
            f"{summary[n]:,.1f}*" if n in summary and not math.isnan(summary[n]) else "-"
            for n in names
        ]
    return ["-"] * len(names)


def _slo_cell(t: FrozenTrial) -> str:
    """Which SLOs a trial met or missed; a trial that never served says so, not "missed"."""
    view = TrialView(t)
    verdicts = {k: v for k, v in view.slo_verdicts().items() if k != _SERVED}
    if view.status in _NOT_RUN or view.status == "running" or not verdicts:
        return "not measured" if view.status in _NOT_RUN else "-"
    stop = view.stopped_by
    if stop:
        return f"stopped by {stop}"
    missed = _missed(t)
    return "met" if not missed else "missed: " + ", ".join(missed)
