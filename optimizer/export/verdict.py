"""What the export console says about re-validation, and re-validations an export may reuse.

- :func:`verdict_lines`: per objective, the study's gain and the re-measured one, whether the
  re-runs separated it from the baseline ("cleared the noise") or not, the policy's own
  objective marked;
- :func:`stored_gain`: an earlier export of the same trial was re-validated: a later
  ``--no-validate`` export reuses that verdict instead of saying "not re-validated".
"""

from __future__ import annotations

import math
from typing import Any

import optuna

from optimizer.export.revalidate import Validation, primary_metrics
from optimizer.report import gain_pct

__all__ = ["NOT_REVALIDATED", "stored_gain", "verdict_lines"]

# How unvalidated_gain's line starts (optimizer.export.workflow).
NOT_REVALIDATED = "values measured once during the study, not re-validated"


def _study_gain(study: optuna.Study, choice: Any, metric: str) -> float | None:
    names = list(study.metric_names or [])
    base = choice.baseline
    if metric not in names or base is None or not base.measured or not choice.chosen.measured:
        return None
    i = names.index(metric)
    chosen_values, base_values = choice.chosen.trial.values, base.trial.values
    if not chosen_values or not base_values:
        return None
    return gain_pct(chosen_values[i], base_values[i], study.directions[i])


def verdict_lines(val: Validation, study: optuna.Study, choice: Any) -> list[str]:
    """One line per objective: the study's gain, the re-measured gain and its range, and
    whether it cleared the noise of the re-runs; then the policy's own objective's result."""
    primary = primary_metrics(choice.policy, val.metrics)
    lines = []
    for row in val.table():
        metric = row["metric"]
        lo, hi = row["gain_range_pct"]
        was = _study_gain(study, choice, metric)
        study_text = f"study {was:+.1f}%, " if was is not None and math.isfinite(was) else ""
        cleared = not val.within_noise(metric)
        lines.append(
            f"{metric}: {study_text}re-measured {row['gain_pct']:+.1f}% "
            f"[{lo:+.1f}% .. {hi:+.1f}%] vs the baseline: "
            + ("cleared the noise" if cleared else "within the noise (not a gain)")
            + (" <- the policy's objective" if metric in primary else "")
        )
    held = [m for m in primary if not val.within_noise(m)]
    lines.append(
        f"policy {choice.policy} ({', '.join(primary)}): "
        + (
            "gain confirmed on " + ", ".join(held)
            if held
            else "no gain beyond the noise of the re-runs"
        )
        + ("; SLOs failed on re-run: " + "; ".join(val.slo_failures) if val.slo_failures else "")
    )
    return lines


def stored_gain(study: optuna.Study, trial: int) -> str | None:
    """The gain line of the latest re-validated export of ``trial`` (None: none was)."""
    for entry in reversed(list(study.user_attrs.get("exports") or [])):
        gain = str(entry.get("gain") or "")
        if entry.get("trial") == trial and gain and not gain.startswith(NOT_REVALIDATED):
            return gain
    return None
