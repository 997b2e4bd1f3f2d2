"""Plots of a stability run, made from what the run stored, so a copied study folder can make
them again: ``stability.json`` and each run's ``samples.jsonl`` and ``records.jsonl.gz`` under
its ``runs_dir`` (matplotlib, imported on use, drawn without a display).

Two PNGs in the run's folder, the chosen configuration and the baseline side by side (one
column each, the same y scale per row), the plan's phases shaded and named, the SLOs drawn:

- ``stability_latency.png``: rolling P95 and P99 TTFT and TPOT (a window of the plan's
  ``window_s`` every second, by arrival time), the windows that missed an SLO marked, and the
  requests arriving and failing per second;
- ``stability_server.png``: KV-cache usage, requests running and waiting, preemptions since
  the start, the process group's RSS and (with a GPU) GPU memory, each memory series with its
  least-squares line over the sustained phase (the memory verdict's slope).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.stability.verdicts import Sample, slope_ci
from optimizer.types import RequestRecord

__all__ = [
    "LATENCY_PNG",
    "SERVER_PNG",
    "RunSeries",
    "plot_stability",
    "read_samples",
    "read_series",
    "rolling_latency",
    "runs_folder",
]

LATENCY_PNG = "stability_latency.png"
SERVER_PNG = "stability_server.png"
_PHASE_COLORS = {"burst": "tab:orange", "recovery": "tab:green", "long_input": "tab:purple"}
_SLO_KEY = re.compile(r"^(?:p(?P<pct>\d+(?:\.\d+)?)|mean|median)_(?P<metric>ttft|tpot)_ms$")


@dataclass
class RunSeries:
    """One run's stored series.

    Attributes:
        label: ``chosen`` or ``baseline``.
        title: The column's title (label, trial, status).
        samples: The server's state over time ([] when ``samples.jsonl`` is missing).
        records: Every request (None when ``records.jsonl.gz`` is missing: the latency rows
            then show the stored windows instead of rolling ones).
        windows: The run's windows from ``stability.json``.
    """

    label: str
    title: str
    samples: list[Sample] = field(default_factory=list)
    records: list[RequestRecord] | None = None
    windows: list[dict[str, Any]] = field(default_factory=list)


def runs_folder(folder: Path, doc: Mapping[str, Any]) -> Path:
    """The run's folder: ``runs_dir`` of ``stability.json``, relative to the study folder."""
    runs = Path(str(doc.get("runs_dir") or "stability"))
    return runs if runs.is_absolute() else Path(folder) / runs


def read_samples(path: Path) -> list[Sample]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Sample(**{k: d.get(k) for k in Sample.__dataclass_fields__}))
    return out


def read_series(folder: Path, doc: Mapping[str, Any]) -> list[RunSeries]:
    """Every run of a ``stability.json`` document with its stored series (chosen first)."""
    from optimizer.trial_io import read_records

    trials = {"chosen": doc.get("trial"), "baseline": doc.get("baseline_trial")}
    runs: Mapping[str, Any] = doc.get("runs") or {}
    out = []
    for label in sorted(runs, key=lambda k: (k != "chosen", k)):
        run = runs[label] or {}
        where = runs_folder(folder, doc) / label
        number = trials.get(label)
        title = label + (f" (trial {number})" if number is not None else "")
        title += f": {run.get('status', '?')}"
        records_file = where / "records.jsonl.gz"
        out.append(
            RunSeries(
                label=label,
                title=title,
                samples=read_samples(where / "samples.jsonl"),
                records=read_records(records_file) if records_file.is_file() else None,
                windows=list(run.get("windows") or []),
            )
        )
    return out


def _per_request(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    """Arrival, TTFT and TPOT (ms, NaN where not defined) and success of every request, with
    ``vllm bench serve``'s definitions (as :func:`objectives.summarize`)."""
    n = len(records)
    t, ttft, tpot, ok = np.zeros(n), np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, bool)
    for i, r in enumerate(records):
        t[i] = r.scheduled_s
        if not (r.ok and r.first_token_s is not None):
            continue
        ok[i] = True
        ttft[i] = (r.first_token_s - r.sent_s) * 1000
        last = r.chunk_times_s[-1] if r.chunk_times_s else r.end_s
        if r.output_tokens > 1:
            tpot[i] = ((last - r.sent_s) * 1000 - ttft[i]) / (r.output_tokens - 1)
    return {"t": t, "ttft": ttft, "tpot": tpot, "ok": ok}


def rolling_latency(
    records: Sequence[RequestRecord], *, width_s: float, step_s: float, start_s: float, end_s: float
) -> dict[str, np.ndarray]:
    """P95/P99 TTFT and TPOT (ms) of the requests arriving in the ``width_s`` before each time
    ``t`` from ``start_s + step_s`` to ``end_s`` in steps of ``step_s``, and their count and
    failures; NaN where no request of the window has the metric.

    Returns:
        ``t`` and ``p95_ttft_ms``, ``p99_ttft_ms``, ``p95_tpot_ms``, ``p99_tpot_ms``,
        ``requests``, ``failed``: one value per time.
    """
    per = _per_request(records)
    times = np.arange(start_s + step_s, end_s + step_s / 2, step_s)
    out = {k: np.full(len(times), np.nan) for k in ("p95_ttft_ms", "p99_ttft_ms")}
    out |= {k: np.full(len(times), np.nan) for k in ("p95_tpot_ms", "p99_tpot_ms")}
    out["requests"] = np.zeros(len(times))
    out["failed"] = np.zeros(len(times))
    for i, t in enumerate(times):
        inside = (per["t"] >= t - width_s) & (per["t"] < t)
        out["requests"][i] = int(inside.sum())
        out["failed"][i] = int((inside & ~per["ok"]).sum())
        for metric in ("ttft", "tpot"):
            values = per[metric][inside]
            values = values[np.isfinite(values)]
            if len(values):
                out[f"p95_{metric}_ms"][i] = float(np.percentile(values, 95))
                out[f"p99_{metric}_ms"][i] = float(np.percentile(values, 99))
    out["t"] = times
    return out


def _phases(ax: Any, phases: Sequence[Mapping[str, Any]], *, names: bool) -> None:
    """The phases on one axis: boundaries as lines, the non-sustained ones shaded, names on
    top (first row only)."""
    for p in phases:
        start, end, name = float(p["start_s"]), float(p["end_s"]), str(p["name"])
        color = _PHASE_COLORS.get(name)
        if color is not None:
            ax.axvspan(start, end, color=color, alpha=0.08, lw=0)
        ax.axvline(start, color="0.4", lw=0.8, ls=":")
        if names:
            ax.text(
                (start + end) / 2,
                1.01,
                name.replace("_", " "),
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=7,
                color=color or "0.3",
            )
    if phases:
        ax.axvline(float(phases[-1]["end_s"]), color="0.4", lw=0.8, ls=":")


def _slo_lines(ax: Any, slos: Sequence[str], metric: str) -> None:
    """Every SLO on a percentile (or mean/median) of ``metric`` as a dashed red line."""
    from objectives import parse_slo

    for text in slos:
        try:
            slo = parse_slo(text)
        except ValueError:
            continue
        m = _SLO_KEY.match(slo.metric)
        if m is not None and m["metric"] == metric:
            ax.axhline(slo.threshold, color="tab:red", ls="--", lw=1, label=f"SLO {slo}")


def _missed_windows(ax: Any, windows: Sequence[Mapping[str, Any]]) -> None:
    """The windows that missed an SLO as red marks along the axis' bottom."""
    first = True
    for w in windows:
        if w.get("slo_met") is False:
            ax.axvspan(
                float(w["start_s"]),
                float(w["end_s"]),
                ymin=0,
                ymax=0.04,
                color="tab:red",
                alpha=0.8,
                lw=0,
                label="window over an SLO" if first else None,
            )
            first = False


def _timeline(
    series: Sequence[RunSeries], phases: Sequence[Mapping[str, Any]]
) -> tuple[float, float]:
    """The x range every column shares: the samples' span and the plan's."""
    lo = min([0.0, *(s.samples[0].t_s for s in series if s.samples)])
    hi = max(
        [
            float(phases[-1]["end_s"]) if phases else 0.0,
            *(s.samples[-1].t_s for s in series if s.samples),
        ]
    )
    return lo, hi


def _latency_column(
    axes: Sequence[Any], run: RunSeries, window_s: float, span: tuple[float, float]
) -> None:
    """One run's latency rows: TTFT, TPOT (P95 solid, P99 thin), requests and failures."""
    if run.records is not None:
        roll = rolling_latency(
            run.records, width_s=window_s, step_s=1.0, start_s=span[0], end_s=span[1]
        )
        t = roll["t"]
        for row, metric in enumerate(("ttft", "tpot")):
            axes[row].plot(t, roll[f"p95_{metric}_ms"], color="tab:blue", lw=1.2, label="P95")
            axes[row].plot(
                t, roll[f"p99_{metric}_ms"], color="tab:blue", lw=0.6, alpha=0.6, label="P99"
            )
        axes[2].plot(t, roll["requests"] / window_s, color="tab:gray", lw=1, label="arriving")
        axes[2].plot(t, roll["failed"] / window_s, color="tab:red", lw=1, label="failing")
        return
    w = run.windows  # no records kept: the stored windows, one step each
    mids = [(float(x["start_s"]) + float(x["end_s"])) / 2 for x in w]
    for row, metric in enumerate(("ttft", "tpot")):
        for pct, lw in (("p95", 1.2), ("p99", 0.6)):
            values = [x.get(f"{pct}_{metric}_ms") for x in w]
            axes[row].step(
                mids,
                [math.nan if v is None else v for v in values],
                where="mid",
                lw=lw,
                color="tab:blue",
                label=pct.upper() + " (stored windows)",
            )
    widths = [max(float(x["end_s"]) - float(x["start_s"]), 1e-9) for x in w]
    axes[2].step(
        mids,
        [x.get("requests", 0) / d for x, d in zip(w, widths, strict=True)],
        where="mid",
        color="tab:gray",
        label="arriving",
    )
    axes[2].step(
        mids,
        [x.get("failed", 0) / d for x, d in zip(w, widths, strict=True)],
        where="mid",
        color="tab:red",
        label="failing",
    )


def _log_if_wide(axes: Sequence[Any]) -> None:
    """A row's y axis on a log scale when its values span more than 30x (a burst's TTFT)."""
    values = [
        y
        for ax in axes
        for line in ax.get_lines()
        for y in np.asarray(line.get_ydata(), dtype=float)
        if math.isfinite(y) and y > 0
    ]
    if values and max(values) / min(values) > 30:
        axes[0].set_yscale("log")


def _figure(rows: int, cols: int, title: str) -> tuple[Any, np.ndarray]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5 * cols, 2.3 * rows + 0.8))
    axes = np.asarray(fig.subplots(rows, cols, sharex=True, sharey="row", squeeze=False))
    fig.suptitle(title, fontsize=11)
    return fig, axes


def _finish(
    fig: Any,
    axes: np.ndarray,
    series: Sequence[RunSeries],
    labels: Sequence[str],
    path: Path,
    span: tuple[float, float],
    phases: Sequence[Mapping[str, Any]],
) -> Path:
    """Phases, titles, labels, legends and grid on every axis; the file written."""
    for col, run in enumerate(series):
        for row in range(axes.shape[0]):
            ax = axes[row, col]
            _phases(ax, phases, names=row == 0)
            ax.grid(alpha=0.3)
            ax.set_xlim(*span)
            if col == 0:
                ax.set_ylabel(labels[row], fontsize=8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6, loc="upper left")
        axes[0, col].set_title(run.title, fontsize=9, pad=14)
        axes[-1, col].set_xlabel("seconds since the plan's start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _latency_png(doc: Mapping[str, Any], series: Sequence[RunSeries], out: Path) -> Path:
    plan = doc.get("plan") or {}
    phases = plan.get("phases") or []
    window_s = float((plan.get("settings") or {}).get("window_s") or 10.0)
    span = _timeline(series, phases)
    slos = [str(s) for s in doc.get("slos") or []]
    fig, axes = _figure(
        3,
        len(series),
        f"stability of trial {doc.get('trial')}: latency over a rolling {window_s:g} s window",
    )
    for col, run in enumerate(series):
        column = axes[:, col]
        _latency_column(list(column), run, window_s, span)
        for row, metric in enumerate(("ttft", "tpot")):
            _slo_lines(column[row], slos, metric)
            _missed_windows(column[row], run.windows)
    for row in range(2):
        _log_if_wide(list(axes[row, :]))
    labels = ("TTFT (ms)", "TPOT (ms)", "requests/s")
    return _finish(fig, axes, series, labels, out / LATENCY_PNG, span, phases)


def _values(samples: Sequence[Sample], attr: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(s.t_s, getattr(s, attr)) for s in samples if getattr(s, attr) is not None]
    return np.array([t for t, _ in pts], dtype=float), np.array([v for _, v in pts], dtype=float)


def _memory_fit(ax: Any, t: np.ndarray, y: np.ndarray, plan: Mapping[str, Any]) -> None:
    """The least-squares line over the sustained phase (its first window left out, as the
    memory verdict does), labelled with its slope and interval."""
    phase = next((p for p in plan.get("phases") or [] if p.get("name") == "sustained"), None)
    if phase is None or not len(t):
        return
    window_s = float((plan.get("settings") or {}).get("window_s") or 10.0)
    inside = (t >= float(phase["start_s"]) + window_s) & (t < float(phase["end_s"]))
    slope = slope_ci(t[inside].tolist(), y[inside].tolist())
    if slope is None:
        return
    ts = t[inside]
    fit = slope.mean + slope.per_min / 60 * (ts - ts.mean())
    ax.plot(ts, fit, color="black", lw=1, ls="--", label=f"sustained fit {slope.text()}")


def _server_column(axes: Sequence[Any], run: RunSeries, plan: Mapping[str, Any], gpu: bool) -> None:
    """One run's server rows: KV usage, running/waiting, preemptions, RSS (and GPU memory)."""
    s = run.samples
    t, kv = _values(s, "kv_usage")
    axes[0].plot(t, kv * 100, color="tab:blue", lw=1)
    for attr, color in (("running", "tab:green"), ("waiting", "tab:orange")):
        axes[1].plot(*_values(s, attr), color=color, lw=1, label=attr)
    t, pre = _values(s, "preemptions")
    if len(pre):
        axes[2].plot(t, pre - pre[0], color="tab:red", lw=1)
    memory = [("rss_mib", 3)] + ([("gpu_mib", 4)] if gpu else [])
    for attr, row in memory:
        t, y = _values(s, attr)
        axes[row].plot(t, y, color="tab:blue", lw=1, label=attr.split("_")[0].upper())
        _memory_fit(axes[row], t, y, plan)


def _server_png(doc: Mapping[str, Any], series: Sequence[RunSeries], out: Path) -> Path:
    plan = doc.get("plan") or {}
    phases = plan.get("phases") or []
    gpu = any(x.gpu_mib is not None for run in series for x in run.samples)
    labels = ["KV-cache usage (%)", "requests", "preemptions", "RSS (MiB)"]
    labels += ["GPU memory (MiB)"] if gpu else []
    fig, axes = _figure(
        len(labels), len(series), f"stability of trial {doc.get('trial')}: the server over time"
    )
    for col, run in enumerate(series):
        _server_column(list(axes[:, col]), run, plan, gpu)
    return _finish(fig, axes, series, labels, out / SERVER_PNG, _timeline(series, phases), phases)


def _plan_slos(folder: Path) -> list[str]:
    """The study's SLOs from its ``plan.json`` ([] without one)."""
    try:
        slos = json.loads((Path(folder) / "plan.json").read_text()).get("slos")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(s) for s in slos] if isinstance(slos, list) else []


def plot_stability(folder: Path, doc: Mapping[str, Any] | None = None) -> list[Path]:
    """The stability run's PNGs, written into its folder (``runs_dir``); from the study
    folder's ``stability.json`` when ``doc`` is None.

    Returns:
        The files written ([] when there is no check, or no run has anything to draw).
    """
    if doc is None:
        from optimizer.stability.stored import read_stability

        doc = read_stability(folder)
        if doc is None:
            return []
    series = [r for r in read_series(folder, doc) if r.samples or r.records or r.windows]
    if not series:
        return []
    if not doc.get("slos"):  # a check written before stability.json kept its SLOs
        doc = {**doc, "slos": _plan_slos(folder)}
    out = runs_folder(folder, doc)
    out.mkdir(parents=True, exist_ok=True)
    return [_latency_png(doc, series, out), _server_png(doc, series, out)]
