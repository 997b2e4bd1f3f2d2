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
from optimizer.stability.options import StabilityOptions
from optimizer.stability.plan import build_load, build_plan, drain_time_s, plan_scales, with_trace
from optimizer.stability.run import Target, run_on_new_server
from optimizer.stability.stored import STABILITY_FILE, stability_doc
from optimizer.workload.prompts import TokenRange

__all__ = ["prepare_plan", "run_study_stability"]


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
