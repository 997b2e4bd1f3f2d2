"""The export use case, one path for the CLI, the service and the study benchmark.

:func:`choose` picks a trial (:mod:`.choose`), :func:`revalidate` re-measures it against the
baseline (:mod:`.revalidate`) on whatever runs a trial (a Ray runner, a local thread, a fake),
:func:`verdict` turns the re-runs into the gain line and the reasons to refuse, and
:func:`context` gathers what :func:`~optimizer.export.render.render` writes into the header.
Every re-run asks for the GPUs of its own configuration (tensor x pipeline parallel,
:func:`~optimizer.trial_view.gpus_per_server`), never the baseline's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from optimizer.engine.defaults import KV_CACHE_ENV
from optimizer.errors import ConfigError
from optimizer.export.choose import default_policy, select_trial
from optimizer.export.render import Deployment, ExportContext, check_deployment, trace_label
from optimizer.export.revalidate import Validation, primary_metrics, validate_choice
from optimizer.export.verdict import NOT_REVALIDATED
from optimizer.report import changed_args
from optimizer.service.security import is_secret
from optimizer.trial_view import TrialView, baseline_of, gpus_per_server
from optimizer.types import TrialResult, TrialSpec

if TYPE_CHECKING:
    from optimizer.runners import TrialRunner
    from optimizer.study import StudyPlan

__all__ = [
    "Choice",
    "Submit",
    "choose",
    "context",
    "revalidate",
    "revalidate_job",
    "unvalidated_gain",
    "verdict",
]

#: Runs one trial spec on ``gpus`` GPUs to completion and returns its result.
Submit = Callable[[TrialSpec, int], TrialResult]


@dataclass(frozen=True)
class Choice:
    """The trial to export and the baseline it is measured against.

    Attributes:
        policy: The policy that chose it (``trial`` for an explicit number).
        chosen: The chosen trial.
        baseline: The study's baseline (None: the study has none).
    """

    policy: str
    chosen: TrialView
    baseline: TrialView | None

    def changes(self) -> dict[str, Any]:
        """Engine arguments the chosen trial changes against the baseline."""
        base = self.baseline.trial if self.baseline is not None else None
        return changed_args(self.chosen.trial, base)


def choose(
    study: optuna.Study,
    policy: str | None = None,
    *,
    trial_number: int | None = None,
    weights: Mapping[str, float] | None = None,
) -> Choice:
    """The trial a policy picks (an explicit ``trial_number`` overrides the policy).

    Raises:
        ConfigError: Unknown policy, no feasible trial, or an unusable trial number.
    """
    pol = "trial" if trial_number is not None else (policy or default_policy(study))
    chosen = select_trial(study, pol, trial_number=trial_number, weights=weights)
    base = baseline_of(study)
    return Choice(
        policy=pol,
        chosen=TrialView(chosen),
        baseline=TrialView(base) if base is not None else None,
    )


def revalidate(
    plan: StudyPlan,
    study: optuna.Study,
    choice: Choice,
    submit: Submit,
    *,
    workdir: Path,
    runs: int = 3,
    progress: Callable[[str], None] | None = None,
) -> Validation:
    """Re-run the chosen configuration and the baseline ``runs`` times each, alternating.

    Args:
        plan: The study's plan, prepared again where the re-runs happen.
        study: The study (objective names and directions).
        choice: What to re-run.
        submit: Runs a spec on a number of GPUs.
        workdir: Folder for the re-runs' logs and records.
        runs: Re-runs of each.
        progress: Called with a line per finished run.

    Raises:
        ConfigError: The study has no baseline, or the re-runs measured nothing.
    """
    if choice.baseline is None:
        raise ConfigError("the study has no baseline trial to validate against")
    cpu_build = plan.context.cpu_build

    def make_spec(label: str, engine_args: dict[str, Any], k: int) -> TrialSpec:
        return plan.trial_spec(
            choice.chosen.number,
            engine_args,
            workdir=workdir / f"{label}-{k}",
            seed=900_000 + 2 * k + (label == "chosen"),
            early_stop=False,
        )

    def run(spec: TrialSpec) -> TrialResult:
        return submit(spec, gpus_per_server(spec.engine.args, cpu_build=cpu_build))

    def feasible(summary: Mapping[str, float]) -> bool:
        return all(m <= 0 for m in plan.objectives.constraints(summary))

    return validate_choice(
        run,
        make_spec,
        choice.chosen.engine_args,
        choice.baseline.engine_args,
        metrics=list(study.metric_names or []),
        directions=list(study.directions),
        values=plan.objectives.values,
        feasible=feasible,
        runs=runs,
        progress=progress,
    )


def revalidate_job(
    job: dict[str, Any],
    base: Path,
    study: optuna.Study,
    choice: Choice,
    make_runner: Callable[[StudyPlan], TrialRunner],
    *,
    label: str,
    runs: int,
    progress: Callable[[str], None] | None = None,
) -> Validation:
    """:func:`revalidate` for a stored study: its job prepared again here, the re-runs on the
    runner ``make_runner`` gives for that plan (closed after), in ``validation/LABEL-TIME``.

    Args:
        job: The study's job document.
        base: The folder the job's relative paths are relative to.
        study: The study.
        choice: What to re-run.
        make_runner: The runner the re-runs go to (the CLI's ``--runner``; the service: Ray).
        label: Names the re-runs' folder under the plan's ``validation/``.
        runs: Re-runs of each.
        progress: Called with a line per finished run.
    """
    from optimizer.config import load_job
    from optimizer.study import prepare

    job_config, job_base = load_job(job, base=base)
    plan = prepare(job_config, job_base)
    runner = make_runner(plan)
    try:
        return revalidate(
            plan,
            study,
            choice,
            lambda spec, gpus: runner.submit(spec, gpus).future.result(),
            workdir=plan.out / "validation" / f"{label}-{int(time.time())}",
            runs=runs,
            progress=progress,
        )
    finally:
        runner.close()


def verdict(val: Validation, policy: str, *, force: bool = False) -> tuple[str, list[str]]:
    """The gain line for the header and the reasons to refuse (empty: export).

    Reasons are judged on the policy's own objectives (:func:`primary_metrics`); a forced
    export says in its gain line what it overrode.
    """
    problems = val.problems(primary_metrics(policy, val.metrics))
    gain = val.gain_text()
    if problems and force:
        gain += " [FORCED: " + "; ".join(problems) + "]"
    return gain, problems


def unvalidated_gain(study: optuna.Study, choice: Choice) -> str:
    """The gain line of an export that was not re-validated: the values measured once."""
    names = list(study.metric_names or [])
    values = choice.chosen.trial.values or []
    return (
        NOT_REVALIDATED
        + ": "
        + ", ".join(f"{n} {v:,.1f}" for n, v in zip(names, values, strict=False))
    )


def context(
    saved: Mapping[str, Any],
    choice: Choice,
    gain: str,
    *,
    job: Mapping[str, Any] | None = None,
    study_name: str | None = None,
    capacity: str = "",
    deployment: Deployment | None = None,
) -> ExportContext:
    """What the export's header says, from the study folder's ``plan.json`` document.

    Args:
        saved: ``plan.json``.
        choice: The exported trial.
        gain: The gain line.
        job: The job document (default: the one in ``plan.json``).
        study_name: The name the header gives the study (default: ``plan.json``'s; the service
            gives the job's name, and the header adds plan.json's storage name ``TEAM/JOB_ID``
            as "stored as").
        capacity: Capacity studies: the capacity line.
        deployment: Model, served name, image and GPUs the user set for a deployment format.

    The job's server environment is carried into the deployment without its secrets.

    Raises:
        ConfigError: A deployment name that is not plain text (:func:`check_deployment`).
    """
    job = job if job is not None else (saved.get("job") or {})
    engine = job.get("engine") or {}
    env = dict(engine.get("env") or {})
    args = choice.chosen.engine_args
    if str(saved.get("hardware", "")).startswith("CPU") and "kv-cache-memory-bytes" not in args:
        # The CPU build sized its KV cache from this variable (optimizer.engine.defaults).
        env.setdefault(KV_CACHE_ENV, str(max(1, int(engine.get("kv_cache_gib") or 2))))
    stored = str(saved.get("study") or "")
    return ExportContext(
        study=str(study_name or stored or "?"),
        stored_as=stored if study_name and stored != study_name else "",
        trial=choice.chosen.number,
        model=str((job.get("model") or {}).get("path", "?")),
        args=choice.chosen.engine_args,
        vllm=str(saved.get("vllm", "?")),
        hardware=str(saved.get("hardware", "?")),
        trace=trace_label(saved),
        gain=gain,
        gpus=choice.chosen.gpus(),
        env={k: str(v) for k, v in env.items() if not is_secret(k)},
        capacity=capacity,
        python=str(engine.get("python") or sys.executable),
        deployment=check_deployment(deployment or Deployment()),
    )
