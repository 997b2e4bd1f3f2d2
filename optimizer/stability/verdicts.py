"""Verdicts with numbers from one stability run (pure: records, samples and the plan in).

- **memory**: the least-squares slope of the server's RSS (and GPU memory where there is one)
  over the sustained phase (its first window left out: the server settles), in MiB/min with a
  95 % confidence interval (Student's t); *growing* when the interval lies above 0 and the
  slope would add more than ``growth_per_hour`` of the mean level in an hour, else *level*;
- **errors** and **preemptions** per phase (failed requests; the preemption counter's increase);
  a failure in the sustained, recovery or long-input phase fails, in the burst it warns;
- **drift**: P95 TTFT and TPOT of the sustained phase's first and last drift windows (its first
  and last whole loop of the trace when the plan knows the loop); a rise
  by more than ``drift_tolerance`` fails when the last window uses more than half of an SLO
  on that metric (far inside the SLO, or without an SLO on it, it warns);
- **spikes**: windows of ``window_s`` whose requests miss an SLO, per phase; one in the
  sustained or long-input phase fails;
- **recovery**: seconds from the burst's end until the requests arriving over the next
  ``window_s`` meet the SLOs again (the server serves new arrivals within its SLOs from then
  on); never within the recovery phase fails;
- **long inputs**: sent, served, failed (refused), their P95 TTFT; any failure fails, and so
  does a P95 TTFT of the long inputs over a ``p95_ttft_ms`` SLO (served too slowly: a KV cache
  that holds one of them at a time queues the others).

:func:`compare` flags every verdict on which the chosen configuration did worse than the
baseline under the same plan.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from objectives import Slo, summarize
from optimizer.stability.plan import StabilityPlan
from optimizer.types import RequestRecord

__all__ = [
    "Sample",
    "Slope",
    "Thresholds",
    "Verdict",
    "Window",
    "compare",
    "counter_increase",
    "drift_windows",
    "evaluate",
    "overall",
    "phase_stats",
    "recovery_s",
    "slope_ci",
    "t_critical",
    "windows",
]

_RANK = {"n/a": 0, "pass": 1, "warn": 2, "fail": 3}
_PERCENTILES = (50.0, 95.0, 99.0)
#: Two-sided 95 % Student t quantiles for 1..30 degrees of freedom.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


@dataclass(frozen=True)
class Sample:
    """The server's state at one time of the plan's timeline (None: not measured).

    Attributes:
        t_s: Seconds since the plan's start.
        rss_mib: Resident memory of the server's whole process group.
        gpu_mib: GPU memory the server's processes use (None without a GPU).
        kv_usage: KV-cache usage, 0..1.
        running: Requests running.
        waiting: Requests waiting.
        preemptions: The preemption counter (since the server started).
    """

    t_s: float
    rss_mib: float | None = None
    gpu_mib: float | None = None
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None


def t_critical(df: int) -> float:
    """Two-sided 95 % quantile of Student's t (``1.96 + 2.4/df`` past 30: within 0.01)."""
    if df < 1:
        return math.inf
    return _T95[df - 1] if df <= len(_T95) else 1.96 + 2.4 / df


@dataclass(frozen=True)
class Slope:
    """A least-squares slope with its 95 % confidence interval, per minute."""

    per_min: float
    lo: float
    hi: float
    n: int
    mean: float

    def growing(self, growth_per_hour: float) -> bool:
        """The interval lies above 0 and an hour would add more than this share of the mean."""
        return self.lo > 0 and self.per_min * 60 > growth_per_hour * abs(self.mean)

    def text(self, unit: str = "MiB") -> str:
        return f"{self.per_min:+.3g} {unit}/min [{self.lo:+.3g}, {self.hi:+.3g}] (n={self.n})"


def slope_ci(t_s: Sequence[float], values: Sequence[float]) -> Slope | None:
    """Least-squares slope of ``values`` over ``t_s`` (seconds), per minute, with its 95 %
    interval; None with fewer than 3 points or no spread in time."""
    t = np.asarray(t_s, dtype=float)
    y = np.asarray(values, dtype=float)
    n = len(t)
    if n < 3:
        return None
    tc = t - t.mean()
    sxx = float(np.sum(tc * tc))
    if sxx <= 0:
        return None
    b = float(np.sum(tc * (y - y.mean())) / sxx)
    resid = y - (y.mean() + b * tc)
    se = math.sqrt(float(np.sum(resid * resid)) / (n - 2) / sxx)
    half = t_critical(n - 2) * se
    return Slope(per_min=b * 60, lo=(b - half) * 60, hi=(b + half) * 60, n=n, mean=float(y.mean()))


@dataclass(frozen=True)
class Window:
    """Latency of the requests that arrived in ``[start_s, end_s)`` of one phase.

    ``slo_met`` is None when no request arrived; ``missed`` names the SLOs missed.
    """

    phase: str
    start_s: float
    end_s: float
    requests: int
    failed: int
    p95_ttft_ms: float
    p99_ttft_ms: float
    p95_tpot_ms: float
    p99_tpot_ms: float
    slo_met: bool | None
    missed: tuple[str, ...] = ()


def _percentiles(slos: Sequence[Slo]) -> tuple[float, ...]:
    """P50/P95/P99 and every percentile an SLO names (``p90_ttft_ms`` needs P90)."""
    named = {float(m[1]) for s in slos if (m := re.match(r"p(\d+(?:\.\d+)?)_", s.metric))}
    return tuple(sorted(set(_PERCENTILES) | named))


def _meets(slos: Sequence[Slo], summary: Mapping[str, float]) -> tuple[str, ...]:
    """The SLOs a window's summary misses (one on a key it cannot have is not judged)."""
    missed = []
    for slo in slos:
        try:
            if not slo.met(summary):
                missed.append(str(slo))
        except KeyError:
            continue
    return tuple(missed)


def _window(
    phase: str, start: float, end: float, records: Sequence[RequestRecord], slos: Sequence[Slo]
) -> Window:
    summary = summarize(records, slos=slos, percentiles=_percentiles(slos)) if records else {}
    missed = _meets(slos, summary) if records else ()
    nan = math.nan
    return Window(
        phase=phase,
        start_s=start,
        end_s=end,
        requests=len(records),
        failed=int(summary.get("failed", 0)),
        p95_ttft_ms=float(summary.get("p95_ttft_ms", nan)),
        p99_ttft_ms=float(summary.get("p99_ttft_ms", nan)),
        p95_tpot_ms=float(summary.get("p95_tpot_ms", nan)),
        p99_tpot_ms=float(summary.get("p99_tpot_ms", nan)),
        slo_met=(not missed) if records else None,
        missed=missed,
    )


def _in(records: Sequence[RequestRecord], start: float, end: float) -> list[RequestRecord]:
    return [r for r in records if start <= r.scheduled_s < end]


def _spans(start: float, end: float, width: float) -> list[tuple[float, float]]:
    """``[start, end)`` cut into windows of ``width``; a last piece under half a width joins
    the one before it."""
    out: list[tuple[float, float]] = []
    t = start
    while t < end - 1e-9:
        out.append((t, min(t + width, end)))
        t += width
    if len(out) > 1 and out[-1][1] - out[-1][0] < width / 2:
        out[-2:] = [(out[-2][0], out[-1][1])]
    return out


def windows(
    records: Sequence[RequestRecord], plan: StabilityPlan, slos: Sequence[Slo]
) -> list[Window]:
    """Every phase cut into windows of ``plan.settings.window_s``, each judged on the SLOs."""
    out = []
    for phase in plan.phases:
        for start, end in _spans(phase.start_s, phase.end_s, plan.settings.window_s):
            out.append(_window(phase.name, start, end, _in(records, start, end), slos))
    return out


def drift_windows(
    records: Sequence[RequestRecord], plan: StabilityPlan, slos: Sequence[Slo]
) -> tuple[Window, Window] | None:
    """The sustained phase's first and last drift windows; None when the phase is too short.

    When the plan knows the trace's loop (``plan.loop_s()``): the first and the last whole loop
    of the trace in the phase, so like is compared with like (a bursty trace's quiet start is not
    its busy middle); None when fewer than two whole loops fit. Otherwise a sixth of the phase at
    each end, at least ``window_s``."""
    phase = plan.phase("sustained")
    if phase is None:
        return None
    loop = plan.loop_s()
    if loop is not None:
        loops = math.floor(phase.duration_s / loop + 1e-9)
        if loops < 2:
            return None
        a = (phase.start_s, phase.start_s + loop)
        b = (phase.start_s + (loops - 1) * loop, phase.start_s + loops * loop)
    else:
        width = max(plan.settings.window_s, phase.duration_s / 6)
        if phase.duration_s < 2 * width:
            return None
        a = (phase.start_s, phase.start_s + width)
        b = (phase.end_s - width, phase.end_s)
    return (
        _window("sustained", *a, _in(records, *a), slos),
        _window("sustained", *b, _in(records, *b), slos),
    )


def recovery_s(
    records: Sequence[RequestRecord],
    plan: StabilityPlan,
    slos: Sequence[Slo],
    *,
    step_s: float = 1.0,
    min_requests: int = 3,
) -> float | None:
    """Seconds after the burst's end from which the requests arriving over the next
    ``window_s`` (inside the recovery phase; at least ``min_requests`` of them) meet the SLOs
    again, in steps of ``step_s``; None when that never happens in the recovery phase (or
    there is no burst)."""
    burst, recovery = plan.phase("burst"), plan.phase("recovery")
    if burst is None or recovery is None:
        return None
    after = _in(records, burst.end_s, recovery.end_s)
    k = 0
    while burst.end_s + k * step_s < recovery.end_s - 1e-9:
        t = burst.end_s + k * step_s
        ahead = _in(after, t, min(t + plan.settings.window_s, recovery.end_s))
        if len(ahead) >= min_requests:
            summary = summarize(ahead, slos=slos, percentiles=_percentiles(slos))
            if not _meets(slos, summary):
                return t - burst.end_s
        k += 1
    return None


def counter_increase(samples: Sequence[Sample], start_s: float, end_s: float) -> float | None:
    """How much the preemption counter rose over ``[start_s, end_s]``: the last sample at or
    before each end (the first sample when none is before the start); None without samples."""
    pts = [(s.t_s, s.preemptions) for s in samples if s.preemptions is not None]
    if not pts:
        return None

    def at(t: float) -> float:
        before = [v for ts, v in pts if ts <= t]
        return float(before[-1] if before else pts[0][1])

    return max(0.0, at(end_s) - at(start_s))


def phase_stats(samples: Sequence[Sample], plan: StabilityPlan) -> dict[str, dict[str, Any]]:
    """Per phase, from the samples inside it: peak KV-cache usage, running and waiting, and
    the mean RSS (None where nothing was sampled)."""
    out: dict[str, dict[str, Any]] = {}
    for p in plan.phases:
        inside = [s for s in samples if p.start_s <= s.t_s < p.end_s]

        def peak(attr: str, inside: list[Sample] = inside) -> float | None:
            vals = [getattr(s, attr) for s in inside if getattr(s, attr) is not None]
            return max(vals) if vals else None

        rss = [s.rss_mib for s in inside if s.rss_mib is not None]
        out[p.name] = {
            "kv_usage_peak": peak("kv_usage"),
            "running_peak": peak("running"),
            "waiting_peak": peak("waiting"),
            "rss_mib_mean": sum(rss) / len(rss) if rss else None,
        }
    return out


@dataclass(frozen=True)
class Verdict:
    """One verdict: its name, ``pass``/``warn``/``fail``/``n/a``, the numbers in words, and
    the numbers themselves."""

    name: str
    status: str
    text: str
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Thresholds:
    """Where a verdict turns: memory growth per hour (share of the mean level), latency drift
    (relative rise of a P95)."""

    growth_per_hour: float = 0.05
    drift_tolerance: float = 0.5


def evaluate(
    records: Sequence[RequestRecord],
    long_input: Sequence[bool],
    samples: Sequence[Sample],
    plan: StabilityPlan,
    slos: Sequence[Slo],
    thresholds: Thresholds | None = None,
) -> list[Verdict]:
    """Every verdict of one run (records in the load's order, ``long_input`` alike)."""
    th = thresholds or Thresholds()
    return [
        *_memory_verdicts(samples, plan, th),
        _errors_verdict(records, long_input, plan),
        _preemptions_verdict(samples, plan),
        _drift_verdict(records, plan, slos, th),
        _spikes_verdict(windows(records, plan, slos)),
        _recovery_verdict(records, plan, slos),
        _long_input_verdict(records, long_input, plan, slos),
    ]


def _memory_verdicts(
    samples: Sequence[Sample], plan: StabilityPlan, th: Thresholds
) -> list[Verdict]:
    phase = plan.phase("sustained")
    out = []
    for name, attr in (("memory_rss", "rss_mib"), ("memory_gpu", "gpu_mib")):
        pts = [
            (s.t_s, getattr(s, attr))
            for s in samples
            if phase is not None
            and phase.start_s + plan.settings.window_s <= s.t_s < phase.end_s
            and getattr(s, attr) is not None
        ]
        slope = slope_ci([t for t, _ in pts], [v for _, v in pts])
        if slope is None:
            if name == "memory_rss":
                out.append(Verdict(name, "n/a", "too few samples in the sustained phase"))
            continue  # no GPU: no GPU verdict
        grows = slope.growing(th.growth_per_hour)
        hourly = slope.per_min * 60 / abs(slope.mean) if slope.mean else math.nan
        out.append(
            Verdict(
                name,
                "fail" if grows else "pass",
                f"{'growing' if grows else 'level'}: {slope.text()}, mean {slope.mean:,.0f} MiB, "
                f"{hourly:+.1%}/h",
                {**asdict(slope), "per_hour_share": hourly},
            )
        )
    return out


def _by_phase(
    records: Sequence[RequestRecord], plan: StabilityPlan
) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = {p.name: [] for p in plan.phases}
    for r in records:
        out.setdefault(plan.phase_at(r.scheduled_s), []).append(r)
    return out


def _errors_verdict(
    records: Sequence[RequestRecord], long_input: Sequence[bool], plan: StabilityPlan
) -> Verdict:
    del long_input  # long inputs count in their phase like every request
    counts = {name: sum(1 for r in rs if not r.ok) for name, rs in _by_phase(records, plan).items()}
    status = _phase_status(counts)
    text = ", ".join(f"{k} {v}" for k, v in counts.items())
    return Verdict("errors", status, text, {"per_phase": counts})


def _phase_status(counts: Mapping[str, float | None]) -> str:
    """``fail`` for a count in a phase that must be clean, ``warn`` for one in the burst."""
    if any(v for k, v in counts.items() if k != "burst"):
        return "fail"
    return "warn" if counts.get("burst") else "pass"


def _preemptions_verdict(samples: Sequence[Sample], plan: StabilityPlan) -> Verdict:
    counts = {
        p.name: counter_increase(
            samples, p.start_s, p.end_s if p is not plan.phases[-1] else math.inf
        )
        for p in plan.phases
    }
    if all(v is None for v in counts.values()):
        return Verdict("preemptions", "n/a", "the server reported no preemption counter")
    text = ", ".join(f"{k} {v:g}" for k, v in counts.items() if v is not None)
    return Verdict("preemptions", _phase_status(counts), text, {"per_phase": counts})


def _drift_verdict(
    records: Sequence[RequestRecord], plan: StabilityPlan, slos: Sequence[Slo], th: Thresholds
) -> Verdict:
    pair = drift_windows(records, plan, slos)
    if pair is None:
        loop = plan.loop_s()
        why = f"two whole loops of the trace ({loop:,.0f} s each)" if loop else "two windows"
        return Verdict("drift", "n/a", f"sustained phase too short for {why}")
    first, last = pair
    status = "pass"
    parts: list[str] = []
    numbers: dict[str, Any] = {}
    if not (first.requests and last.requests):
        return Verdict(
            "drift",
            "n/a",
            f"no request arrived in the sustained phase's first or last "
            f"{first.end_s - first.start_s:g} s ({first.requests} and {last.requests})",
        )
    for metric in ("p95_ttft_ms", "p95_tpot_ms"):
        a, b = float(getattr(first, metric)), float(getattr(last, metric))
        ratio = b / a if a > 0 and math.isfinite(a) and math.isfinite(b) else math.nan
        numbers[metric] = {"first": a, "last": b, "ratio": ratio}
        parts.append(f"{metric} {a:,.0f} -> {b:,.0f} ms (x{ratio:.2f})")
        if not (ratio > 1 + th.drift_tolerance):
            continue
        bound = next((s.threshold for s in slos if s.metric == metric), None)
        worst = "fail" if bound is not None and b > bound / 2 else "warn"
        status = max(status, worst, key=_RANK.__getitem__)
    return Verdict("drift", status, "; ".join(parts), numbers)


def _spikes_verdict(wins: Sequence[Window]) -> Verdict:
    counts: dict[str, int] = {}
    totals: dict[str, int] = {}
    for w in wins:
        totals[w.phase] = totals.get(w.phase, 0) + (w.slo_met is not None)
        counts[w.phase] = counts.get(w.phase, 0) + (w.slo_met is False)
    status = "fail" if counts.get("sustained") or counts.get("long_input") else "pass"
    if status == "pass" and (counts.get("burst") or counts.get("recovery")):
        status = "warn"
    text = ", ".join(f"{k} {counts[k]}/{totals[k]}" for k in counts)
    numbers: dict[str, Any] = {"per_phase": counts}
    worst = _worst_excess([w for w in wins if w.phase not in ("burst", "recovery")])
    if worst is not None:
        numbers["worst"] = worst
        text += (
            f"; worst outside the burst: {worst['slo']} at {worst['value']:,.4g} "
            f"({worst['excess']:+.0%}), {worst['phase']} window at {worst['start_s']:g} s"
        )
    return Verdict("spikes", status, f"windows over an SLO: {text}", numbers)


def _worst_excess(wins: Sequence[Window]) -> dict[str, Any] | None:
    """The window that missed an upper-bound SLO on a latency it holds by the widest margin:
    SLO, value, excess over the bound (0.05: 5% over), phase and start (None: no such miss)."""
    worst: dict[str, Any] | None = None
    for w in wins:
        for text in w.missed:
            m = re.fullmatch(r"(\w+)\s*<=?\s*([0-9.eE+-]+)", text)
            value = getattr(w, m.group(1), None) if m else None
            if m is None or not isinstance(value, float) or float(m.group(2)) <= 0:
                continue
            excess = value / float(m.group(2)) - 1.0
            if worst is None or excess > worst["excess"]:
                worst = {
                    "slo": text,
                    "value": value,
                    "excess": excess,
                    "phase": w.phase,
                    "start_s": w.start_s,
                }
    return worst


def _recovery_verdict(
    records: Sequence[RequestRecord], plan: StabilityPlan, slos: Sequence[Slo]
) -> Verdict:
    recovery = plan.phase("recovery")
    if plan.phase("burst") is None or recovery is None:
        return Verdict("recovery", "n/a", "no burst in the plan")
    took = recovery_s(records, plan, slos)
    if took is None:
        return Verdict(
            "recovery",
            "fail",
            f"not within the SLOs again in the {recovery.duration_s:g} s after the burst",
            {"recovery_s": None},
        )
    return Verdict(
        "recovery", "pass", f"within the SLOs {took:g} s after the burst", {"recovery_s": took}
    )


def _long_input_verdict(
    records: Sequence[RequestRecord],
    long_input: Sequence[bool],
    plan: StabilityPlan,
    slos: Sequence[Slo] = (),
) -> Verdict:
    longs = [r for r, is_long in zip(records, long_input, strict=True) if is_long]
    if not longs:
        return Verdict("long_inputs", "n/a", "no long input in the plan")
    failed = [r for r in longs if not r.ok]
    ok = [r for r in longs if r.ok and r.first_token_s is not None]
    ttfts = [(r.first_token_s - r.sent_s) * 1000 for r in ok if r.first_token_s is not None]
    p95 = float(np.percentile(ttfts, 95)) if ttfts else math.nan
    text = (
        f"{len(ok)}/{len(longs)} served ({plan.long_input_tokens} prompt tokens), "
        f"{len(failed)} failed; P95 TTFT {p95:,.0f} ms"
    )
    status = "fail" if failed else "pass"
    if failed:
        text += f"; first error: {failed[0].error}"
    # Served too slowly is not served: the long inputs' own P95 TTFT against a TTFT SLO's bound.
    bound = next((x.threshold for x in slos if x.metric == "p95_ttft_ms"), None)
    if bound is not None and p95 > bound:
        status = "fail"
        text += f" (over the {bound:g} ms SLO)"
    return Verdict(
        "long_inputs",
        status,
        text,
        {"sent": len(longs), "served": len(ok), "failed": len(failed), "p95_ttft_ms": p95},
    )


def overall(verdicts: Sequence[Verdict]) -> str:
    """``unstable`` when a verdict failed, else ``stable``."""
    return "unstable" if any(v.status == "fail" for v in verdicts) else "stable"


def compare(chosen: Sequence[Verdict], baseline: Sequence[Verdict]) -> list[str]:
    """The verdicts on which the chosen configuration did worse than the baseline, in words."""
    base = {v.name: v for v in baseline}
    out = []
    for v in chosen:
        b = base.get(v.name)
        if b is not None and _RANK[v.status] > _RANK[b.status] and b.status != "n/a":
            out.append(f"{v.name}: chosen {v.status} ({v.text}) vs baseline {b.status} ({b.text})")
    return out
