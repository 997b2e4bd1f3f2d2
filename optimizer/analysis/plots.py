"""Plots of a study (matplotlib, imported on use): the front's 2-D projections and a trial's
latency CDFs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optuna

from optimizer.trial_view import TrialView, metric_names

__all__ = ["latency_cdf", "pareto_html", "plot_front"]


def plot_front(study: optuna.Study, front: set[int], folder: Path) -> list[Path]:
    """2-D projections of the measured trials; front highlighted, baseline marked."""
    from matplotlib.figure import Figure

    names = metric_names(study)
    trials = [t for t in study.get_trials(deepcopy=False) if TrialView(t).measured]
    if len(names) < 2 or not trials:
        return []
    files = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            fig = Figure(figsize=(6, 4.5))
            ax = fig.add_subplot()
            groups = (
                (
                    "infeasible (SLO missed)",
                    [t for t in trials if not TrialView(t).feasible],
                    "x",
                    "tab:red",
                ),
                (
                    "feasible, dominated",
                    [t for t in trials if TrialView(t).feasible and t.number not in front],
                    "o",
                    "tab:gray",
                ),
                ("Pareto front", [t for t in trials if t.number in front], "o", "tab:blue"),
            )
            for label, group, marker, color in groups:
                if group:
                    ax.scatter(
                        [t.values[i] for t in group],
                        [t.values[j] for t in group],
                        marker=marker,
                        color=color,
                        label=label,
                    )
            for t in trials:
                if t.number in front or TrialView(t).is_baseline:
                    ax.annotate(str(t.number), (t.values[i], t.values[j]), fontsize=8)
            base = next((t for t in trials if TrialView(t).is_baseline), None)
            if base is not None:
                ax.scatter(
                    [base.values[i]],
                    [base.values[j]],
                    marker="*",
                    s=220,
                    color="black",
                    label="baseline (vLLM defaults)",
                )

            def arrow(k: int) -> str:
                return "↓" if study.directions[k] == optuna.study.StudyDirection.MINIMIZE else "↑"

            ax.set_xlabel(f"{names[i]} {arrow(i)}")
            ax.set_ylabel(f"{names[j]} {arrow(j)}")
            ax.set_title(f"{study.study_name}: {names[i]} vs {names[j]}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = folder / f"pareto_{names[i]}__{names[j]}.png"
            fig.savefig(path, dpi=110)
            files.append(path)
    html = pareto_html(study, front, folder / "pareto_front.html")
    if html is not None:
        files.append(html)
    return files


def pareto_html(study: optuna.Study, front: set[int], path: Path) -> Path | None:
    """An interactive plot of the measured trials (plotly), small enough for MLflow's artifact
    viewer: plotly.js comes from its CDN instead of 4.7 MB inline, and only measured trials are
    drawn (a failed or rejected trial's placeholder worst values would stretch the axes to 1e9).
    Offline, the PNG projections beside it show the same points.

    Returns:
        The file, or None when plotly is missing or there is nothing to draw.
    """
    try:
        import plotly.graph_objects as go
    except ImportError:
        return None
    names = metric_names(study)
    trials = [t for t in study.get_trials(deepcopy=False) if TrialView(t).measured]
    if len(names) < 2 or not trials:
        return None
    groups = (
        ("infeasible (SLO missed)", [t for t in trials if not TrialView(t).feasible], "x"),
        (
            "feasible, dominated",
            [t for t in trials if TrialView(t).feasible and t.number not in front],
            "circle-open",
        ),
        ("Pareto front", [t for t in trials if t.number in front], "circle"),
        ("baseline (vLLM defaults)", [t for t in trials if TrialView(t).is_baseline], "star"),
    )
    arrows = ["↓" if d == optuna.study.StudyDirection.MINIMIZE else "↑" for d in study.directions]
    fig = go.Figure()
    for label, group, symbol in groups:
        if not group:
            continue
        text = [
            f"trial {t.number}<br>"
            + "<br>".join(f"{k}={v}" for k, v in sorted(TrialView(t).engine_args.items()))
            for t in group
        ]
        columns = [[float(t.values[i]) for t in group] for i in range(len(names))]
        marker = {"symbol": symbol, "size": 14 if symbol == "star" else 9}
        if len(names) == 2:
            fig.add_trace(
                go.Scatter(
                    x=columns[0],
                    y=columns[1],
                    mode="markers",
                    name=label,
                    text=text,
                    marker=marker,
                    hovertemplate="%{text}<extra></extra>",
                )
            )
        else:
            fig.add_trace(
                go.Splom(
                    dimensions=[
                        {"label": f"{n} {a}", "values": c}
                        for n, a, c in zip(names, arrows, columns, strict=True)
                    ],
                    name=label,
                    text=text,
                    marker=marker,
                    diagonal_visible=False,
                    showupperhalf=False,
                )
            )
    if len(names) == 2:
        fig.update_layout(
            xaxis_title=f"{names[0]} {arrows[0]}", yaxis_title=f"{names[1]} {arrows[1]}"
        )
    fig.update_layout(
        title=f"{study.study_name}: measured trials ({len(trials)}), arrows: better direction",
        template="plotly_white",
    )
    fig.write_html(str(path), include_plotlyjs="cdn", full_html=True)
    return path


def latency_cdf(records_path: Path, out: Path) -> bool:
    """TTFT / TPOT / E2EL CDFs of a trial's measured, successful requests."""
    from matplotlib.figure import Figure

    from optimizer.trial import read_records

    records = [r for r in read_records(records_path) if not r.warmup and r.ok and r.first_token_s]
    if not records:
        return False
    ttft = [(r.first_token_s or 0.0) - r.sent_s for r in records]
    e2el = [(r.chunk_times_s[-1] if r.chunk_times_s else r.end_s) - r.sent_s for r in records]
    tpot = [
        (e - f) / (r.output_tokens - 1)
        for r, e, f in zip(records, e2el, ttft, strict=True)
        if r.output_tokens > 1
    ]
    fig = Figure(figsize=(11, 3.5))
    for k, (label, values) in enumerate((("TTFT", ttft), ("TPOT", tpot), ("E2EL", e2el))):
        ax = fig.add_subplot(1, 3, k + 1)
        if values:
            ms = np.sort(np.array(values) * 1000.0)
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
            p95 = float(np.percentile(ms, 95))
            ax.axvline(p95, color="tab:red", ls="--", lw=1, label=f"p95 {p95:,.1f} ms")
            ax.legend(fontsize=7)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(f"latency CDF ({len(records)} measured requests)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return True
