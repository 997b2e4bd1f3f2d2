"""The stability check of a study folder: the configuration export would ship and the baseline,
each on a server of its own, one after the other, under the same plan; verdicts compared; the
result in the study folder as ``stability.json`` (runs' files under ``stability/``).

The plan's rate: for a capacity study, ``fraction`` of the chosen configuration's measured
capacity (its highest passing rate scale), the burst ``burst_factor`` times that capacity; for a
fixed-load study, the trace's own rate, the burst ``burst_factor`` times it. The baseline gets
the very same load, so a verdict it passes and the chosen configuration fails is a regression
the tuning would have shipped: such verdicts are flagged (``worse_than_baseline``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna

from objectives import parse_slo
from optimizer.errors import ConfigError
from optimizer.stability.options import StabilityOptions, stability_options
from optimizer.stability.plan import (
    StabilityPlan,
    build_load,
    build_plan,
    drain_time_s,
    with_trace,
)
from optimizer.stability.run import RunOutcome, Target, run_on_new_server
from optimizer.stability.verdicts import compare
from optimizer.workload.prompts import TokenRange

__all__ = [
    "STABILITY_FILE",
    "StabilityOptions",
    "header_note",
    "plan_scales",
    "prepare_plan",
    "read_stability",
    "require_stable",
    "run_study_stability",
    "stability_hint",
    "stability_options",
    "tracking_values",
]

STABILITY_FILE = "stability.json"


def plan_scales(
    capacity_scale: float | None, fraction: float, burst_factor: float
) -> tuple[float, float]:
    """(base, burst) rate scales: ``fraction`` and ``burst_factor`` of a measured capacity
    scale; the trace's own rate and ``burst_factor`` times it for a fixed-load study (None).

    Raises:
        ConfigError: A capacity study whose configuration carried the trace at no scale.
    """
    if not (fraction > 0 and burst_factor > 0):
        raise ConfigError(f"fraction and burst factor must be > 0, got {fraction}, {burst_factor}")
    if capacity_scale is None:
        return 1.0, burst_factor
    if capacity_scale <= 0:
        raise ConfigError(
            "the chosen trial met the SLOs at no rate scale (capacity 0): nothing to run a "
            "fraction of; choose a trial with capacity (--trial)"
        )
    return fraction * capacity_scale, burst_factor * capacity_scale


def _max_model_len(job: Any, args: Mapping[str, Any], model_max: int | None) -> int:
    shaped = job.trace.shaping.max_model_len
    for value in (shaped, args.get("max-model-len"), model_max):
        if value:
            return int(value)
    raise ConfigError("no max-model-len known for the long inputs: set trace.shaping.max_model_len")


def prepare_plan(folder: Path, saved: Mapping[str, Any]) -> Any:
    """The study's plan, prepared again here, its output folder the study folder now."""
    from optimizer.config import load_job
    from optimizer.study import prepare

    job = dict(saved.get("job") or {})
    job["out"] = "."  # folders of older versions recorded the folder where they were written
    job_config, base = load_job(job, base=folder)
    return prepare(job_config, base)


def _target(plan: Any, options: StabilityOptions) -> Target:
    """What the load is sent with: the study's model, prompt ids, SLOs and send-lag bound."""
    return Target(
        model=plan.engine.model,
        vocab=TokenRange(*plan.token_range),
        seed=options.seed,
        slos=tuple(parse_slo(str(s)) for s in plan.objectives.slos),
        max_send_lag_ms=plan.job.trace.max_send_lag_ms,
    )


def run_study_stability(
    folder: Path,
    saved: Mapping[str, Any],
    study: optuna.Study,
    options: StabilityOptions,
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the stability plan on the chosen configuration and the baseline; write and return
    the ``stability.json`` document.

    Raises:
        ConfigError: No trial to choose, no capacity to take a fraction of.
    """
    from optimizer.engine.models import model_info
    from optimizer.export import choose

    say = progress or (lambda _: None)
    choice = choose(study, None, trial_number=options.trial)
    plan = prepare_plan(folder, saved)
    cap = choice.chosen.capacity
    base_scale, burst_scale = plan_scales(
        cap.scale if cap is not None else None, options.fraction, options.burst_factor
    )
    settings = options.settings
    drain = None
    if cap is not None:
        drain = drain_time_s(settings.burst_s, burst_scale, base_scale, cap.scale)
    if options.auto_recovery and drain is not None:
        settings = replace(settings, recovery_s=max(settings.recovery_s, math.ceil(1.5 * drain)))
    model_max = None
    if Path(plan.engine.model).is_dir():
        model_max = model_info(plan.engine.model).max_position_embeddings
    stab = build_plan(
        settings,
        base_scale=base_scale,
        burst_scale=burst_scale,
        max_model_len=_max_model_len(plan.job, choice.chosen.engine_args, model_max),
    )
    stab = with_trace(stab, plan.trace)
    load = build_load(plan.trace, stab)
    say(
        f"plan: {len(load.trace)} requests over {stab.duration_s:g} s, rate x{base_scale:.3g} "
        f"(burst x{burst_scale:.3g}), long inputs of {stab.long_input_tokens} tokens"
        + (f"; the burst's backlog drains in about {drain:.0f} s at capacity" if drain else "")
    )
    target = _target(plan, options)
    runs_dir = folder / "stability" / time.strftime("%Y%m%d-%H%M%S")
    configs = [("chosen", choice.chosen.number, choice.chosen.engine_args)]
    if options.baseline and choice.baseline is not None:
        configs.append(("baseline", choice.baseline.number, choice.baseline.engine_args))
    outcomes = []
    for label, number, args in configs:
        say(f"{label} (trial {number}): starting its server")
        spec = plan.trial_spec(number, args, workdir=runs_dir / label, seed=options.seed)
        outcome = run_on_new_server(
            spec.engine,
            load,
            stab,
            target,
            label=label,
            workdir=runs_dir / label,
            python=spec.python,
            startup_timeout_s=spec.startup_timeout_s,
            warmup_trace=plan.trace,
            progress=say,
        )
        say(f"{label}: {outcome.status}" + (f" ({outcome.failure})" if outcome.failure else ""))
        outcomes.append(outcome)
    doc = stability_doc(choice.chosen.number, stab, outcomes, folder=folder, runs_dir=runs_dir)
    doc["baseline_trial"] = choice.baseline.number if choice.baseline is not None else None
    doc["policy"] = choice.policy
    doc["slos"] = [str(s) for s in target.slos]
    (folder / STABILITY_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


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
