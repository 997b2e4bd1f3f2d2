"""The rate search: the highest scale of a trace's arrival rate at which every SLO holds.

A configuration's capacity is found the way ``vllm bench sweep serve_sla`` and SGLang's
benchmarks look for it, on the project's own replayed trace: measure a step at a rate scale
(the trace's arrival times divided by the scale, its burst structure kept), then

1. **bracket**: from ``start_scale``, multiply by ``growth`` while steps pass (or divide while
   they fail) until one step passes and a neighbour fails, or ``max_scale`` / ``min_scale`` is
   reached;
2. **bisect**: measure the geometric midpoint of the bracket until ``hi / lo - 1`` is within
   ``tolerance`` or ``max_steps`` replays were spent.

A step's verdict is pass/fail: it passes when every SLO holds over its measured window. A
step whose deciding margin (the largest SLO margin, relative to its threshold) lies within
``noise`` of zero is repeated, up to ``max_repeats`` times, with fresh prompts, and its verdict
is that of the mean margin; the spread of the repeats is kept as the step's noise. A step that
was stopped early (its SLOs out of reach) is a certain fail and is never repeated.

The search is pure: it calls ``measure(scale, attempt)`` and never touches a server, so it is
unit-tested against fake servers of known capacity (tests/unit/capacity).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from optimizer.types import CapacitySettings

__all__ = [
    "CapacityResult",
    "CapacitySettings",
    "StepOutcome",
    "search_capacity",
]


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """One measured step, as ``measure`` reports it.

    Attributes:
        scale: The rate scale replayed.
        margins: SLO -> margin (<= 0 met), over the measured window. Empty for a step that
            measured nothing.
        stopped_early: The step was stopped once its SLOs were out of reach: a certain fail
            whose margins are partial and must not be compared with full steps.
        reason: Why it failed, in a sentence (the early-stop reason, or the SLO that broke).
        summary: The step's summary (``objectives.summarize`` keys).
        detail: Anything else the caller wants kept with the step (seed, duration, ...).
    """

    scale: float
    margins: Mapping[str, float]
    stopped_early: bool = False
    reason: str = ""
    summary: Mapping[str, float] = field(default_factory=dict)
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def deciding_margin(self) -> float:
        """The largest SLO margin (the one that decides pass/fail); +inf when unmeasured."""
        if not self.margins:
            return math.inf
        return max(self.margins.values())

    @property
    def passed(self) -> bool:
        """Every SLO held over a full measured window."""
        return not self.stopped_early and self.deciding_margin <= 0

    @property
    def broke(self) -> str | None:
        """The SLO that broke first (largest margin), or None when the step passed."""
        if self.passed:
            return None
        if not self.margins:
            return None
        return max(self.margins, key=lambda k: self.margins[k])


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """What the search found.

    Attributes:
        scale: Highest passing scale (0.0 when no scale passed).
        lo: Lower end of the final bracket (highest pass; 0.0 if none).
        hi: Upper end (lowest fail above ``lo``; ``math.inf`` if none failed).
        steps: Every step in the order measured (repeats included).
        converged: ``hi / lo - 1 <= tolerance``.
        stop: Why the search ended, in words.
        spread: Largest relative spread of the deciding margin among a step's repeats
            (0.0 when nothing was repeated): the run-to-run noise the search saw.
    """

    scale: float
    lo: float
    hi: float
    steps: tuple[StepOutcome, ...]
    converged: bool
    stop: str
    spread: float = 0.0

    @property
    def bracket_width(self) -> float:
        """``hi / lo - 1``: the capacity's uncertainty from the bracket (inf when open)."""
        if self.lo <= 0 or not math.isfinite(self.hi):
            return math.inf
        return self.hi / self.lo - 1.0

    def best_step(self) -> StepOutcome | None:
        """The (last) passing step at :attr:`scale`, or None."""
        passing = [s for s in self.steps if s.passed and s.scale == self.scale]
        return passing[-1] if passing else None

    def first_failure(self) -> StepOutcome | None:
        """The failing step at :attr:`hi` (the lowest failing scale above the capacity)."""
        failing = [s for s in self.steps if not s.passed and s.scale == self.hi]
        return failing[0] if failing else None

    def lowest_step(self) -> StepOutcome | None:
        """The step at the lowest scale measured (what a capacity-0 trial is judged by)."""
        if not self.steps:
            return None
        low = min(s.scale for s in self.steps)
        return next(s for s in self.steps if s.scale == low)


Measure = Callable[[float, int], StepOutcome]
"""``measure(scale, attempt)``: replay one step; ``attempt`` counts repeats of that scale."""


class _Search:
    def __init__(self, measure: Measure, settings: CapacitySettings) -> None:
        self.measure = measure
        self.s = settings
        self.steps: list[StepOutcome] = []
        self.spread = 0.0

    @property
    def left(self) -> int:
        return self.s.max_steps - len(self.steps)

    def verdict(self, scale: float) -> bool:
        """Measure a scale (repeating near-threshold steps); True when it passes."""
        first = self.measure(scale, 0)
        self.steps.append(first)
        outcomes = [first]
        while (
            not first.stopped_early
            and math.isfinite(first.deciding_margin)
            and abs(first.deciding_margin) <= self.s.noise
            and len(outcomes) <= self.s.max_repeats
            and self.left > 0
        ):
            again = self.measure(scale, len(outcomes))
            self.steps.append(again)
            outcomes.append(again)
            if again.stopped_early or not math.isfinite(again.deciding_margin):
                return False
        if len(outcomes) == 1:
            return first.passed
        margins = [o.deciding_margin for o in outcomes]
        self.spread = max(self.spread, max(margins) - min(margins))
        return sum(margins) / len(margins) <= 0

    def run(self) -> CapacityResult:
        s = self.s
        lo, hi = 0.0, math.inf
        scale = s.start_scale
        stop = ""
        # Bracket.
        while True:
            if self.left <= 0:
                stop = "step limit reached while bracketing"
                break
            if self.verdict(scale):
                lo = scale
                if scale >= s.max_scale:
                    stop = f"passed at the highest scale tried (x{s.max_scale:g})"
                    break
                if math.isfinite(hi):
                    break
                scale = min(scale * s.growth, s.max_scale)
            else:
                hi = scale
                if lo > 0:
                    break
                if scale <= s.min_scale:
                    stop = f"failed at the lowest scale tried (x{s.min_scale:g})"
                    break
                scale = max(scale / s.growth, s.min_scale)
        # Bisect.
        if not stop:
            while hi / lo - 1.0 > s.tolerance:
                if self.left <= 0:
                    stop = "step limit reached while bisecting"
                    break
                mid = math.sqrt(lo * hi)
                if self.verdict(mid):
                    lo = mid
                else:
                    hi = mid
            else:
                stop = f"bracket within {s.tolerance:.0%}"
        converged = lo > 0 and math.isfinite(hi) and hi / lo - 1.0 <= s.tolerance
        return CapacityResult(
            scale=lo,
            lo=lo,
            hi=hi,
            steps=tuple(self.steps),
            converged=converged,
            stop=stop,
            spread=self.spread,
        )


def search_capacity(measure: Measure, settings: CapacitySettings) -> CapacityResult:
    """Find the highest rate scale at which ``measure`` passes.

    Args:
        measure: Replays one step at a scale and reports its outcome; it must use fresh
            prompts per call (nothing served from an earlier step's cache).
        settings: Search bounds, tolerance and step limit.

    Returns:
        The capacity (highest passing scale), the final bracket and every step.
    """
    return _Search(measure, settings).run()
