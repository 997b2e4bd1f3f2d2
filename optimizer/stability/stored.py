"""A stability check as the study folder stores it: the ``stability.json`` document a check
writes (:func:`stability_doc`), its reading, and what ``export`` and MLflow read of it (the
export header's note, ``--require-stable``'s refusal, the parent run's metrics and tags).

Reads and builds documents only: nothing here runs a server or prepares a study, so ``export``
and :mod:`optimizer.tracking` read a check without the workflow that made it
(:mod:`optimizer.stability_check.workflow`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.stability.plan import StabilityPlan
from optimizer.stability.verdicts import compare

if TYPE_CHECKING:
    from optimizer.stability.run import RunOutcome

__all__ = [
    "STABILITY_FILE",
    "header_note",
    "read_stability",
    "require_stable",
    "stability_doc",
    "stability_hint",
    "tracking_values",
]

STABILITY_FILE = "stability.json"


def stability_doc(
    trial: int,
    plan: StabilityPlan,
    outcomes: list[RunOutcome],
    *,
    folder: Path,
    runs_dir: Path,
) -> dict[str, Any]:
    """The ``stability.json`` document: the plan, each run, the comparison."""
    by_label = {o.label: o for o in outcomes}
    chosen, base = by_label.get("chosen"), by_label.get("baseline")
    worse: list[str] = []
    if chosen is not None and base is not None and not base.failure:
        worse = compare(chosen.verdicts, base.verdicts)
        if chosen.failure:
            worse.append(f"server: chosen failed ({chosen.failure}), the baseline served")
    try:
        runs = runs_dir.relative_to(folder).as_posix()
    except ValueError:
        runs = str(runs_dir)
    return {
        "trial": trial,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": chosen.status if chosen is not None else "not run",
        "worse_than_baseline": worse,
        "plan": plan.doc(),
        "runs_dir": runs,
        "runs": {o.label: o.doc() for o in outcomes},
    }


def read_stability(folder: Path) -> dict[str, Any] | None:
    """The study folder's ``stability.json`` (None: none, or unreadable)."""
    try:
        doc = json.loads((Path(folder) / STABILITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def header_note(folder: Path, trial: int) -> tuple[str, ...]:
    """The export header's line on the stability check of ``trial`` (none when it was not
    checked)."""
    doc = read_stability(folder)
    if doc is None or doc.get("trial") != trial:
        return ()
    plan = doc.get("plan") or {}
    phases: list[dict[str, Any]] = plan.get("phases", [])
    sustained = next((p for p in phases if p.get("name") == "sustained"), {})
    minutes = (sustained.get("end_s", 0) - sustained.get("start_s", 0)) / 60
    chosen = (doc.get("runs") or {}).get("chosen") or {}
    failing = [v["name"] for v in chosen.get("verdicts", []) if v.get("status") == "fail"]
    line = (
        f"Stability check ({doc.get('written_at', '?')}, {minutes:.3g} min sustained at rate "
        f"x{plan.get('base_scale', 0):.3g}): {doc.get('status', '?')}"
    )
    if failing:
        line += " (failed: " + ", ".join(failing) + ")"
    worse = doc.get("worse_than_baseline") or []
    if worse:
        line += "; WORSE THAN THE BASELINE on " + ", ".join(w.split(":", 1)[0] for w in worse)
    return (line,)


_VERDICT_VALUE = {"pass": 1.0, "warn": 0.5, "fail": 0.0}


def tracking_values(doc: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """What a stability check puts on the study's MLflow parent run, as (metrics, tags).

    Metrics: ``stability.stable`` (1 or 0), ``stability.trial``,
    ``stability.worse_than_baseline`` (how many verdicts), and per run (``chosen``,
    ``baseline``) ``stability.<run>.<verdict>`` (1 pass, 0.5 warn, 0 fail; ``n/a`` left out),
    the memory slopes ``stability.<run>.<rss|gpu>_mib_per_min`` with their hourly share of
    the level, the recovery time and the client's P99 send lag. Tags: ``stability.status``,
    ``stability.trial``, ``stability.checked_at``, and ``stability.worse_than_baseline``
    (the verdicts, comma-separated) only when the chosen configuration did worse.
    """
    worse = [str(w).split(":", 1)[0] for w in doc.get("worse_than_baseline") or []]
    metrics: dict[str, Any] = {
        "stability.stable": float(doc.get("status") == "stable"),
        "stability.worse_than_baseline": float(len(worse)),
    }
    if isinstance(doc.get("trial"), int):
        metrics["stability.trial"] = float(doc["trial"])
    for label, run in (doc.get("runs") or {}).items():
        for v in run.get("verdicts") or []:
            key, numbers = f"stability.{label}.{v.get('name')}", v.get("numbers") or {}
            if v.get("status") in _VERDICT_VALUE:
                metrics[key] = _VERDICT_VALUE[v["status"]]
            if v.get("name") in ("memory_rss", "memory_gpu"):
                kind = str(v["name"]).split("_")[1]
                metrics[f"stability.{label}.{kind}_mib_per_min"] = numbers.get("per_min")
                metrics[f"stability.{label}.{kind}_per_hour_share"] = numbers.get("per_hour_share")
            if v.get("name") == "recovery":
                metrics[f"stability.{label}.recovery_s"] = numbers.get("recovery_s")
        metrics[f"stability.{label}.p99_send_lag_ms"] = run.get("p99_send_lag_ms")
    tags = {
        "stability.status": str(doc.get("status", "?")),
        "stability.trial": str(doc.get("trial", "?")),
        "stability.checked_at": str(doc.get("written_at", "?")),
    }
    if worse:
        tags["stability.worse_than_baseline"] = ", ".join(worse)
    finite = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
    return {k: v for k, v in finite.items() if math.isfinite(v)}, tags


def require_stable(folder: Path, trial: int) -> str | None:
    """Why ``export --require-stable`` refuses ``trial`` (None: its check lets it ship): no
    check, a check of another trial, a status other than ``stable``, or a verdict worse than
    the baseline's. One line, saying what to run."""
    doc = read_stability(folder)
    run = f"`vllm-autotune stability {folder} --trial {trial}`"
    if doc is None:
        return (
            f"trial {trial} has no stability check ({folder / STABILITY_FILE} is missing); "
            f"run {run}"
        )
    if doc.get("trial") != trial:
        return (
            f"the stability check in {folder / STABILITY_FILE} is of trial {doc.get('trial')}, "
            f"not of trial {trial}; run {run}"
        )
    chosen = (doc.get("runs") or {}).get("chosen") or {}
    if doc.get("status") != "stable":
        failing = [v["name"] for v in chosen.get("verdicts") or [] if v.get("status") == "fail"]
        why = f"failed: {', '.join(failing)}" if failing else chosen.get("failure") or "?"
        return (
            f"trial {trial}'s stability check says {doc.get('status')} ({why}); export another "
            f"trial, or check this one again: {run}"
        )
    worse = [str(w).split(":", 1)[0] for w in doc.get("worse_than_baseline") or []]
    if worse:
        return (
            f"trial {trial} did worse than the baseline in its stability check on "
            f"{', '.join(worse)} (see {folder / STABILITY_FILE}); export another trial, or "
            f"check this one again: {run}"
        )
    return None


def stability_hint(folder: Path, trial: int) -> str | None:
    """``export``'s hint when ``trial`` has no stability check (None when it has one)."""
    doc = read_stability(folder)
    if doc is not None and doc.get("trial") == trial:
        return None
    return (
        f"trial {trial} has no stability check: `vllm-autotune stability {folder} --trial "
        f"{trial}` runs it (sustained load, a burst, long inputs; against the baseline), and "
        "`export --require-stable` refuses a trial without a passing one"
    )
