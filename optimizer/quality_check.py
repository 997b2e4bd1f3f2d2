"""The quality gate on a prepared study, and ``vllm-autotune quality STUDY_DIR``.

Above the study (it takes a :class:`~optimizer.study.StudyPlan`): ``tune`` and the service's
study drivers run :func:`gate_plan` before a study ends (``quality.enabled``), and
``vllm-autotune quality`` runs it on a study folder, for the front or for named trials. The
servers run one at a time, beside no trial: given the study's runner, each check in an actor
of its own pinned to the GPUs its servers need (:meth:`optimizer.runners.RayRunner.call`);
without one (``quality``, ``export``), where this process runs (on a GPU host: the GPUs it
sees).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from optimizer.engine.models import model_info
from optimizer.quality.check import Verdict
from optimizer.quality.run import prompts_for
from optimizer.quality.stage import Place, gate_front, settings_of
from optimizer.trial_view import gpus_per_server

if TYPE_CHECKING:
    import optuna

    from optimizer.study import StudyPlan

__all__ = ["cmd_quality", "gate_plan", "register", "verdict_table"]

_STYLE = {"pass": "green", "fail": "bold red", "skipped": "yellow", "unchanged": "dim"}


def gate_plan(
    plan: StudyPlan,
    study: optuna.Study,
    *,
    only: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
    runner: Any = None,
) -> list[tuple[int, Verdict]]:
    """The gate over ``study``'s front (or the trials ``only`` names), in ``plan.out/quality``.

    Each server gets the environment its trial ran with; the prompts are the trace's first
    requests, built as the replay builds them. ``runner``: the study's trial runner; a check
    then runs through its ``call`` on the GPUs the larger of its two servers needs.
    """
    settings = settings_of(plan.job.quality)
    workdir = Path(plan.out) / "quality"
    prompts = prompts_for(plan.trace, plan.token_range, settings)

    def env_for(args: Mapping[str, Any]) -> Mapping[str, str]:
        spec = plan.trial_spec(0, dict(args), workdir=workdir / "spec", seed=0)
        return dict(spec.engine.env)

    model = plan.engine.model
    vocab = model_info(model).vocab_size if Path(model).is_dir() else None
    call = getattr(runner, "call", None)
    place: Place | None = None
    if call is not None:
        cpu = plan.context.cpu_build

        def place(check: Callable[[], Verdict], args: Mapping[str, Any]) -> Verdict:
            gpus = max(
                gpus_per_server(args, cpu_build=cpu),
                gpus_per_server(plan.baseline_args, cpu_build=cpu),
            )
            verdict: Verdict = call(check, gpus)
            return verdict

    return gate_front(
        study,
        model=model,
        baseline_args=plan.baseline_args,
        env_for=env_for,
        prompts=prompts,
        workdir=workdir,
        settings=settings,
        python=plan.job.engine.python,
        startup_timeout_s=plan.job.engine.startup_timeout_s,
        vocab_size=vocab,
        only=only,
        progress=progress,
        place=place,
    )


def verdict_table(done: Sequence[tuple[int, Verdict]]) -> Table:
    """The gate's verdicts as a table: trial, levers, verdict, agreement, drift, floor, why."""
    table = Table(title="Quality gate (against the baseline, same weights)")
    for col in ("trial", "levers", "verdict", "top-1 agr.", "drift", "floor", "why"):
        table.add_column(
            col, justify="right" if col in ("trial", "top-1 agr.", "drift", "floor") else "left"
        )
    for number, v in done:
        c, f = v.comparison, v.floor
        style = _STYLE.get(v.status, "")
        table.add_row(
            str(number),
            escape(", ".join(sorted(v.levers)) or "-"),
            f"[{style}]{v.status}[/]" if style else v.status,
            f"{c.top1_agreement:.3f}" if c else "-",
            f"{c.mean_abs_logprob_diff:.4f}" if c else "-",
            f"{f.mean_abs_logprob_diff:.4f}" if f else "-",
            escape(v.reason),
        )
    return table


def register(sub: Any) -> None:
    """Add ``quality`` to the main parser's subparsers."""
    p = sub.add_parser(
        "quality",
        help="the quality gate: compare the front's numeric-changing configurations (or "
        "--trial) with the baseline on the same weights; verdicts kept with the study",
    )
    p.add_argument("dir", help="study folder")
    p.add_argument(
        "--trial",
        type=int,
        action="append",
        default=None,
        help="check this trial (repeatable; default: the feasible front until it holds no "
        "unchecked numeric-changing member)",
    )
    p.set_defaults(func=cmd_quality)


def cmd_quality(ns: argparse.Namespace) -> int:
    """Exit 0 when nothing checked was refused, 4 when a configuration was."""
    from optimizer.cli_support import console, load_study_dir
    from optimizer.config import load_job
    from optimizer.errors import ConfigError
    from optimizer.study import prepare

    folder = Path(ns.dir)
    saved, study = load_study_dir(folder)
    numbers = {t.number for t in study.get_trials(deepcopy=False)}
    missing = sorted(set(ns.trial or []) - numbers)
    if missing:
        raise ConfigError(
            f"--trial {missing[0]}: no such trial in {folder} (0..{len(numbers) - 1})"
        )
    job, base = load_job(saved["job"], base=folder)
    plan = prepare(job, base)
    done = gate_plan(
        plan, study, only=ns.trial, progress=lambda line: console.print(f"[dim]{escape(line)}[/]")
    )
    if not done:
        console.print("quality gate: the feasible front holds no unchecked configuration")
        return 0
    console.print(verdict_table(done))
    return 4 if any(v.refused for _n, v in done) else 0
