"""report.md: a study in Markdown (baseline vs the front, what winners changed, capacity, the
stability check, importances, a diagnosis per trial class, the trace)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.analysis.diagnosis import diagnose
from optimizer.analysis.front import trial_class
from optimizer.analysis.trial_cost import study_cost
from optimizer.config import SamplerSection
from optimizer.quality.levers import numeric_changes
from optimizer.trial_view import TrialView, baseline_of, metric_names, quality_verdicts
from search_spaces.speculation import stated_acceptance

__all__ = [
    "capacity_section",
    "headline_md",
    "quality_section",
    "report_md",
    "stability_section",
]


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:,.{digits}f}"


def capacity_section(study: optuna.Study, plan: dict[str, Any]) -> list[str]:
    """report.md's capacity section (capacity studies only): the answer and every trial."""
    from optimizer.analysis.capacity import answer_for_plan

    answer = answer_for_plan(study, plan)
    if answer is None:
        return []
    lines = ["", "## Capacity at SLO", ""]
    lines += [f"- {line}" for line in answer.lines()]
    lines += [
        "",
        "| trial | capacity req/s | how measured | output tok/s | rate scale | bracket | steps "
        "| broke first | KV cache tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in answer.trials:
        label = f"{c.number} (baseline)" if answer.baseline and c is answer.baseline else c.number
        lines.append(
            f"| {label} | {c.rps:.3g} | {c.answer} | {c.output_tps:.4g} | {c.scale:.3g} | "
            f"{c.bracket} | {c.steps} | {c.broke_first or '-'} | "
            f"{f'{c.kv_cache_tokens:,}' if c.kv_cache_tokens else '-'} |"
        )
    return lines


def warm_start_section(study: optuna.Study, plan: dict[str, Any]) -> list[str]:
    """Where the warm-start configurations came from and what they measured here."""
    sources = plan.get("warm_start") or []
    priors = plan.get("warm_start_priors") or {}
    if not sources and not priors.get("trials") and not priors.get("notes"):
        return []
    lines = ["", "## Warm start", "", _priors_line(plan, priors), ""]
    if sources:
        lines += ["Enqueued after the baseline from earlier studies (measured again here):", ""]
    here = {
        t.user_attrs.get("warm_start_from"): t
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("warm_start_from")
    }
    for w in sources:
        origin = f"{w['folder']} trial {w['trial']}"
        t = here.get(origin)
        now = "not run yet" if t is None else f"trial {t.number} here, {_here_values(study, t)}"
        lines.append(f"- {_cell(origin)} ({_cell(w['measured'])} there): {_cell(now)}")
    return lines


def _priors_line(plan: dict[str, Any], priors: dict[str, Any]) -> str:
    """What the sampler was given from the earlier studies, in words."""
    default = SamplerSection().name  # a plan written without the name: the default's
    sampler = ((plan.get("job") or {}).get("sampler") or {}).get("name", default)
    given = int(priors.get("trials") or 0)
    per = priors.get("per_study") or {}
    text = (
        f"The {sampler} sampler was given {given} told trials of the earlier studies as prior "
        "observations (values measured there, not here): "
        + ", ".join(f"{_cell(str(k))} {v}" for k, v in per.items())
        + "."
        if given
        else "The sampler was given no prior trials."
    )
    notes = priors.get("notes") or []
    return text + "".join(f" {_cell(str(n))}." for n in notes)


def _here_values(study: optuna.Study, trial: Any) -> str:
    view = TrialView(trial)
    if not view.measured:
        return view.status
    names = study.metric_names or []
    return ", ".join(f"{n} {v:.4g}" for n, v in zip(names, trial.values or [], strict=False))


def headline_md(
    doc: list[dict[str, Any]],
    best: dict[str, tuple[float, int]],
    *,
    stability: dict[str, Any] | None = None,
) -> str:
    """The few lines a reviewer reads first (the parent run's description): the best gain over
    the baseline per objective, as measured during the study, and the stability check's
    result when there is one.

    Args:
        doc: :func:`~optimizer.analysis.front.front_doc`.
        best: :func:`~optimizer.analysis.front.best_gains`.
        stability: The study folder's ``stability.json`` (None: no check).
    """
    base = next((r for r in doc if r["baseline"]), None)
    front = [r["trial"] for r in doc if not r["baseline"]]
    lines = [
        "**Best gain over the baseline** (vLLM defaults; positive = better; measured once "
        "during the study, re-measured only by `export`):",
        "",
    ]
    if base is None:
        lines.append("- no measured baseline: nothing to compare with")
    elif not front:
        lines.append("- no feasible configuration beyond the baseline yet")
    elif not best:
        lines.append(
            "- not a percentage: the baseline measured 0 or nothing comparable (values below)"
        )
    for name, (gain, trial) in best.items():
        lines.append(f"- {name}: {gain:+.1f}% (trial {trial})")
    if stability:
        lines += ["", _stability_headline(stability)]
    lines += [
        "",
        f"Pareto front (feasible): {front or 'empty'}; the full report follows and is "
        "the `report.md` artifact.",
        "",
    ]
    return "\n".join(lines)


def _stability_headline(doc: dict[str, Any]) -> str:
    worse = [str(w).split(":", 1)[0] for w in doc.get("worse_than_baseline") or []]
    line = f"**Stability check** of trial {doc.get('trial')}: {doc.get('status', '?')}"
    if worse:
        line += f", **worse than the baseline** on {', '.join(worse)}"
    return line + ' (section "Stability check" below; plots in the `stability` artifacts).'


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _plan_line(plan: dict[str, Any], slos: list[str]) -> str:
    """The plan in one line: each phase's length and rate scale, the long inputs, the SLOs."""
    parts = []
    for p in plan.get("phases") or []:
        seconds = float(p.get("end_s", 0)) - float(p.get("start_s", 0))
        parts.append(f"{p.get('name')} {seconds:g} s at rate x{float(p.get('scale', 0)):.3g}")
    settings = plan.get("settings") or {}
    line = "; ".join(parts) or "no phases"
    if plan.get("long_input_tokens"):
        line += (
            f"; long inputs of {plan['long_input_tokens']} prompt tokens "
            f"(max-model-len {plan.get('max_model_len')}), {settings.get('long_group')} every "
            f"{settings.get('long_every_s')} s"
        )
    line += f"; latency windows of {settings.get('window_s')} s"
    return line + f"; SLOs: {', '.join(slos) or 'none'}"


def stability_section(doc: dict[str, Any] | None) -> list[str]:
    """report.md's "Stability check" section from ``stability.json`` ([] without one): the
    status, what the chosen configuration did worse than the baseline, the plan, and every
    verdict of each run side by side."""
    if not doc or not doc.get("runs"):
        return []
    runs: dict[str, Any] = doc["runs"]
    trials = {"chosen": doc.get("trial"), "baseline": doc.get("baseline_trial")}
    heads = [f"{k} (trial {trials[k]})" if trials.get(k) is not None else k for k in runs]
    lines = ["", "## Stability check", ""]
    lines.append(
        f"- trial {doc.get('trial')} (policy {doc.get('policy', '-')}), checked "
        f"{doc.get('written_at', '?')}: **{doc.get('status', '?')}**"
    )
    worse = doc.get("worse_than_baseline") or []
    if "baseline" not in runs:
        lines.append("- no baseline run: nothing to compare with")
    elif not worse:
        lines.append("- no verdict worse than the baseline's")
    lines += [f"- **worse than the baseline**: {_cell(w)}" for w in worse]
    lines.append(f"- plan: {_plan_line(doc.get('plan') or {}, list(doc.get('slos') or []))}")
    lines.append(f"- runs, samples, records and plots: `{doc.get('runs_dir', '-')}/`")
    lines += ["", "| verdict | " + " | ".join(heads) + " |", "|---|" + "---|" * len(runs)]
    names: list[str] = []
    for run in runs.values():
        names += [v["name"] for v in run.get("verdicts") or [] if v["name"] not in names]
    for name in names:
        cells = []
        for run in runs.values():
            v = next((v for v in run.get("verdicts") or [] if v["name"] == name), None)
            status = "" if v is None else v["status"]
            status = f"**{status}**" if status == "fail" else status
            cells.append("-" if v is None else f"{status}: {_cell(v['text'])}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    failures = [_cell(run.get("failure") or "served") for run in runs.values()]
    if any(run.get("failure") for run in runs.values()):
        lines.append("| server | " + " | ".join(failures) + " |")
    return lines


def report_md(
    study: optuna.Study,
    doc: list[dict[str, Any]],
    front: set[int],
    hv: dict[int, float],
    importances: dict[str, Any],
    plan: dict[str, Any],
    trace: dict[str, Any],
    *,
    stability: dict[str, Any] | None = None,
) -> str:
    """report.md: the study's facts, baseline vs the front, capacity, the stability check,
    what the winners changed, parameter importances, a diagnosis per trial class, and the
    trace.

    Args:
        study: The study.
        doc: :func:`~optimizer.analysis.front.front_doc`.
        front: Numbers of the front's trials.
        hv: :func:`~optimizer.analysis.hypervolume.hypervolume_history`.
        importances: :func:`~optimizer.analysis.front.importances`.
        plan: The study folder's plan.json ({} when missing).
        trace: review/trace.json: the trace's statistics and shaping notes ({} when missing).
        stability: The study folder's ``stability.json`` (None: no check).
    """
    trials = study.get_trials(deepcopy=False)
    over = [t for t in trials if t.state not in (TrialState.RUNNING, TrialState.WAITING)]
    base = baseline_of(study)
    base_args = TrialView(base).engine_args if base else {}
    stats = trace.get("stats") if isinstance(trace.get("stats"), dict) else None
    lines = [f"# Study `{study.study_name}`", ""]
    lines += _facts(study, plan, over, front, hv)
    lines += _front_table(study, doc)
    lines += capacity_section(study, plan)
    lines += warm_start_section(study, plan)
    if stability and not stability.get("slos"):  # a check written before it kept its SLOs
        stability = {**stability, "slos": plan.get("slos") or []}
    lines += stability_section(stability)
    lines += quality_section(study)
    lines += study_cost(over).markdown()
    lines += _winners(doc, base_args)
    lines += _importance_lines(importances)
    lines += _diagnoses(over, base, front, stats)
    lines += _trace_lines(trace.get("notes") or [], stats)
    return "\n".join(lines).rstrip() + "\n"


def quality_section(study: optuna.Study) -> list[str]:
    """report.md's "Quality gate" section: every verdict, refused ones first ([]: none)."""
    verdicts = quality_verdicts(study)
    if not verdicts:
        return []
    base = baseline_of(study)
    base_args = TrialView(base).engine_args if base else {}
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    lines = [
        "## Quality gate",
        "",
        "Numeric-changing members of the feasible front against the baseline on the same "
        "weights (teacher-forced on the baseline's greedy answers; drift over the floor of two "
        "baseline passes). A refused configuration is never exported as a win.",
        "",
        "| trial | levers | verdict | top-1 agreement | logprob drift | floor | why |",
        "|---|---|---|---|---|---|---|",
    ]
    order = sorted(verdicts, key=lambda n: (verdicts[n].get("status") != "fail", n))
    for number in order:
        doc = verdicts[number]
        trial = by_number.get(number)
        levers = numeric_changes(TrialView(trial).engine_args, base_args) if trial else {}
        comparison = doc.get("comparison") or {}
        floor = doc.get("floor") or {}
        lines.append(
            f"| {number} | {_cell(', '.join(sorted(levers)) or '-')} | {doc.get('status')} | "
            f"{_fmt(comparison.get('top1_agreement'), 3)} | "
            f"{_fmt(comparison.get('mean_abs_logprob_diff'), 4)} | "
            f"{_fmt(floor.get('mean_abs_logprob_diff'), 4)} | {_cell(doc.get('reason', ''))} |"
        )
    return [*lines, ""]


def _facts(
    study: optuna.Study,
    plan: dict[str, Any],
    over: list[FrozenTrial],
    front: set[int],
    hv: dict[int, float],
) -> list[str]:
    lines = []
    if plan:
        lines += [
            f"- vLLM: {plan.get('vllm') or '-'}",
            f"- trace: `{Path(str(plan.get('trace', '-'))).name}`, "
            f"{plan.get('requests', '-')} requests after shaping",
            f"- objectives: {', '.join(plan.get('objectives', []))}",
            f"- SLOs: {', '.join(plan.get('slos', [])) or 'none'}",
        ]
        stated = stated_acceptance(plan)
        if stated:
            lines.append(
                f"- speculative decoding measured at a stated {stated} (vLLM's synthetic "
                "rejection sampler): the trials with speculation assumed it; a real draft's "
                "acceptance decides what a deployment gets"
            )
    counts = Counter(TrialView(t).status for t in over)
    lines += [
        f"- trials: {len(study.get_trials(deepcopy=False))} ("
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"), Pareto front (feasible): {len(front)}",
    ]
    if hv:
        last = max(hv.items(), key=lambda kv: kv[0])
        lines.append(
            f"- hypervolume {last[1]:.3f} after trial {last[0]} (baseline alone = 1.000; "
            "objectives normalized by the baseline, reference 2x baseline latency / 0 throughput)"
        )
    return lines


def _front_table(study: optuna.Study, doc: list[dict[str, Any]]) -> list[str]:
    names = metric_names(study)
    arrows = ["↓" if d == optuna.study.StudyDirection.MINIMIZE else "↑" for d in study.directions]
    lines = ["", "## Baseline vs the Pareto front", ""]
    header = ["trial", *(f"{n} {a}" for n, a in zip(names, arrows, strict=True)), "SLOs"]
    lines += ["| " + " | ".join(header) + " | changed vs baseline |"]
    lines += ["|" + "---|" * (len(header) + 1)]
    for r in doc:
        cells = []
        for n in names:
            v, g = r["values"].get(n), r["gain_pct"].get(n)
            text = _fmt(v)
            if not r["baseline"] and g is not None:
                text += f" ({g:+.1f}%)"
            cells.append(text)
        label = f"{r['trial']} (baseline)" if r["baseline"] else str(r["trial"])
        changed = (
            "vLLM defaults"
            if r["baseline"]
            else ", ".join(f"`{k}={v}`" for k, v in sorted(r["changed"].items())) or "-"
        )
        slo = "met" if r["feasible"] else "missed"
        lines.append("| " + " | ".join([label, *cells, slo, changed]) + " |")
    if not any(not r["baseline"] for r in doc):
        lines += ["", "No feasible configuration beyond the baseline yet."]
    return lines


def _winners(doc: list[dict[str, Any]], base_args: dict[str, Any]) -> list[str]:
    winners = [r for r in doc if not r["baseline"]]
    if not winners:
        return []
    lines = ["", "## What the winners changed", ""]
    for r in winners:
        diffs = [
            f"`{k}`: {base_args.get(k, '(default)')} → {v}" for k, v in sorted(r["changed"].items())
        ]
        gains = ", ".join(f"{n} {g:+.1f}%" for n, g in r["gain_pct"].items() if g is not None)
        lines.append(
            f"- trial {r['trial']} ({gains or 'no baseline to compare'}): "
            + ("; ".join(diffs) or "same arguments as the baseline")
        )
    flags = Counter(k for r in winners for k in r["changed"])
    common = [k for k, c in flags.items() if c == len(winners)]
    if len(winners) > 1 and common:
        lines.append(f"- every front configuration changes: {', '.join(f'`{k}`' for k in common)}")
    return lines


def _importance_lines(importances: dict[str, Any]) -> list[str]:
    good = {k: v for k, v in importances.items() if isinstance(v, dict) and "error" not in v}
    if not good:
        return []
    lines = ["", "## Parameter importances (Optuna's default evaluator, feasible trials)", ""]
    for metric, imp in good.items():
        top = sorted(imp.items(), key=lambda kv: -kv[1])[:5]
        lines.append(f"- {metric}: " + ", ".join(f"`{p}` {v:.2f}" for p, v in top))
    return lines


_CLASS_TITLES = {
    "pareto": "Pareto front",
    "dominated": "Feasible, dominated",
    "slo_missed": "Measured, SLO missed",
    "failed": "Engine failed",
    "rejected": "Rejected before start",
    "invalid_replay": "Invalid replay (not scored)",
    "driver_died": "Lost with a dead driver",
}


def _diagnoses(
    over: list[FrozenTrial],
    base: FrozenTrial | None,
    front: set[int],
    stats: dict[str, Any] | None,
) -> list[str]:
    lines = ["", "## Diagnosis by trial class", ""]
    if base is not None:
        lines += ["### Baseline", ""]
        lines += [f"- trial {base.number}: " + " ".join(diagnose(base, stats)), ""]
    for cls, title in _CLASS_TITLES.items():
        members = [t for t in over if not TrialView(t).is_baseline and trial_class(t, front) == cls]
        if not members:
            continue
        lines += [f"### {title} ({len(members)})", ""]
        lines += [f"- trial {t.number}: " + " ".join(diagnose(t, stats)) for t in members]
        lines.append("")
    return lines


_TRACE_KEYS = (
    "requests",
    "duration_s",
    "mean_rate_rps",
    "peak_rate_rps",
    "burstiness_cv",
    "mean_input_tokens",
    "mean_output_tokens",
    "prefix_reuse_ratio",
)


def _trace_lines(notes: list[str], stats: dict[str, Any] | None) -> list[str]:
    if not (notes or stats):
        return []
    lines = ["## Trace", ""]
    lines += [f"- {n}" for n in notes]
    if stats:
        lines += [
            f"- {k}: {stats[k]:.3g}"
            if isinstance(stats.get(k), float)
            else f"- {k}: {stats.get(k)}"
            for k in _TRACE_KEYS
            if k in stats
        ]
    return lines
