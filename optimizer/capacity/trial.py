"""A capacity trial on a running server: warm up, search the rate scale, assemble the result.

:func:`run_capacity` is what :func:`optimizer.trial.run_trial` calls instead of a single replay
when the trial's spec asks for capacity. It is a top-level function of picklable arguments, so
the runner can move it into a clean client process (see ``run_trial``'s ``isolate_client``).

The trial's summary (what objectives and the sampler read) is the full summary of the highest
passing step, plus:

- ``capacity_scale``: the estimated capacity as a rate scale: inside the final bracket, where
  the deciding SLO's margin crosses zero (:func:`optimizer.capacity.search.estimate_capacity`;
  0 when no scale tried passed);
- ``capacity_rps``: the request rate of this traffic mix it carries within the SLOs at that
  scale (the trace's mean measured-window arrival rate x the scale): what the sampler is told;
- ``capacity_rps_lo`` / ``capacity_rps_hi``: the bracket the search measured (highest passing
  and lowest failing step; ``capacity_rps_hi`` NaN when no step above failed);
- ``capacity_output_tps``: ``capacity_rps`` in output tokens/s (x the trace's mean output
  length);
- ``nominal_p95_ttft_ms`` / ``nominal_p95_tpot_ms``: P95s of the first step, at the nominal
  scale (``start_scale``); NaN when that step was stopped early (a partial window is never
  told as a full one);
- for a trace with a pre-roll (its warm set): ``preroll_sends`` (the steps it was sent before:
  once per server, more where the steps could have evicted it), ``preroll_requests``,
  ``preroll_tokens`` and ``preroll_s`` summed over those sends, beside the steps' own seconds
  in the stored document.

When no scale passed, the summary is that of the lowest scale tried and the capacity keys are 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from objectives import parse_slo
from objectives.presets import FAILED_CONSTRAINT
from optimizer.capacity.measure import (
    ClientCouldNotKeepUp,
    StepRunner,
    offered_rps,
    slo_floors,
    step_doc,
)
from optimizer.capacity.search import (
    CapacityResult,
    StepOutcome,
    search_capacity,
)
from optimizer.engine.cpus import raise_client_priority
from optimizer.engine.logs import parse_prometheus
from optimizer.types import RequestRecord, Trace, TrialSpec
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayProgress

__all__ = ["CapacityOutcome", "capacity_constraints", "capacity_doc", "run_capacity"]

CAPACITY_KEYS = (
    "capacity_scale",
    "capacity_rps",
    "capacity_output_tps",
    "capacity_rps_lo",
    "capacity_rps_hi",
    "nominal_p95_ttft_ms",
    "nominal_p95_tpot_ms",
)


@dataclass(frozen=True)
class CapacityOutcome:
    """What a capacity trial measured (picklable).

    Attributes:
        search: The search with every step.
        summary: The trial's summary (see the module docstring).
        records: Records of the step the summary describes.
        doc: The JSON document stored with the trial (:func:`capacity_doc`).
        invalid: The client could not keep a step's schedule; the trial is not scored.
        message: One paragraph for a user.
    """

    search: CapacityResult | None
    summary: Mapping[str, float]
    records: tuple[RequestRecord, ...]
    doc: Mapping[str, Any]
    invalid: bool = False
    message: str = ""


def _metrics_reader(url: str) -> Callable[[], dict[str, float]]:
    def read() -> dict[str, float]:
        resp = httpx.get(f"{url}/metrics", timeout=5.0)
        resp.raise_for_status()
        return parse_prometheus(resp.text)

    return read


def _mean_output_tokens(trace: Trace, warmup: int) -> float:
    reqs = trace.requests[warmup:] or trace.requests
    return sum(r.output_tokens for r in reqs) / len(reqs)


def run_capacity(
    spec: TrialSpec,
    url: str,
    progress: Callable[[ReplayProgress], None] | None = None,
    boost: bool = False,
    on_step: Callable[[StepOutcome], None] | None = None,
    on_step_start: Callable[[float, str], None] | None = None,
) -> CapacityOutcome:
    """Search the capacity of the server at ``url`` for ``spec``'s trace and SLOs.

    Args:
        spec: The trial (``spec.capacity`` set).
        url: The running server.
        progress: Replay progress callback.
        boost: Raise this process's priority first (a client process of its own).
        on_step: Called after every step.
        on_step_start: Called with a step's scale (and a note) before it starts.

    Returns:
        The outcome; never raises for a failing configuration.
    """
    settings = spec.capacity
    assert settings is not None, "run_capacity needs spec.capacity"
    if boost:
        raise_client_priority(spec.client_priority)
    slos = [parse_slo(s) for s in spec.slos]
    workdir = Path(spec.workdir)
    runner = StepRunner(
        url=url,
        model=spec.engine.model,
        trace=spec.trace,
        slos=slos,
        vocab=TokenRange(*spec.token_range),
        seed=spec.seed,
        warmup_requests=spec.warmup_requests,
        max_send_lag_ms=spec.max_send_lag_ms,
        metrics=_metrics_reader(url),
        records_dir=workdir / "steps",
        progress=progress,
        on_step=on_step,
        on_step_start=on_step_start,
        full_at_or_below=settings.min_scale,
        kv_cache_tokens=spec.kv_cache_tokens,
    )
    try:
        runner.warm_up()
        search = search_capacity(runner, settings)
    except ClientCouldNotKeepUp as exc:
        return CapacityOutcome(
            search=None,
            summary={},
            records=(),
            doc={"isolation": runner.describe_isolation(), "error": str(exc)},
            invalid=True,
            message=str(exc),
        )
    return assemble(spec, search, runner)


def assemble(spec: TrialSpec, search: CapacityResult, runner: StepRunner) -> CapacityOutcome:
    """The trial's summary, records and stored document from a finished search."""
    best = search.best_step()
    shown = best if best is not None else search.lowest_step()
    step_no = int(shown.detail.get("step", -1)) if shown is not None else -1
    records = tuple(runner.records.get(step_no, ()))
    summary = capacity_summary(spec, search)
    floors: dict[str, float] = {}
    lowest = search.lowest_step()
    if best is None and lowest is not None:
        low_no = int(lowest.detail.get("step", -1))
        floors = slo_floors(spec.trace, runner.records.get(low_no, ()))
    doc = capacity_doc(search, spec, isolation=runner.describe_isolation(), floors=floors)
    return CapacityOutcome(
        search=search,
        summary=summary,
        records=records,
        doc=doc,
        message=_message(search, summary),
    )


def capacity_summary(spec: TrialSpec, search: CapacityResult) -> dict[str, float]:
    """The trial's summary (see the module docstring) from a finished search."""
    best = search.best_step()
    shown = best if best is not None else search.lowest_step()
    summary: dict[str, float] = dict(shown.summary) if shown is not None else {}
    if shown is not None and shown.stopped_early:
        summary["partial"] = 1.0  # no scale passed and the lowest was cut short
    per_scale = _rps_per_scale(spec, search)
    estimate = search.estimate.scale
    summary["capacity_scale"] = estimate
    summary["capacity_rps"] = estimate * per_scale
    summary["capacity_rps_lo"] = search.lo * per_scale
    summary["capacity_rps_hi"] = search.hi * per_scale if math.isfinite(search.hi) else math.nan
    summary["capacity_output_tps"] = summary["capacity_rps"] * _mean_output_tokens(
        spec.trace, spec.warmup_requests
    )
    if search.raced_out:  # no capacity measured, only an upper bound (capacity_rps_hi)
        for key in ("capacity_scale", "capacity_rps", "capacity_output_tps"):
            summary[key] = math.nan
    first = search.steps[0] if search.steps else None
    for key, metric in (
        ("nominal_p95_ttft_ms", "p95_ttft_ms"),
        ("nominal_p95_tpot_ms", "p95_tpot_ms"),
    ):
        value = math.nan
        if first is not None and not first.stopped_early:
            value = float(first.summary.get(metric, math.nan))
        summary[key] = value
    sent = [s.detail for s in search.steps if s.detail.get("preroll_requests")]
    if sent:
        summary["preroll_sends"] = float(len(sent))
        for key in ("preroll_requests", "preroll_tokens", "preroll_s"):
            summary[key] = float(sum(float(d.get(key) or 0.0) for d in sent))
    return summary


def _message(search: CapacityResult, summary: Mapping[str, float]) -> str:
    """The trial's paragraph: the estimate with its bracket, or why there is none."""
    lowest = search.lowest_step()
    if search.raced_out:
        return f"{search.stop} (capacity below {summary['capacity_rps_hi']:.3g} req/s)"
    if search.best_step() is None:
        where = f"x{lowest.scale:g}: {lowest.reason}" if lowest is not None else "no step"
        return f"no rate scale tried met the SLOs (lowest {where})"
    fail = search.first_failure()
    broke = f"; at x{fail.scale:g} {fail.reason}" if fail is not None else ""
    raced = "; raced out at the incumbent" if search.raced else ""
    return (
        f"capacity {summary['capacity_rps']:.3g} req/s (rate x{summary['capacity_scale']:.3g}, "
        f"bracket x[{search.lo:.3g}, {search.hi:.3g}], {len(search.steps)} steps{raced}){broke}"
    )


def _rps_per_scale(spec: TrialSpec, search: CapacityResult) -> float:
    """Requests/s of the trace's measured window at rate scale 1: what the steps offered per
    unit of scale (the trace's own rate when no step recorded it)."""
    for step in search.steps:
        if step.scale > 0 and "offered_rps" in step.detail:
            return float(step.detail["offered_rps"]) / step.scale
    return offered_rps(spec.trace, 1.0, spec.warmup_requests)


def capacity_doc(
    search: CapacityResult,
    spec: TrialSpec,
    *,
    isolation: str,
    floors: Mapping[str, float],
) -> dict[str, Any]:
    """The capacity search as stored with a trial (Optuna user attribute ``capacity``).

    ``rps`` and ``output_tps`` are the answer (the estimate, what the sampler is told);
    ``scale``, ``lo`` and ``hi`` the bracket in rate scales (``scale`` the highest passing),
    ``rps_lo`` / ``rps_hi`` the same in requests/s; ``estimate`` the point estimate with its
    range and method.
    """
    fail = search.first_failure()
    settings = spec.capacity

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    per_scale = _rps_per_scale(spec, search)
    est = search.estimate
    return {
        "scale": search.scale,
        "rps": est.scale * per_scale,
        "output_tps": est.scale * per_scale * _mean_output_tokens(spec.trace, spec.warmup_requests),
        "rps_lo": search.lo * per_scale,
        "rps_hi": finite(search.hi * per_scale),
        "estimate": {
            "scale": est.scale,
            "lo": est.lo,
            "hi": finite(est.hi),
            "method": est.method,
            "uncertainty": finite(est.uncertainty),
            "rps_lo": est.lo * per_scale,
            "rps_hi": finite(est.hi * per_scale),
        },
        "raced": search.raced,
        "raced_out": search.raced_out,
        "race_scale": search.race_scale,
        "lo": search.lo,
        "hi": finite(search.hi),
        "converged": search.converged,
        "bracket_width": finite(search.bracket_width),
        "repeat_spread": search.spread,
        "stop": search.stop,
        "steps": [step_doc(s) for s in search.steps],
        "broke_first": fail.broke if fail is not None else None,
        "broke_reason": fail.reason if fail is not None else None,
        "first_failure": dict(fail.summary) if fail is not None else None,
        "first_failure_partial": bool(fail.stopped_early) if fail is not None else None,
        "isolation": isolation,
        "floors": dict(floors),
        "nominal_scale": settings.start_scale if settings is not None else 1.0,
        "tolerance": settings.tolerance if settings is not None else None,
    }


def capacity_constraints(doc: Mapping[str, Any], slos: list[str]) -> list[float]:
    """Constraint values a capacity trial is told (<= 0 met), one per SLO.

    A configuration with capacity is feasible: the margins of its highest passing step.
    One that met the SLOs at no scale tried is told the margins of its lowest step when that
    step was measured in full, else every SLO violated (partial margins are never told).
    """
    steps = doc.get("steps") or []
    if not steps:
        return [FAILED_CONSTRAINT] * len(slos)
    if doc.get("scale", 0) > 0:
        best = [s for s in steps if s["passed"] and s["scale"] == doc["scale"]][-1]
        return [min(0.0, _m(best["margins"].get(s))) for s in slos]
    low = min(steps, key=lambda s: s["scale"])
    if low.get("stopped_early"):
        return [FAILED_CONSTRAINT] * len(slos)
    out = [_m(low["margins"].get(s)) for s in slos]
    if max(out, default=1.0) <= 0:  # noise repeats averaged it out of range: still a fail
        out = [max(m, 1e-3) for m in out]
    return out


def _m(v: Any) -> float:
    if v is None:
        return FAILED_CONSTRAINT
    return float(v)
