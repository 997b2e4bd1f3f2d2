"""The gate as a study's stage: the feasible front's numeric-changing members, checked.

Before a study ends (and from ``vllm-autotune quality``), every member of the feasible Pareto
front whose engine arguments change numerics is checked against the baseline; its verdict is
stored among the study's (its ``quality`` attribute), and a refused member leaves the front,
so that the members it dominated may join it and are checked in turn. The export policy then
picks the best that passes (:func:`optimizer.trial_view.feasible_front` leaves refused trials
out). Members that
change nothing numeric are recorded ``unchanged`` without a server. Where a check's two servers
run is the caller's (``place``): in a study run through Ray, an actor pinned to the GPUs the
larger of the two needs, as a trial's server runs (:meth:`optimizer.runners.RayRunner.call`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from optimizer.config import QualitySection
from optimizer.quality.check import QualitySettings, Verdict
from optimizer.quality.levers import numeric_changes
from optimizer.quality.run import check_configuration
from optimizer.trial_view import (
    QUALITY_ATTR,
    TrialView,
    baseline_of,
    feasible_front,
    quality_verdicts,
    refused_trials,
)

__all__ = [
    "Place",
    "gate_front",
    "quality_notes",
    "record_verdict",
    "settings_of",
    "verdict_lines",
]

#: Runs one check (a call without arguments that starts the baseline's and the candidate's
#: servers in turn and returns the verdict) where servers of the candidate's engine arguments
#: may run; gets the check and those arguments.
Place = Callable[[Callable[[], Verdict], Mapping[str, Any]], Verdict]


def settings_of(section: QualitySection) -> QualitySettings:
    """The job's ``quality`` section as the check's settings."""
    return QualitySettings(
        prompts=section.prompts,
        prompt_tokens=section.prompt_tokens,
        continuation_tokens=section.continuation_tokens,
        min_top1_agreement=section.min_top1_agreement,
        max_logprob_drift=section.max_logprob_drift,
        min_greedy_match=section.min_greedy_match,
        eval_set=section.eval_set,
        eval_max_tokens=section.eval_max_tokens,
        min_accuracy_ratio=section.min_accuracy_ratio,
    )


def record_verdict(study: optuna.Study, trial: FrozenTrial, verdict: Verdict) -> None:
    """Store ``verdict`` among the study's verdicts (:data:`QUALITY_ATTR`)."""
    verdicts = {str(n): doc for n, doc in quality_verdicts(study).items()}
    verdicts[str(trial.number)] = verdict.to_doc()
    study.set_user_attr(QUALITY_ATTR, verdicts)


def gate_front(
    study: optuna.Study,
    *,
    model: str,
    baseline_args: Mapping[str, Any],
    env_for: Callable[[Mapping[str, Any]], Mapping[str, str]],
    prompts: Sequence[Sequence[int]],
    workdir: Path,
    settings: QualitySettings,
    python: str | None = None,
    startup_timeout_s: float = 900.0,
    vocab_size: int | None = None,
    only: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
    place: Place | None = None,
) -> list[tuple[int, Verdict]]:
    """Check the front until no unchecked numeric-changing member is left; (trial, verdict)s.

    Args:
        env_for: The server environment a configuration ran with (its trial's).
        only: Check these trial numbers instead of the front (``quality --trial``).
        place: Where a numeric-changing member's check runs (None: in this process); a
            member that changes nothing numeric is recorded here, without a server.
    """
    say = progress or (lambda _line: None)
    done: list[tuple[int, Verdict]] = []
    while True:
        if only is not None:
            by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
            todo = [by_number[n] for n in only if n in by_number and n not in dict(done)]
        else:
            checked = quality_verdicts(study)
            todo = [t for t in feasible_front(study) if t.number not in checked]
        if not todo:
            return done
        for trial in todo:
            args = TrialView(trial).engine_args
            levers = numeric_changes(args, baseline_args)
            if levers:
                say(f"quality gate: trial {trial.number} ({', '.join(sorted(levers))}): checking")
            check = functools.partial(
                check_configuration,
                model,
                dict(args),
                dict(baseline_args),
                dict(env_for(baseline_args)),
                workdir,
                settings,
                [list(p) for p in prompts],
                python=python,
                startup_timeout_s=startup_timeout_s,
                vocab_size=vocab_size,
                label=f"trial-{trial.number}",
                candidate_env=dict(env_for(args)),
            )
            verdict = place(check, args) if levers and place is not None else check()
            record_verdict(study, trial, verdict)
            done.append((trial.number, verdict))
            if levers:
                say(f"quality gate: trial {trial.number}: {verdict.line()}")


def _line(doc: Mapping[str, Any]) -> str:
    comparison = doc.get("comparison")
    if not isinstance(comparison, Mapping):
        return f"{doc.get('status')}: {doc.get('reason')}"
    floor = doc.get("floor") or {}
    return (
        f"{doc.get('status')}: top-1 agreement {float(comparison['top1_agreement']):.3f}, "
        f"logprob drift {float(comparison['mean_abs_logprob_diff']):.4f} (floor "
        f"{float(floor.get('mean_abs_logprob_diff') or 0.0):.4f}) over "
        f"{comparison['tokens']} tokens; {doc.get('reason')}"
    )


def quality_notes(study: optuna.Study, trial_number: int) -> list[str]:
    """What an export's header, ``show`` and report.md say of the gate: the chosen trial's
    verdict (or that it changes numerics unchecked) and every configuration it refused."""
    verdicts = quality_verdicts(study)
    base = baseline_of(study)
    base_args = TrialView(base).engine_args if base is not None else {}
    lines = []
    mine = verdicts.get(trial_number)
    if mine is not None:
        lines.append(f"Quality gate, trial {trial_number}: {_line(mine)}")
    else:
        trial = next(
            (t for t in study.get_trials(deepcopy=False) if t.number == trial_number), None
        )
        levers = numeric_changes(TrialView(trial).engine_args, base_args) if trial else {}
        if levers:
            lines.append(
                f"Quality gate: trial {trial_number} changes numerics ({', '.join(sorted(levers))})"
                " and was not checked: run `vllm-autotune quality` on the study folder, or check"
                " its answers against the baseline's yourself."
            )
    for trial in refused_trials(study):
        named = ", ".join(sorted(numeric_changes(TrialView(trial).engine_args, base_args)))
        lines.append(
            f"Refused by the quality gate: trial {trial.number}{f' ({named})' if named else ''}: "
            f"{_line(verdicts[trial.number])}"
        )
    return lines


def verdict_lines(study: optuna.Study) -> list[str]:
    """Every verdict of the study, refused ones first (``show``)."""
    verdicts = quality_verdicts(study)
    order = sorted(verdicts, key=lambda n: (verdicts[n].get("status") != "fail", n))
    return [f"trial {n}: {_line(verdicts[n])}" for n in order]
