"""``vllm-autotune tune``, ``show`` and ``mlflow-sync``: a study run (or resumed) from a job file
with its console (a line per trial, the study's progress, MLflow, the capacity answer, the job's
stability stage), a study folder's tables, and its MLflow view rebuilt. ``export`` is registered
here too (:mod:`optimizer.export.command`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from optimizer import cli_support
from optimizer.cli_support import console, err_console
from optimizer.errors import AutotuneError, ConfigError

__all__ = ["register"]


def _job_with_overrides(ns: argparse.Namespace) -> tuple[Any, Any]:
    """The job file, with --trials, --budget, --until, --ray-address, --storage, --out and
    --seed over it (--out relative to the working directory, as paths on a command line are)."""
    from optimizer.config import load_job

    overrides: dict[str, Any] = {}
    job, base = load_job(ns.job)
    if ns.trials is not None:
        overrides["trials"] = ns.trials
    if ns.budget is not None:
        overrides["budget"] = ns.budget
    if ns.until is not None:
        overrides["until"] = ns.until
    if ns.ray_address is not None:
        overrides["ray_address"] = ns.ray_address
    if ns.out is not None:
        overrides["out"] = str(Path(ns.out).resolve())
    if ns.seed is not None:
        overrides["sampler"] = {**job.sampler.model_dump(), "seed": ns.seed}
    storage = ns.storage or (None if job.storage else os.environ.get("VLLM_AUTOTUNE_STORAGE"))
    if storage:
        overrides["storage"] = storage
    if overrides:
        job, base = load_job({**job.model_dump(), **overrides}, base=base)
    return job, base


def _finished_trial_line(number: int, r: Any, trial: Any = None) -> str:
    """One line for a finished trial: status, then its capacity or its latencies, which SLO it
    missed, then timings."""
    s = r.summary
    text = f"[cyan]trial {number}[/] {r.status.value}"
    if r.failure_class:
        text += f" ({r.failure_class.value})"
    cap = r.capacity
    if cap and cap.get("raced_out"):
        text += f": {r.message}"
    elif cap and not cap.get("rps"):
        text += f": capacity 0: {r.message}"
    elif cap:
        from optimizer.trial_view import CapacityView

        text += (
            f": capacity {CapacityView.from_doc(cap).rps_text()} "
            f"(rate x{cap.get('scale', 0):.3g}, {len(cap.get('steps') or [])} steps"
            + (f"; above it {cap['broke_first']} broke" if cap.get("broke_first") else "")
            + ")"
        )
    elif s.get("completed"):
        text += (
            f": p95 TTFT {s.get('p95_ttft_ms', float('nan')):.0f} ms, "
            f"p95 TPOT {s.get('p95_tpot_ms', float('nan')):.1f} ms, "
            f"{s.get('output_throughput', 0):.1f} tok/s"
        )
    text += _slo_note(trial)
    if r.startup_s:
        text += f"  [dim](startup {r.startup_s:.0f} s, replay {r.replay_s or 0:.0f} s)[/]"
    return text


def _study_progress_line(driver: Any, elapsed: float) -> str:
    """The study's counts, time spent and left, front size and best values."""
    from optimizer.report import study_status

    st = study_status(driver.study)
    left = driver.budget_left()
    best = ", ".join(f"{k} {v:,.1f}" for k, v in st.best.items()) or "-"
    return (
        f"  [dim]done {st.done} running {st.running} failed {st.failed} "
        f"infeasible {st.infeasible} | elapsed {elapsed / 60:.1f} min"
        + (f", budget left {left.total_seconds() / 60:.0f} min" if left is not None else "")
        + f" | front {st.front_size} | best {best}[/]"
    )


def cmd_tune(ns: argparse.Namespace) -> int:
    from optimizer.report import front_table
    from optimizer.study import prepare
    from optimizer.study_driver import StudyDriver, StudyEvent

    job, base = _job_with_overrides(ns)
    with console.status("checking the job against the installed vLLM ..."):
        plan = prepare(job, base)
    console.print(
        f"study [bold]{job.name}[/] -> {plan.out}  ({plan.vllm}; storage {plan.storage_url})"
    )
    if plan.priors.trials:
        console.print(
            f"[dim]warm start: the sampler is given {len(plan.priors.trials)} told trials of "
            "the earlier studies as prior observations[/]"
        )
    for w in plan.warm_start:
        console.print(
            f"[dim]warm start: {escape(w.folder)} trial {w.trial} ({escape(w.measured)}) "
            f"enqueued: {escape(json.dumps(w.args, sort_keys=True))}[/]"
        )
    for note in plan.notes:
        console.print(f"[yellow]{escape(note)}[/]")
    for note in plan.trace_notes:
        console.print(f"[dim]{note}[/]")
    t0 = time.monotonic()
    runner = cli_support.make_runner(ns.runner, plan, job.ray_address)
    driver: StudyDriver | None = None

    def on_event(ev: StudyEvent) -> None:
        elapsed = time.monotonic() - t0
        if ev.kind == "started":
            console.print(f"[cyan]trial {ev.number}[/] started: {ev.detail}")
        elif ev.kind == "progress":
            console.print(f"[dim]trial {ev.number}: {ev.detail}[/]")
        elif ev.kind == "finished" and ev.result is not None:
            r = ev.result
            console.print(_finished_trial_line(ev.number, r, ev.trial))
            if r.message and r.status.value != "complete":
                console.print(f"  [dim]{r.message[:300]}[/]")
        elif ev.kind in ("rejected", "retry", "stale", "enqueued", "enqueue_refused", "exhausted"):
            console.print(_event_line(ev))
        if driver is not None and ev.kind in ("finished", "rejected"):
            console.print(_study_progress_line(driver, elapsed))

    try:
        driver = StudyDriver(plan, runner, on_event=on_event)
        tracker = _tracker_for(plan, ns)
        if tracker is not None:
            driver.on_event = _chain(on_event, tracker.on_event)
        study = driver.run()
        # Before the study's review is written: report.md and MLflow carry the gate's
        # verdicts. Through the study's runner: on a Ray cluster, on GPUs no trial holds.
        _quality_stage(plan, study, runner)
    finally:
        runner.close()
    if tracker is not None and tracker.finish(study) and tracker.experiment_id:
        from optimizer.tracking import review_url

        console.print(
            f"[dim]MLflow runs table: {review_url(tracker.target, tracker.experiment_id)}[/]"
        )
    console.print(front_table(study))
    from optimizer.analysis.capacity import capacity_answer

    job_cap = plan.job.capacity
    _print_capacity(
        capacity_answer(
            study,
            peak_rps=ns.peak_rps if ns.peak_rps is not None else job_cap.peak_rps,
            gpu_hour_price=(
                ns.gpu_hour_price if ns.gpu_hour_price is not None else job_cap.gpu_hour_price
            ),
            cpu_build=plan.context.cpu_build,
        )
    )
    _stability_stage(plan, ns)
    console.print(f"study folder: {plan.out}  (vllm-autotune show {plan.out})")
    return 0


def _quality_stage(plan: Any, study: Any, runner: Any) -> None:
    """The job's ``quality.enabled``: the quality gate on the feasible front's
    numeric-changing members, once the trials' servers are down (:mod:`optimizer.quality`),
    each check through ``runner`` (its ``call``) where it has one."""
    if not plan.job.quality.enabled:
        return
    from optimizer.quality_check import gate_plan, verdict_table

    done = gate_plan(
        plan,
        study,
        progress=lambda line: console.print(f"[dim]{escape(line)}[/]"),
        runner=runner,
    )
    if any(v.levers for _n, v in done):
        console.print(verdict_table(done))


def _stability_stage(plan: Any, ns: argparse.Namespace) -> None:
    """The job's ``stability.after_study``: the stability check of the configuration export
    would pick, run once the study's servers are down (its exit status is not tune's:
    ``export --require-stable`` is the gate)."""
    if not plan.job.stability.after_study:
        return
    from optimizer.stability_check.command import check_study

    console.print("[bold]Stability check[/] (the job's stability.after_study)")
    saved, study = cli_support.load_study_dir(Path(plan.out))
    try:
        check_study(
            Path(plan.out),
            saved,
            study,
            plan.job.stability.options(),
            mlflow=not getattr(ns, "no_mlflow", False),
        )
    except ConfigError as exc:  # no trial to check, no capacity: the study itself stands
        err_console.print(f"[yellow]stability check not run:[/] {escape(str(exc))}")


def _slo_note(trial: Any) -> str:
    """ "  SLOs met" / "  ✗SLO missed: p95_tpot_ms<=50" for a measured trial ("" otherwise)."""
    from optimizer.trial_view import TrialView

    if trial is None or not TrialView(trial).measured:
        return ""
    verdicts = {k: v for k, v in TrialView(trial).slo_verdicts().items() if k != "engine_served"}
    missed = [k for k, ok in verdicts.items() if not ok]
    if not verdicts:
        return ""
    return "  [yellow]✗SLO missed: " + ", ".join(missed) + "[/]" if missed else "  SLOs met"


def _event_line(ev: Any) -> str:
    """A study event that is not a trial's start or end, as the tune console prints it."""
    if ev.kind == "enqueue_refused":
        return f"[yellow]enqueue: not run[/]: {ev.detail[:400]}"
    if ev.kind == "exhausted":
        return f"[yellow]no new configuration proposed[/]: {ev.detail[:400]}"
    return f"[yellow]trial {ev.number} {ev.kind}[/]: {ev.detail[:300]}"


def _chain(*handlers: Any) -> Any:
    def call(ev: Any) -> None:
        for h in handlers:
            h(ev)

    return call


def _tracker_for(plan: Any, ns: argparse.Namespace) -> Any:
    if getattr(ns, "no_mlflow", False) or not plan.job.mlflow.enabled:
        return None
    from optimizer import tracking

    tracker = tracking.tracker_for_plan(plan)
    if tracker is not None:
        console.print(
            f"[dim]MLflow: experiment {tracker.target.experiment!r} at "
            f"{tracking.ui_command(tracker.target)}[/]"
        )
    return tracker


def cmd_show(ns: argparse.Namespace) -> int:
    from optimizer.analysis.capacity import answer_for_plan, study_json
    from optimizer.report import front_table, status_table

    plan, study = cli_support.load_study_dir(Path(ns.dir))
    answer = answer_for_plan(study, plan, peak_rps=ns.peak_rps, gpu_hour_price=ns.gpu_hour_price)
    if ns.json:
        print(json.dumps(study_json(study, plan, answer), indent=2, default=str))
        return 0
    console.print(status_table(study))
    console.print(front_table(study))
    _print_capacity(answer)
    _print_quality(study)
    _print_trial_cost(study)
    return 0


def _print_quality(study: Any) -> None:
    """The quality gate's verdicts, refused configurations first (none: nothing printed)."""
    from optimizer.quality.stage import verdict_lines

    lines = verdict_lines(study)
    if lines:
        console.print("[bold]Quality gate[/] (against the baseline on the same weights)")
        for line in lines:
            style = "bold red" if ": fail:" in line else "dim" if ": unchanged:" in line else ""
            text = escape(line)
            console.print(f"  [{style}]{text}[/]" if style else f"  {text}")


def _print_trial_cost(study: Any) -> None:
    """Where the trials' time went: replaying vs starting servers, and the start's phases."""
    from optimizer.analysis.trial_cost import study_cost

    lines = study_cost(study.get_trials(deepcopy=False)).lines()
    if lines:
        console.print("[bold]Trial time[/]")
        for line in lines:
            console.print(f"  {line}")


def _print_capacity(answer: Any) -> None:
    """The capacity answer under the tables (capacity studies only)."""
    if answer is None:
        return
    console.print("[bold]Capacity at SLO[/] (how much of this traffic one server carries)")
    for line in answer.lines():
        console.print(f"  {line}")


def cmd_mlflow_sync(ns: argparse.Namespace) -> int:
    from optimizer.tracking import sync_study

    try:
        with console.status("logging the study to MLflow ..."):
            summary = sync_study(ns.dir, tracking_uri=ns.tracking_uri, experiment=ns.experiment)
    except AutotuneError:
        raise
    except Exception as exc:  # MLflow unreachable or refusing: say so, no traceback
        err_console.print(f"[bold red]MLflow sync failed:[/] {type(exc).__name__}: {exc}")
        return 1
    console.print(
        f"MLflow: {summary.trials} trials, {summary.created} runs created, {summary.updated} "
        f"updated, {summary.duplicates_deleted} duplicates deleted; parent run "
        f"{summary.parent_run_id}; Pareto front {list(summary.front)}"
    )
    console.print(f"runs table: {summary.runs_url}")
    return 0


def register(sub: Any) -> None:
    """tune, export, show, mlflow-sync: a study and what comes of it."""
    p = sub.add_parser("tune", help="run (or resume) a tuning study from a job file")
    p.add_argument("job", help="job YAML file")
    p.add_argument("--trials", type=int, default=None, help="override the job's trial count")
    p.add_argument("--budget", default=None, help="stop launching after e.g. 8h or 90m")
    p.add_argument("--until", default=None, help="stop launching at local time HH:MM")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster")
    p.add_argument(
        "--out", default=None, help="study folder (default: the job's out); e.g. a repeat's own"
    )
    p.add_argument("--seed", type=int, default=None, help="override the sampler's seed")
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL (default: the job's, else $VLLM_AUTOTUNE_STORAGE, "
        "else SQLite in the study folder)",
    )
    p.add_argument(
        "--runner",
        default="ray",
        choices=["ray", "local"],
        help="ray: one actor per trial pinned to its GPUs (default); local: in-process",
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    cli_support.add_capacity_pricing(p)
    p.set_defaults(func=cmd_tune)

    from optimizer.export.command import register as register_export

    register_export(sub)

    p = sub.add_parser("show", help="trials and the Pareto front of a study folder")
    p.add_argument("dir")
    p.add_argument(
        "--json", action="store_true", help="one JSON document: every trial, the front, capacity"
    )
    cli_support.add_capacity_pricing(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "mlflow-sync", help="(re)build the MLflow view of a study folder from its Optuna storage"
    )
    p.add_argument("dir", help="study folder")
    p.add_argument(
        "--tracking-uri", default=None, help="log here (default: the study's, or DIR/mlflow.db)"
    )
    p.add_argument("--experiment", default=None, help="experiment name (default: the study's)")
    p.set_defaults(func=cmd_mlflow_sync)
