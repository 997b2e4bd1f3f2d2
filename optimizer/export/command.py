"""The `export` command: pick a configuration from a study, re-validate it against the
baseline, render it for deployment (the use case is :mod:`optimizer.export.workflow`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import yaml
from rich.markup import escape
from rich.table import Table

from optimizer import cli_support
from optimizer.cli_support import console, err_console
from optimizer.errors import ConfigError

__all__ = ["cmd_export", "register"]


def register(sub: Any) -> None:
    """export: pick, re-validate and render a configuration."""
    from optimizer.export import FORMATS, POLICIES

    p = sub.add_parser("export", help="pick, re-validate and export a configuration for deployment")
    p.add_argument("dir", help="study folder")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument(
        "--policy",
        default=None,
        choices=[x for x in POLICIES if x != "trial"],
        help="which front configuration to export (default: max-capacity for a capacity study, "
        "else max-throughput)",
    )
    p.add_argument("--trial", type=int, default=None, help="export this trial (overrides --policy)")
    p.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="OBJECTIVE=W",
        help="weighted policy: e.g. output_throughput=2 (repeatable)",
    )
    p.add_argument("--out", default=None, help="output file (default: DIR/export/...)")
    p.add_argument("--no-validate", action="store_true", help="skip the re-validation runs")
    p.add_argument("--runs", type=int, default=3, help="re-validation runs of each (default 3)")
    p.add_argument("--force", action="store_true", help="export even when the gain is within noise")
    p.add_argument(
        "--require-stable",
        action="store_true",
        help="refuse (exit 6) unless the trial has a stability check (`vllm-autotune stability`) "
        "that says stable and no worse than the baseline",
    )
    p.add_argument("--runner", default="ray", choices=["ray", "local"])
    _add_deployment_flags(p)
    p.add_argument(
        "--chart-schema",
        default=None,
        metavar="PATH",
        help="helm: also check the values against this chart's values.schema.json "
        "(e.g. from `helm pull --untar`); refuses to write on a mismatch",
    )
    p.set_defaults(func=cmd_export)


def _add_deployment_flags(p: Any) -> None:
    """export's flags for where a deployment format runs (:func:`_deployment`)."""
    p.add_argument(
        "--model",
        default=None,
        help="kubernetes/helm/ray-serve: the model the deployment loads (hub name or a path in "
        "the image; default: the study's model path)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="kubernetes/helm/ray-serve: the model name clients request",
    )
    p.add_argument(
        "--image",
        default=None,
        help="kubernetes/helm: container image (default: vLLM's CUDA image, or its CPU image "
        "when the deployment has no GPU)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="kubernetes/helm/ray-serve: GPUs per server (default: the configuration's "
        "tensor x pipeline parallel; 0 for a study tuned on a CPU)",
    )


def _capacity_line(study: Any, saved: dict[str, Any], number: int) -> str:
    from optimizer.analysis.capacity import answer_for_plan

    answer = answer_for_plan(study, saved)
    return answer.export_line(number) if answer is not None else ""


def _check_service_study(folder: Path, saved: dict[str, Any], choice: Any, validate: bool) -> None:
    """A study folder the service wrote is exported under the service's policy: its stored job
    and the trials to render or re-run may not load code (a study stored before the service's
    allow-lists would otherwise start a server with its plugin flag here).

    Args:
        choice: The trial to render (``chosen``) and the one to re-run with it (``baseline``).
        validate: The baseline is re-run too.

    Raises:
        ConfigError: A flag, variable or ``engine.python`` the service refuses (named).
    """
    from optimizer.service import security

    if not security.is_service_study(folder):
        return  # a local `tune` folder is its user's own
    views = {"chosen": choice.chosen, "baseline": choice.baseline if validate else None}
    labelled = [
        (f"{label} trial {v.number}'s engine arguments", v.engine_args)
        for label, v in views.items()
        if v is not None
    ]
    try:
        security.check_stored_study(saved.get("job") or {}, labelled)
    except ConfigError as exc:
        raise ConfigError(
            f"{folder}: a study the service wrote is exported under the service's policy; "
            f"refusing: {exc}"
        ) from None


def cmd_export(ns: argparse.Namespace) -> int:
    from optimizer import export as ex

    if ns.chart_schema and ns.format != "helm":
        raise ConfigError("--chart-schema checks Helm values: use it with --format helm")
    if ns.chart_schema:  # a bad schema file fails now, not after minutes of re-validation
        ex.helm_schema_problems({}, Path(ns.chart_schema))
    folder = Path(ns.dir)
    saved, study = cli_support.load_study_dir(folder)
    weights = ex.parse_weights(ns.weight)
    choice = ex.choose(study, ns.policy, trial_number=ns.trial, weights=weights)
    _check_service_study(folder, saved, choice, not ns.no_validate)
    choice, refused = _quality_gate(ns, folder, saved, study, choice, weights)
    if refused:
        return refused
    console.print(
        f"policy {choice.policy}: trial {choice.chosen.number} "
        f"changes {choice.changes() or 'nothing'} vs the baseline"
    )
    refused = _stability_gate(ns, folder, choice.chosen.number)
    if refused:
        return refused
    if ns.no_validate:
        gain = _gain_without_validation(study, choice)
    else:
        val = _revalidate(ns, folder, saved, study, choice)
        console.print(_validation_table(val, ns.runs))
        _print_verdict(val, study, choice)
        gain, problems = ex.verdict(val, choice.policy, force=ns.force)
        if problems and not ns.force:
            err_console.print(
                "[bold red]refusing to export:[/] "
                + "; ".join(problems)
                + " (use --force to export anyway)"
            )
            return 4
    text = _render_export(ns, saved, study, choice, gain, folder)
    if ns.chart_schema:
        problems = ex.helm_schema_problems(yaml.safe_load(text), Path(ns.chart_schema))
        if problems:
            err_console.print(
                f"[bold red]refusing to export:[/] the values break {ns.chart_schema}:\n  "
                + "\n  ".join(problems)
            )
            return 5
        console.print(f"helm values valid against {ns.chart_schema}")
    path = ex.write_export(
        text, Path(ns.out) if ns.out else folder / "export" / ex.default_filename(ns.format)
    )
    # Finished trials are immutable in Optuna: the export is recorded on the study.
    exports = list(study.user_attrs.get("exports", []))
    exports.append(
        {
            "trial": choice.chosen.number,
            "format": ns.format,
            "policy": choice.policy,
            "path": str(path),
            "gain": gain,
        }
    )
    study.set_user_attr("exports", exports)
    console.print(f"wrote {path}")
    if saved["job"].get("mlflow", {}).get("enabled", True):
        from optimizer.tracking import log_export

        if log_export(
            folder,
            trial=choice.chosen.number,
            fmt=ns.format,
            path=path,
            policy=choice.policy,
            gain=gain,
        ):
            console.print("[dim]logged to the study's MLflow parent run[/]")
    return 0


def _quality_gate(
    ns: argparse.Namespace,
    folder: Path,
    saved: dict[str, Any],
    study: Any,
    choice: Any,
    weights: Any,
) -> tuple[Any, int]:
    """The quality gate at export: a chosen configuration that changes numerics and was not
    checked is checked now (re-validation only: ``--no-validate`` runs no server); one the
    gate refuses is replaced by the policy's next choice, or, named with ``--trial``, refused
    (exit 4) unless ``--force``. Returns the choice and 0, or the exit status."""
    from optimizer import export as ex
    from optimizer.quality.levers import numeric_changes
    from optimizer.trial_view import TrialView, baseline_of, quality_verdicts

    job = saved.get("job") or {}
    enabled = bool((job.get("quality") or {}).get("enabled", True))
    base = baseline_of(study)
    base_args = TrialView(base).engine_args if base is not None else {}
    while True:
        number = choice.chosen.number
        verdict = quality_verdicts(study).get(number)
        levers = numeric_changes(choice.chosen.engine_args, base_args)
        if verdict is None and levers and enabled and not ns.no_validate:
            from optimizer.config import load_job
            from optimizer.quality_check import gate_plan
            from optimizer.study import prepare

            console.print(
                f"quality gate: trial {number} changes {', '.join(sorted(levers))}: checking "
                "it against the baseline"
            )
            job_config, base_dir = load_job(job, base=folder)
            gate_plan(
                prepare(job_config, base_dir),
                study,
                only=[number],
                progress=lambda line: console.print(f"[dim]{line}[/]"),
            )
            verdict = quality_verdicts(study).get(number)
        if verdict is None or verdict.get("status") != "fail":
            return choice, 0
        why = f"trial {number} was refused by the quality gate: {verdict.get('reason')}"
        if choice.policy == "trial":
            if ns.force:
                err_console.print(f"[yellow]{why}; exporting it anyway (--force)[/]")
                return choice, 0
            err_console.print(f"[bold red]refusing to export:[/] {why} (use --force to export it)")
            return choice, 4
        console.print(f"[yellow]{why}; the policy's next choice[/]")
        try:
            choice = ex.choose(study, ns.policy, trial_number=ns.trial, weights=weights)
        except ConfigError as exc:
            err_console.print(f"[bold red]refusing to export:[/] {exc}")
            return choice, 4


def _stability_gate(ns: argparse.Namespace, folder: Path, trial: int) -> int:
    """``--require-stable``: 6 and one line saying why and what to run when the trial's
    stability check does not let it ship; else 0 (and a hint when it has no check)."""
    from optimizer.stability.stored import require_stable, stability_hint

    if ns.require_stable:
        why = require_stable(folder, trial)
        if why is not None:
            err_console.print(f"[bold red]refusing to export:[/] {escape(why)}", soft_wrap=True)
            return 6
        console.print(f"stability check of trial {trial}: stable, no worse than the baseline")
        return 0
    hint = stability_hint(folder, trial)
    if hint is not None:
        console.print(f"[dim]hint: {escape(hint)}[/]", soft_wrap=True)
    return 0


def _with_stability_note(ctx: Any, folder: Path, trial: int) -> Any:
    """The export header with the study's stability check of this trial (issue 18), if any."""
    import dataclasses

    from optimizer.stability.stored import header_note

    return dataclasses.replace(ctx, notes=(*ctx.notes, *header_note(folder, trial)))


def _with_quality_notes(ctx: Any, study: Any, trial: int) -> Any:
    """The export header with the quality gate's verdict on this trial and its refusals."""
    import dataclasses

    from optimizer.quality.stage import quality_notes

    return dataclasses.replace(ctx, notes=(*ctx.notes, *quality_notes(study, trial)))


def _render_export(
    ns: argparse.Namespace,
    saved: dict[str, Any],
    study: Any,
    choice: Any,
    gain: str,
    folder: Path,
) -> str:
    """The export file's text (with the study's stability note); a deployment format's
    warnings printed too."""
    from optimizer import export as ex

    ctx = ex.context(
        saved,
        choice,
        gain,
        capacity=_capacity_line(study, saved, choice.chosen.number),
        deployment=_deployment(ns),
    )
    ctx = _with_stability_note(ctx, folder, choice.chosen.number)
    ctx = _with_quality_notes(ctx, study, choice.chosen.number)
    if ns.format in ex.DEPLOY_FORMATS:
        for note in ctx.deploy_notes():
            console.print(f"[yellow]{note}[/]")
    unknown: list[str] = []
    if ns.format == "ray-serve":
        ctx, unknown = _ray_serve_check(ctx)
    return str(ex.render(ns.format, ctx, unknown_flags=unknown))


def _deployment(ns: argparse.Namespace) -> Any:
    """``--model``, ``--served-model-name``, ``--image``, ``--gpus`` for a deployment format."""
    from optimizer import export as ex

    given = {k: getattr(ns, k, None) for k in ("model", "served_model_name", "image", "gpus")}
    if ns.format not in ex.DEPLOY_FORMATS and any(v is not None for v in given.values()):
        flags = ", ".join("--" + k.replace("_", "-") for k, v in given.items() if v is not None)
        raise ConfigError(
            f"{flags}: for a deployment ({', '.join(ex.DEPLOY_FORMATS)}); --format {ns.format} "
            "runs on the tuning machine as tuned"
        )
    if given["gpus"] is not None and given["gpus"] < 0:
        raise ConfigError(f"--gpus {given['gpus']}: give 0 (CPU) or more")
    return ex.Deployment(**given)


def _revalidate(
    ns: argparse.Namespace, folder: Path, saved: dict[str, Any], study: Any, choice: Any
) -> Any:
    """Re-run the choice and the baseline here, through the runner ``--runner`` names."""
    from optimizer import export as ex

    return ex.revalidate_job(
        saved["job"],
        folder,
        study,
        choice,
        lambda plan: cli_support.make_runner(ns.runner, plan, None),
        label=f"trial-{choice.chosen.number}",
        runs=ns.runs,
        progress=lambda line: console.print(f"[dim]{line}[/]"),
    )


def _print_verdict(val: Any, study: Any, choice: Any) -> None:
    """Which gains cleared the noise of the re-runs, and the policy's own result."""
    from optimizer import export as ex

    for line in ex.verdict_lines(val, study, choice):
        console.print(f"  {line}")


def _gain_without_validation(study: Any, choice: Any) -> str:
    """``--no-validate``: an earlier re-validation of the same trial, else the study's values."""
    from optimizer import export as ex

    stored = ex.stored_gain(study, choice.chosen.number)
    if stored is not None:
        console.print(f"not re-run: reusing the earlier re-validation of this trial: {stored}")
        return stored
    return str(ex.unvalidated_gain(study, choice))


def _validation_table(val: Any, runs: int) -> Table:
    table = Table(title=f"re-validation: {runs} runs each, medians and ranges")
    for col in ("objective", "baseline", "chosen", "gain (range)"):
        table.add_column(col, justify="right")
    for row in val.table():
        b_lo, b_hi = row["baseline_range"]
        c_lo, c_hi = row["chosen_range"]
        g_lo, g_hi = row["gain_range_pct"]
        table.add_row(
            row["metric"],
            f"{row['baseline_median']:,.1f} [{b_lo:,.1f}-{b_hi:,.1f}]",
            f"{row['chosen_median']:,.1f} [{c_lo:,.1f}-{c_hi:,.1f}]",
            _gain_cell(row["gain_pct"], g_lo, g_hi, row["baseline_median"]),
        )
    return table


def _gain_cell(gain: float, lo: float, hi: float, baseline: float) -> str:
    """``+14.0% [+9.1% .. +18.2%]``; a gain over a zero baseline has no percentage."""

    if baseline == 0 or not math.isfinite(gain):
        return "from 0 (no ratio)" if baseline == 0 else "-"
    return f"{gain:+.1f}% [{lo:+.1f}% .. {hi:+.1f}%]"


def _ray_serve_check(ctx: Any) -> tuple[Any, list[str]]:
    """The Ray Serve export's flag check: the context with a header note when the flags could
    not be checked against the vLLM ``ray[llm]`` pins, and the flags that vLLM rejects."""
    import dataclasses

    unknown, note = _ray_llm_unknown_flags(list(ctx.deploy_args()))
    if note:
        console.print(f"[yellow]{note}[/]")
        ctx = dataclasses.replace(ctx, notes=(*ctx.notes, note))
    return ctx, unknown


def _ray_llm_unknown_flags(flags: list[str]) -> tuple[list[str], str]:
    """Flags the vLLM that ``ray[llm]`` pins does not accept, and a note when that could not
    be checked (no pin found, or the installed vLLM is another version): then no flag is
    claimed unknown, the note says what was and was not checked."""
    import importlib.metadata as md
    import re

    from optimizer.engine.flags import accepted_flags, installed_vllm

    try:
        reqs = md.requires("ray") or []
    except md.PackageNotFoundError:
        return [], "Ray is not installed here: the flags were not checked against ray[llm]'s vLLM"
    pin = next(
        (
            m.group(1)
            for r in reqs
            if (m := re.match(r"vllm(?:\[[^]]*\])?==([\w.]+).*extra == .llm.", r))
        ),
        None,
    )
    try:
        inst = installed_vllm()
    except ConfigError:
        return [], "no vLLM installed here: the flags were not checked against ray[llm]'s vLLM"
    known = accepted_flags(inst)
    rejected = [f for f in flags if f not in known]
    if pin is None or inst.version != pin:
        return rejected, (
            f"ray[llm] pins vLLM {pin or '(no pin found)'}; the flags were checked against "
            f"the vLLM installed here ({inst.version}) only"
        )
    return rejected, ""
