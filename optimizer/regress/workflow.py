"""A study folder's regression check: the configuration export would ship and the baseline,
re-measured with what is installed now, against what the study recorded.

The study's plan is prepared again here (as ``stability`` and ``export`` do), so the runs replay
the study's trace, SLOs and capacity search on this machine's vLLM, model and hardware. Each
configuration runs ``runs`` times, alternating with the baseline (as export's re-validation
does), a replay the client could not keep on schedule re-run. The figures (the study's
objectives and its SLOs' metrics) are compared by :mod:`.compare`; the document goes to
``regress.json`` in the study folder, the runs' files under ``regress/TIME/``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from objectives import parse_slo
from optimizer.errors import AutotuneError, ConfigError
from optimizer.regress.compare import ConfigComparison, compare_figure, compare_slos, verdict
from optimizer.report import gain_pct
from optimizer.trial_view import TrialView, gpus_per_server
from optimizer.types import TrialResult, TrialStatus

if TYPE_CHECKING:
    from optimizer.runners import TrialRunner
    from optimizer.study import StudyPlan

__all__ = [
    "REGRESS_FILE",
    "RegressOptions",
    "compare_config",
    "figures_of",
    "read_regress",
    "recorded_summaries",
    "run_regress",
]

REGRESS_FILE = "regress.json"
# Capacity studies: P95s at the search's nominal scale, the one load every run shares.
_NOMINAL = ("nominal_p95_ttft_ms", "nominal_p95_tpot_ms")


@dataclass(frozen=True)
class RegressOptions:
    """What the user chose.

    Attributes:
        trial: The configuration to check (None: the trial export's default policy picks).
        runs: Runs of each configuration now.
        baseline: Run the baseline too.
        min_change_pct: The smallest change of a figure's median that counts (see
            :mod:`.compare`).
        retries: Extra attempts for a run whose replay could not keep its schedule.
    """

    trial: int | None = None
    runs: int = 3
    baseline: bool = True
    min_change_pct: float = 5.0
    retries: int = 2

    def check(self) -> None:
        """Raises ConfigError on a run count below 1 or a negative floor."""
        if self.runs < 1:
            raise ConfigError(f"--runs {self.runs}: give 1 or more runs of each configuration")
        if not (self.min_change_pct >= 0 and math.isfinite(self.min_change_pct)):
            raise ConfigError(f"--min-change {self.min_change_pct}: give a percentage >= 0")


def figures_of(saved: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(figure, direction) of a study's ``plan.json``: its objectives, then its SLOs' metrics;
    a capacity study also gets the P95s at its nominal scale.

    Raises:
        ConfigError: ``plan.json`` names no objective, or one it cannot read.
    """
    out: dict[str, str] = {}
    for item in saved.get("objectives") or []:
        direction, sep, metric = str(item).partition(":")
        if not sep or direction not in ("maximize", "minimize"):
            raise ConfigError(f"plan.json: objective {item!r} is not DIRECTION:METRIC")
        out.setdefault(metric, direction)
    if not out:
        raise ConfigError("plan.json names no objective: not a study folder `tune` wrote")
    if "capacity_rps" in out:
        for metric in _NOMINAL:
            out.setdefault(metric, "minimize")
    for text in saved.get("slos") or []:
        slo = parse_slo(str(text))
        out.setdefault(slo.metric, "minimize" if slo.op in ("<=", "<") else "maximize")
    return list(out.items())


def recorded_summaries(folder: Path, view: TrialView) -> list[dict[str, float]]:
    """The study's summary of a trial, then those of export's re-validation runs of the same
    engine arguments (``validation/*/*/result.json``, complete ones only)."""
    out = [view.summary]
    for path in sorted(Path(folder).glob("validation/*/*/result.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("status") == "complete" and doc.get("engine_args") == view.engine_args:
            raw = doc.get("summary") or {}
            out.append({str(k): _num(v) for k, v in raw.items()})
    return out


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _floor(view: TrialView, figure: str, min_change_pct: float) -> float:
    """A capacity is only known to within its search's bracket: that width is its floor."""
    cap = view.capacity
    if figure == "capacity_rps" and cap is not None and math.isfinite(cap.bracket_width):
        return max(min_change_pct, 100.0 * cap.bracket_width)
    return min_change_pct


def compare_config(
    label: str,
    view: TrialView,
    recorded: Sequence[Mapping[str, float]],
    now: Sequence[TrialResult],
    figures: Sequence[tuple[str, str]],
    feasible: Callable[[Mapping[str, float]], bool],
    *,
    min_change_pct: float,
) -> ConfigComparison:
    """One configuration's comparison: its figures, its SLOs, its failed runs now."""
    measured = [r for r in now if r.status is TrialStatus.COMPLETE]
    rows = tuple(
        compare_figure(
            figure,
            direction,
            [s.get(figure, math.nan) for s in recorded],
            [r.summary.get(figure, math.nan) for r in measured],
            floor_pct=_floor(view, figure, min_change_pct),
        )
        for figure, direction in figures
    )
    lines = {
        i: f"run {i + 1}: {r.status.value}"
        + (f" ({r.failure_class.value})" if r.failure_class else "")
        + (f": {r.message[:200]}" if r.message else "")
        for i, r in enumerate(now)
        if r.status is not TrialStatus.COMPLETE
    }
    invalid = {i for i, r in enumerate(now) if r.status is TrialStatus.INVALID_REPLAY}
    slos = compare_slos(
        view.feasible if view.measured else None, [feasible(r.summary) for r in measured]
    )
    return ConfigComparison(
        label,
        view.number,
        rows,
        slos,
        runs=len(now),
        failures=tuple(v for i, v in lines.items() if i not in invalid),
        unscored=tuple(v for i, v in lines.items() if i in invalid),
    )


def _gains(saved: Mapping[str, Any], configs: Sequence[ConfigComparison]) -> list[dict[str, Any]]:
    """Per objective, the chosen configuration's gain over the baseline, recorded and now."""
    by = {c.label: c for c in configs}
    if "chosen" not in by or "baseline" not in by:
        return []
    out = []
    for item in saved.get("objectives") or []:
        metric = str(item).partition(":")[2]
        direction = optuna.study.StudyDirection[str(item).partition(":")[0].upper()]
        rows = {k: next(r for r in c.figures if r.figure == metric) for k, c in by.items()}
        out.append(
            {
                "figure": metric,
                "recorded_pct": gain_pct(
                    rows["chosen"].recorded, rows["baseline"].recorded, direction
                ),
                "now_pct": gain_pct(rows["chosen"].now, rows["baseline"].now, direction),
            }
        )
    return out


def _measure(
    plan: StudyPlan,
    configs: Sequence[tuple[str, TrialView]],
    submit: Callable[[Any, int], TrialResult],
    *,
    workdir: Path,
    options: RegressOptions,
    progress: Callable[[str], None],
) -> dict[str, list[TrialResult]]:
    """Every configuration ``runs`` times, alternating; an invalid replay is re-run."""
    out: dict[str, list[TrialResult]] = {label: [] for label, _ in configs}
    cpu_build = plan.context.cpu_build
    for k in range(options.runs):
        for i, (label, view) in enumerate(configs):
            for attempt in range(options.retries + 1):
                spec = plan.trial_spec(
                    view.number,
                    view.engine_args,
                    workdir=workdir / f"{label}-{k}" / f"attempt-{attempt}",
                    seed=800_000 + 100 * k + 10 * attempt + i,
                    early_stop=False,
                )
                result = submit(spec, gpus_per_server(view.engine_args, cpu_build=cpu_build))
                if result.status is not TrialStatus.INVALID_REPLAY:
                    break
            out[label].append(result)
            progress(
                f"{label} (trial {view.number}) run {k + 1}/{options.runs}: {result.status.value}"
            )
    return out


def read_regress(folder: Path) -> dict[str, Any] | None:
    """The study folder's ``regress.json`` (None: none, or unreadable)."""
    try:
        doc = json.loads((Path(folder) / REGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def prepare_again(folder: Path, saved: Mapping[str, Any]) -> StudyPlan:
    """The study's plan, prepared again here, its output folder the study folder now. Flags
    are checked per configuration (:func:`_flag_problems`), not over the whole search space:
    an upgrade that drops a flag the two configurations do not use is no regression of theirs.
    """
    from optimizer.config import load_job
    from optimizer.study import prepare

    job = dict(saved.get("job") or {})
    if not job:
        raise ConfigError("plan.json has no job: not a study folder `tune` wrote")
    job["out"] = "."  # folders of older versions recorded the folder where they were written
    job_config, base = load_job(job, base=folder)
    return prepare(job_config, base, check_flags=False)


def _flag_problems(plan: StudyPlan, configs: Sequence[tuple[str, TrialView]]) -> dict[str, str]:
    """label -> why the installed vLLM refuses that configuration's flags (none: absent)."""
    from optimizer.engine.flags import accepted_flags, installed_vllm, validate_engine_args

    flags = accepted_flags(installed_vllm(plan.job.engine.python))
    out = {}
    for label, view in configs:
        try:
            validate_engine_args(view.engine_args, flags)
        except AutotuneError as exc:
            out[label] = f"the installed vLLM refuses its flags: {exc}"
    return out


def _configs(
    study: optuna.Study, options: RegressOptions
) -> tuple[str, list[tuple[str, TrialView]]]:
    """The policy and the configurations to re-measure: the chosen one, then the baseline.

    Raises:
        ConfigError: No trial to choose, or no measured baseline to re-measure.
    """
    from optimizer.export import choose

    choice = choose(study, None, trial_number=options.trial)
    configs = [("chosen", choice.chosen)]
    base = choice.baseline
    if options.baseline and (base is None or not base.measured):
        raise ConfigError(
            "the study has no measured baseline to re-measure; use --no-baseline to check the "
            "chosen configuration alone"
        )
    if options.baseline and base is not None and base.number != choice.chosen.number:
        configs.append(("baseline", base))
    return choice.policy, configs


def run_regress(
    folder: Path,
    saved: Mapping[str, Any],
    study: optuna.Study,
    options: RegressOptions,
    make_runner: Callable[[StudyPlan], TrialRunner],
    *,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Re-measure the chosen configuration (and the baseline) now; write and return the
    ``regress.json`` document.

    Args:
        folder: The study folder.
        saved: Its ``plan.json``.
        study: The study.
        options: What to run and how to judge it.
        make_runner: The runner the runs go to (the CLI's ``--runner``); closed after.
        progress: Called with a line per step.

    Raises:
        ConfigError: Bad options, no trial to choose, no baseline, no vLLM installed.
    """
    from optimizer.engine.stack import installed_stack, recorded_stack, stack_changes

    options.check()
    say = progress or (lambda _: None)
    figures = figures_of(saved)
    policy, configs = _configs(study, options)
    plan = prepare_again(folder, saved)
    then = recorded_stack(saved)
    now_stack = installed_stack(plan.job.engine.python, cpu_build=plan.context.cpu_build)
    for line in stack_changes(then, now_stack) or ["nothing the study recorded differs"]:
        say(f"installed since the study: {line}")
    unknown = [k for k in now_stack if k not in then]
    if unknown:
        say(f"not recorded at the study: {', '.join(unknown)}")
    refused = _flag_problems(plan, configs)
    runs_dir = Path(folder) / "regress" / time.strftime("%Y%m%d-%H%M%S")
    runner = make_runner(plan)
    try:
        now = _measure(
            plan,
            [c for c in configs if c[0] not in refused],
            lambda spec, gpus: runner.submit(spec, gpus).future.result(),
            workdir=runs_dir,
            options=options,
            progress=say,
        )
    finally:
        runner.close()
    for label, message in refused.items():
        number = dict(configs)[label].number
        now[label] = [TrialResult(number=number, status=TrialStatus.FAILED, message=message)]

    def feasible(summary: Mapping[str, float]) -> bool:
        return all(m <= 0 for m in plan.objectives.constraints(summary))

    comparisons = [
        compare_config(
            label,
            view,
            recorded_summaries(folder, view),
            now[label],
            figures,
            feasible,
            min_change_pct=options.min_change_pct,
        )
        for label, view in configs
    ]
    doc = regress_doc(saved, policy, comparisons, options, then, now_stack)
    doc["configurations"] = {
        c.label: {**c.doc(), "engine_args": view.engine_args}
        for c, (_, view) in zip(comparisons, configs, strict=True)
    }
    doc["runs_dir"] = _relative(runs_dir, Path(folder))
    (Path(folder) / REGRESS_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def regress_doc(
    saved: Mapping[str, Any],
    policy: str,
    comparisons: Sequence[ConfigComparison],
    options: RegressOptions,
    then: Mapping[str, str],
    now: Mapping[str, str],
) -> dict[str, Any]:
    """The ``regress.json`` document (without the runs' folder and engine arguments)."""
    from optimizer.engine.stack import stack_changes

    line, worse = verdict(comparisons)
    by = {c.label: c for c in comparisons}
    return {
        "study": saved.get("study"),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "policy": policy,
        "trial": by["chosen"].trial,
        "baseline_trial": by["baseline"].trial if "baseline" in by else None,
        "runs": options.runs,
        "min_change_pct": options.min_change_pct,
        "installed": {"study": dict(then), "now": dict(now)},
        "installed_changes": stack_changes(then, now),
        "verdict": line,
        "regressed": bool(worse),
        "measured": not any(c.not_measured for c in comparisons),
        "worse": worse,
        "better": [b for c in comparisons for b in c.better()],
        "gain_vs_baseline": _gains(saved, comparisons),
        "configurations": {c.label: c.doc() for c in comparisons},
    }


def _relative(path: Path, folder: Path) -> str:
    try:
        return path.relative_to(folder).as_posix()
    except ValueError:
        return str(path)
