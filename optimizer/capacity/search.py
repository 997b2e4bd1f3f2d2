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

**Racing at the incumbent** (``race_at`` set: the study's best capacity so far): the first step
is at the incumbent's scale (times ``1 + race_margin``). A configuration that passes there may
beat the incumbent: the search goes up until a step fails, then bisects as usual; it goes up by
``race_growth`` first, and each further pass squares the factor, up to ``growth`` (x1.25, then
x1.5625, then x2 with the defaults), so a configuration far above the incumbent is bracketed
within the step limit instead of told as a lower bound (a constant 1.25 over 8 steps stopped at
x4.8). One that fails cannot win: the search stops after at most one more step. A step stopped
early (far over an SLO) stops it at once. A near miss, whose margin ``m`` at the race scale
``S`` was measured in full, gets one step at ``0.9 * S / (1 + m)`` (where a margin linear in the
load would cross zero, a little below; never below ``S / growth``), which bounds it from below
when it passes (the trial's capacity lies in that bracket, estimated as below). Otherwise only
an upper bound is known (``raced_out``: the study tells such a trial to the sampler as pruned,
never as a measured capacity). A losing trial costs one or two steps instead of a whole search.

**The estimate** (:func:`estimate_capacity`): within the final bracket, the deciding margin
(the largest SLO margin) of every fully measured step, made non-decreasing in the scale
(isotonic regression: a noisy step cannot make the curve turn back), is interpolated linearly
in log scale to where it crosses zero. Its uncertainty is the margin noise divided by the
curve's slope, within the bracket. The sampler gets the estimate; the bracket stays beside it.

The search is pure: it calls ``measure(scale, attempt)`` and never touches a server, so it is
unit-tested against fake servers of known capacity (tests/unit/capacity).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scipy.optimize import isotonic_regression

from optimizer.types import CapacitySettings

__all__ = [
    "CapacityEstimate",
    "CapacityResult",
    "CapacitySettings",
    "StepOutcome",
    "estimate_capacity",
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
class CapacityEstimate:
    """A point estimate of the capacity (a rate scale) inside the search's bracket.

    Attributes:
        scale: The estimate (0.0 when no scale passed).
        lo: Lower end of its uncertainty (never below the bracket's ``lo``).
        hi: Upper end (never above the bracket's ``hi``; ``math.inf`` when open).
        method: ``interpolated`` (the margins' zero crossing), ``bracket midpoint`` (no fully
            measured failing step to interpolate to), ``lower bound`` (passed at the highest
            scale tried) or ``none`` (no scale passed).
    """

    scale: float
    lo: float
    hi: float
    method: str

    @property
    def uncertainty(self) -> float:
        """Half the estimate's range relative to it (``inf`` when open, 0 for none)."""
        if self.scale <= 0:
            return 0.0
        if not math.isfinite(self.hi):
            return math.inf
        return (self.hi - self.lo) / 2 / self.scale


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
        estimate: The point estimate inside the bracket (:func:`estimate_capacity`).
        raced: The search raced at an incumbent and this configuration lost (failed at the
            incumbent's scale): it stopped early, its bracket is coarse.
        race_scale: The scale of the race step (None without racing).
    """

    scale: float
    lo: float
    hi: float
    steps: tuple[StepOutcome, ...]
    converged: bool
    stop: str
    estimate: CapacityEstimate
    spread: float = 0.0
    raced: bool = False
    race_scale: float | None = None

    @property
    def raced_out(self) -> bool:
        """Lost the race and failed one step below too: only an upper bound (``hi``) known."""
        return self.raced and self.lo <= 0

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


_BOUND_BELOW_GUESS = 0.9
"""A lost race's bounding step: this fraction of the scale its margin points to."""


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
        race = (
            None
            if s.race_at is None
            else min(max(s.race_at * (1 + s.race_margin), s.min_scale), s.max_scale)
        )
        if race is not None:
            lo, hi, stop, raced = self._race(race)
        else:
            (lo, hi, stop), raced = self._bracket(s.start_scale, s.growth, 0.0, math.inf), False
        if not stop:
            lo, hi, stop = self._bisect(lo, hi)
        converged = lo > 0 and math.isfinite(hi) and hi / lo - 1.0 <= s.tolerance
        steps = tuple(self.steps)
        return CapacityResult(
            scale=lo,
            lo=lo,
            hi=hi,
            steps=steps,
            converged=converged,
            stop=stop,
            spread=self.spread,
            estimate=estimate_capacity(steps, lo, hi, max(s.noise, self.spread / 2)),
            raced=raced,
            race_scale=race,
        )

    def _race(self, race: float) -> tuple[float, float, str, bool]:
        """The race step at the incumbent's scale: up from it when it passes, else at most one
        step below it. Returns (lo, hi, stop, lost): ``stop`` empty when bisection follows."""
        s = self.s
        if self.verdict(race):
            if race >= s.max_scale:
                return (
                    race,
                    math.inf,
                    f"passed at the highest scale tried (x{s.max_scale:g})",
                    False,
                )
            up = min(race * s.race_growth, s.max_scale)
            lo, hi, stop = self._bracket(
                up, s.race_growth, race, math.inf, widen_to=max(s.growth, s.race_growth)
            )
            return lo, hi, stop, False
        if race <= s.min_scale:
            return 0.0, race, f"failed at the lowest scale tried (x{s.min_scale:g})", False
        lost = self.steps[-1]
        margin = lost.deciding_margin if not lost.stopped_early else math.inf
        if not math.isfinite(margin) or margin <= 0 or self.left <= 0:
            # Stopped early (far over an SLO) or no step left: nothing to bound it with.
            return 0.0, race, f"raced out: failed at the incumbent's x{race:.3g}", True
        # Where a margin linear in the load would cross zero, a little below it, but never
        # more than one growth factor down: a near miss is bounded by a step near the race.
        below = max(race / (1 + margin) * _BOUND_BELOW_GUESS, race / s.growth, s.min_scale)
        if self.verdict(below):
            return (
                below,
                race,
                (f"raced out: failed at the incumbent's x{race:.3g}, passed at x{below:.3g}"),
                True,
            )
        if below <= s.min_scale:
            return 0.0, below, f"failed at the lowest scale tried (x{s.min_scale:g})", False
        return (
            0.0,
            below,
            (
                f"raced out: failed at the incumbent's x{race:.3g} and at x{below:.3g}: its "
                f"capacity is below x{below:.3g}"
            ),
            True,
        )

    def _bracket(
        self,
        scale: float,
        growth: float,
        lo: float,
        hi: float,
        *,
        widen_to: float | None = None,
    ) -> tuple[float, float, str]:
        """Step by ``growth`` from ``scale`` until a pass and a fail are neighbours (or a
        bound is reached). Returns (lo, hi, stop): ``stop`` empty when bisection follows.
        ``widen_to``: at each pass going up, square the factor (up to this one) before the
        next step: from a race step passed at ``race * growth``, the climb goes on by
        ``growth**2``, then ``growth**4``, ..."""
        s = self.s
        while True:
            if self.left <= 0:
                return lo, hi, "step limit reached while bracketing"
            if self.verdict(scale):
                lo = scale
                if scale >= s.max_scale:
                    return lo, hi, f"passed at the highest scale tried (x{s.max_scale:g})"
                if math.isfinite(hi):
                    return lo, hi, ""
                if widen_to is not None:
                    growth = min(growth * growth, widen_to)
                scale = min(scale * growth, s.max_scale)
            else:
                hi = scale
                if lo > 0:
                    return lo, hi, ""
                if scale <= s.min_scale:
                    return lo, hi, f"failed at the lowest scale tried (x{s.min_scale:g})"
                scale = max(scale / growth, s.min_scale)

    def _bisect(self, lo: float, hi: float) -> tuple[float, float, str]:
        """Measure the geometric midpoint until the bracket is within the tolerance."""
        while hi / lo - 1.0 > self.s.tolerance:
            if self.left <= 0:
                return lo, hi, "step limit reached while bisecting"
            mid = math.sqrt(lo * hi)
            if self.verdict(mid):
                lo = mid
            else:
                hi = mid
        return lo, hi, f"bracket within {self.s.tolerance:.0%}"


def estimate_capacity(
    steps: tuple[StepOutcome, ...] | list[StepOutcome], lo: float, hi: float, noise: float
) -> CapacityEstimate:
    """Where the deciding margin crosses zero inside the bracket ``[lo, hi]``.

    Args:
        steps: Every measured step; those stopped early (partial margins) are left out.
        lo: Highest passing scale (0: none passed).
        hi: Lowest failing scale above ``lo`` (``math.inf``: none failed).
        noise: The margins' noise (relative to the thresholds), for the uncertainty.
    """
    if lo <= 0:
        return CapacityEstimate(0.0, 0.0, hi, "none")
    if not math.isfinite(hi):
        return CapacityEstimate(lo, lo, math.inf, "lower bound")
    midpoint = CapacityEstimate(math.sqrt(lo * hi), lo, hi, "bracket midpoint")
    by_scale: dict[float, list[float]] = {}
    for step in steps:
        if not step.stopped_early and math.isfinite(step.deciding_margin) and step.scale > 0:
            by_scale.setdefault(step.scale, []).append(step.deciding_margin)
    xs = sorted(by_scale)
    if len(xs) < 2:
        return midpoint
    means = [sum(by_scale[x]) / len(by_scale[x]) for x in xs]
    fitted = isotonic_regression(means, weights=[len(by_scale[x]) for x in xs]).x
    above = next((i for i, f in enumerate(fitted) if f > 0), None)
    if above is None or above == 0:
        return midpoint
    (x0, f0), (x1, f1) = (
        (math.log(xs[above - 1]), fitted[above - 1]),
        (math.log(xs[above]), fitted[above]),
    )
    slope = (f1 - f0) / (x1 - x0)
    log_lo, log_hi = math.log(lo), math.log(hi)
    at = min(max(x0 - f0 / slope, log_lo), log_hi)
    spread = noise / slope
    return CapacityEstimate(
        scale=math.exp(at),
        lo=math.exp(max(at - spread, log_lo)),
        hi=math.exp(min(at + spread, log_hi)),
        method="interpolated",
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
