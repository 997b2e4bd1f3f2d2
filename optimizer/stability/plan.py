"""The plan of a stability run, and the one load it turns into (pure: no I/O, no clock).

A plan is four phases on one timeline, run on one server without a pause:

- ``sustained``: the study's trace, looped, at ``base_scale`` (a fraction of the measured
  capacity, or the trace's own rate for a fixed-load study) for most of the run;
- ``burst``: the trace at ``burst_scale`` (well above capacity) for a short step;
- ``recovery``: back to ``base_scale``; how long the server takes to be within its SLOs again;
- ``long_input``: ``base_scale`` again, with groups of requests near max-model-len mixed in.

Every loop of the trace gets fresh prompts: its prefix-block ids are shifted past every block id
an earlier loop used (the trace's own prefix sharing is kept inside a loop, nothing is served
from an earlier loop's cache), and every request's other tokens depend on its position in the
whole load, which is unique.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from optimizer.errors import ConfigError
from optimizer.types import Trace, TraceRequest

__all__ = [
    "PHASES",
    "Phase",
    "PlanLoad",
    "PlanSettings",
    "StabilityPlan",
    "build_load",
    "build_plan",
    "drain_time_s",
    "long_input_tokens",
    "plan_scales",
    "with_trace",
]

PHASES = ("sustained", "burst", "recovery", "long_input")


@dataclass(frozen=True)
class PlanSettings:
    """How long each phase lasts and how it loads the server.

    Attributes:
        sustained_s: Seconds of sustained load.
        burst_s: Seconds of the burst.
        recovery_s: Seconds at the sustained rate after the burst.
        long_input_s: Seconds of the long-input phase.
        long_every_s: A group of long inputs arrives every this many seconds.
        long_group: Long inputs per group (sent at the same instant: they compete for the KV
            cache, which is what a too small cache cannot take).
        long_output_tokens: Output tokens of a long input.
        window_s: Width of the latency windows (P95/P99 per window).
        sample_interval_s: Seconds between two samples of the server's state.
        drain_grace_s: After the last arrival, how long requests may still finish.
    """

    sustained_s: float = 180.0
    burst_s: float = 20.0
    recovery_s: float = 30.0
    long_input_s: float = 30.0
    long_every_s: float = 5.0
    long_group: int = 2
    long_output_tokens: int = 16
    window_s: float = 10.0
    sample_interval_s: float = 1.0
    drain_grace_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("sustained_s", "window_s", "sample_interval_s", "long_every_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"stability plan: {name} must be > 0, got {getattr(self, name)}")
        for name in ("burst_s", "recovery_s", "long_input_s", "drain_grace_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"stability plan: {name} must be >= 0, got {getattr(self, name)}")
        if self.long_group < 1 or self.long_output_tokens < 1:
            raise ConfigError("stability plan: long_group and long_output_tokens must be >= 1")


@dataclass(frozen=True)
class Phase:
    """One phase: ``[start_s, end_s)`` of the plan's timeline at a rate scale of the trace."""

    name: str
    start_s: float
    end_s: float
    scale: float
    long_inputs: bool = False

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StabilityPlan:
    """The phases, the scales and the long inputs' length.

    Attributes:
        phases: The phases in time order (a phase of zero length is left out).
        base_scale: Rate scale of the sustained, recovery and long-input phases.
        burst_scale: Rate scale of the burst.
        max_model_len: The context length the long inputs come near.
        long_input_tokens: Prompt tokens of a long input.
        settings: The settings it was built from.
        trace_period_s: One loop of the trace at rate scale 1 (:func:`with_trace`; None: not
            known). The drift verdict compares whole loops, so a bursty trace's quiet start is
            never compared with its busy middle.
    """

    phases: tuple[Phase, ...]
    base_scale: float
    burst_scale: float
    max_model_len: int
    long_input_tokens: int
    settings: PlanSettings
    trace_period_s: float | None = None

    def loop_s(self) -> float | None:
        """Seconds one loop of the trace lasts in the sustained phase (None: not known)."""
        if not self.trace_period_s or self.base_scale <= 0:
            return None
        return self.trace_period_s / self.base_scale

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s if self.phases else 0.0

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    def phase_at(self, t_s: float) -> str:
        """The phase a time of the timeline falls in (the last one after the end)."""
        for p in self.phases:
            if t_s < p.end_s:
                return p.name
        return self.phases[-1].name

    def doc(self) -> dict[str, Any]:
        """JSON-safe."""
        return {
            "phases": [asdict(p) for p in self.phases],
            "base_scale": self.base_scale,
            "burst_scale": self.burst_scale,
            "max_model_len": self.max_model_len,
            "long_input_tokens": self.long_input_tokens,
            "settings": asdict(self.settings),
            "trace_period_s": self.trace_period_s,
        }


def long_input_tokens(max_model_len: int, output_tokens: int) -> int:
    """Prompt length of a long input: prompt + output end a small margin below the context
    length (1/64 of it, at least 8 tokens), so a server that holds max-model-len takes it."""
    margin = max(8, max_model_len // 64)
    tokens = max_model_len - margin - output_tokens
    if tokens < 1:
        raise ConfigError(
            f"stability plan: max-model-len {max_model_len} leaves no room for a long input "
            f"with {output_tokens} output tokens"
        )
    return tokens


def plan_scales(
    capacity_scale: float | None, fraction: float, burst_factor: float
) -> tuple[float, float]:
    """(base, burst) rate scales: ``fraction`` and ``burst_factor`` of a measured capacity
    scale; the trace's own rate and ``burst_factor`` times it for a fixed-load study (None).

    Raises:
        ConfigError: A capacity study whose configuration carried the trace at no scale.
    """
    if not (fraction > 0 and burst_factor > 0):
        raise ConfigError(f"fraction and burst factor must be > 0, got {fraction}, {burst_factor}")
    if capacity_scale is None:
        return 1.0, burst_factor
    if capacity_scale <= 0:
        raise ConfigError(
            "the chosen trial met the SLOs at no rate scale (capacity 0): nothing to run a "
            "fraction of; choose a trial with capacity (--trial)"
        )
    return fraction * capacity_scale, burst_factor * capacity_scale


def drain_time_s(
    burst_s: float, burst_scale: float, base_scale: float, capacity_scale: float
) -> float | None:
    """Seconds the backlog of a burst takes to drain at capacity: the burst leaves
    ``burst_s * (burst_scale - capacity)`` (in seconds of the trace at scale 1) of work behind,
    served at the spare rate ``capacity - base``. An upper estimate (capacity is the highest
    rate within the SLOs, not the most a server can push through); None when the burst does not
    exceed capacity or the load leaves nothing spare."""
    spare = capacity_scale - base_scale
    if burst_scale <= capacity_scale or spare <= 0:
        return None
    return burst_s * (burst_scale - capacity_scale) / spare


def build_plan(
    settings: PlanSettings, *, base_scale: float, burst_scale: float, max_model_len: int
) -> StabilityPlan:
    """The phases of ``settings`` at these scales, one after the other from time 0."""
    if not (base_scale > 0 and burst_scale > 0):
        raise ConfigError(
            f"stability plan: rate scales must be > 0, got {base_scale} and {burst_scale}"
        )
    spans = (
        ("sustained", settings.sustained_s, base_scale, False),
        ("burst", settings.burst_s, burst_scale, False),
        ("recovery", settings.recovery_s, base_scale, False),
        ("long_input", settings.long_input_s, base_scale, True),
    )
    phases = []
    t = 0.0
    for name, seconds, scale, long_inputs in spans:
        if seconds > 0:
            phases.append(Phase(name, t, t + seconds, scale, long_inputs))
            t += seconds
    return StabilityPlan(
        phases=tuple(phases),
        base_scale=base_scale,
        burst_scale=burst_scale,
        max_model_len=max_model_len,
        long_input_tokens=long_input_tokens(max_model_len, settings.long_output_tokens),
        settings=settings,
    )


@dataclass(frozen=True)
class PlanLoad:
    """The plan as one trace, and what each of its requests is.

    Attributes:
        trace: Every request of the run, sorted by arrival (time 0: the plan's start).
        phase_of: Each request's phase name.
        long_input: True for the long inputs.
    """

    trace: Trace
    phase_of: tuple[str, ...]
    long_input: tuple[bool, ...]

    def count(self, phase: str) -> int:
        return sum(1 for p in self.phase_of if p == phase)


class _Looper:
    """The trace repeated, each loop's prefix blocks shifted past every earlier loop's."""

    def __init__(self, trace: Trace) -> None:
        if not trace.requests:
            raise ConfigError("stability plan: the study's trace is empty")
        self.requests = trace.requests
        first = trace.requests[0].arrival_s
        self.offsets = [r.arrival_s - first for r in trace.requests]
        span = self.offsets[-1]
        n = len(trace.requests)
        # One mean gap between the end of a loop and the start of the next.
        self.period = span + (span / (n - 1) if n > 1 and span > 0 else 1.0)
        self.stride = max((b for r in trace.requests for b in r.prefix_blocks), default=-1) + 1
        self.loops = 0

    def over(self, start_s: float, end_s: float, scale: float) -> Iterator[TraceRequest]:
        """Loops of the trace at ``scale`` filling ``[start_s, end_s)``."""
        t0 = start_s
        while t0 < end_s:
            shift = self.loops * self.stride
            self.loops += 1
            for r, offset in zip(self.requests, self.offsets, strict=True):
                t = t0 + offset / scale
                if t >= end_s:
                    return
                yield replace(
                    r, arrival_s=t, prefix_blocks=tuple(b + shift for b in r.prefix_blocks)
                )
            t0 += self.period / scale


def with_trace(plan: StabilityPlan, trace: Trace) -> StabilityPlan:
    """The plan knowing how long one loop of ``trace`` lasts (what :func:`build_load` loops)."""
    return replace(plan, trace_period_s=_Looper(trace).period)


def build_load(trace: Trace, plan: StabilityPlan) -> PlanLoad:
    """Every request of the plan: the trace looped through each phase at its scale, with the
    long-input groups of the long-input phase (first group half a period into the phase)."""
    looper = _Looper(trace)
    tagged: list[tuple[TraceRequest, str, bool]] = []
    s = plan.settings
    for phase in plan.phases:
        tagged += [
            (r, phase.name, False) for r in looper.over(phase.start_s, phase.end_s, phase.scale)
        ]
        if phase.long_inputs:
            t = phase.start_s + s.long_every_s / 2
            while t < phase.end_s:
                long = TraceRequest(
                    arrival_s=t,
                    input_tokens=plan.long_input_tokens,
                    output_tokens=s.long_output_tokens,
                )
                tagged += [(long, phase.name, True)] * s.long_group
                t += s.long_every_s
    tagged.sort(key=lambda x: x[0].arrival_s)
    return PlanLoad(
        trace=Trace(
            requests=tuple(r for r, _, _ in tagged),
            block_size=trace.block_size,
            source=f"stability plan over {trace.source}",
        ),
        phase_of=tuple(p for _, p, _ in tagged),
        long_input=tuple(x for _, _, x in tagged),
    )
