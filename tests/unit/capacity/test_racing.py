"""Racing at the incumbent and the interpolated capacity, against fake servers of known
capacity (fakes: no server, no replay; the margins are functions of the scale)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from optimizer.capacity.search import (
    CapacitySettings,
    StepOutcome,
    estimate_capacity,
    search_capacity,
)
from tests.unit.capacity.test_search import SLO, fake_server


def queueing_server(capacity: float, *, noise_sd: float = 0.0, seed: int = 0):
    """A fake whose P95 TTFT grows like a queue's (convex in the load) and crosses the SLO at
    exactly ``capacity``; far past it the step is stopped early."""
    rng = random.Random(seed)

    def measure(scale: float, attempt: int) -> StepOutcome:
        load = scale / (capacity * 1.25)  # utilization 0.8 at capacity
        if load >= 0.98:
            return StepOutcome(scale, {SLO: 9.0}, stopped_early=True, reason="out of reach")
        # Normalized so that the margin is 0 at utilization 0.8.
        margin = (load / (1 - load)) / 4.0 - 1.0 + rng.gauss(0.0, noise_sd)
        return StepOutcome(scale, {SLO: margin})

    return measure


def _half_bracket(result) -> float:
    return (result.hi - result.lo) / 2


@pytest.mark.parametrize("make", [fake_server, queueing_server], ids=["linear", "queueing"])
@pytest.mark.parametrize("capacity", [0.3, 0.77, 1.0, 2.9, 6.1])
def test_estimate_within_half_a_bracket_of_the_truth(make, capacity: float) -> None:
    settings = CapacitySettings(tolerance=0.15, max_steps=12, noise=0.0)
    result = search_capacity(make(capacity), settings)
    est = result.estimate
    assert est is not None and est.method == "interpolated", (est, result.stop)
    assert result.lo <= est.scale <= result.hi
    assert abs(est.scale - capacity) <= _half_bracket(result), (est, result.lo, result.hi)
    # At least as close as the bracket's answer (its lower end) on these curves.
    assert abs(est.scale - capacity) <= abs(result.scale - capacity)


def test_noisy_estimates_stay_in_the_bracket_and_beat_the_bracket_on_average() -> None:
    capacity = 1.3
    settings = CapacitySettings(tolerance=0.15, max_steps=12, noise=0.05, max_repeats=1)
    est_errors, bracket_errors, halves = [], [], []
    for seed in range(40):
        result = search_capacity(fake_server(capacity, noise_sd=0.04, seed=seed), settings)
        est = result.estimate
        assert est is not None and result.lo <= est.lo <= est.scale <= est.hi <= result.hi
        est_errors.append(abs(est.scale - capacity))
        bracket_errors.append(abs(result.scale - capacity))
        halves.append(_half_bracket(result))
    assert statistics.median(est_errors) <= statistics.median(halves)
    assert statistics.mean(est_errors) < statistics.mean(bracket_errors)


def test_a_configuration_that_serves_nothing_has_no_estimate() -> None:
    settings = CapacitySettings(start_scale=1.0, min_scale=0.25, max_steps=8, noise=0.0)
    result = search_capacity(fake_server(0.0), settings)
    assert result.scale == 0.0
    assert result.estimate.scale == 0.0
    assert result.estimate.method == "none" and result.estimate.uncertainty == 0.0
    # Racing cannot make a server that serves nothing look raced out: it failed at the floor.
    raced = search_capacity(fake_server(0.0), CapacitySettings(min_scale=0.25, race_at=0.4))
    assert raced.scale == 0.0 and not raced.raced_out and "lowest scale" in raced.stop


def test_passing_at_the_highest_scale_is_a_lower_bound() -> None:
    result = search_capacity(fake_server(50.0), CapacitySettings(max_scale=4.0, noise=0.0))
    assert result.estimate.method == "lower bound"
    assert result.estimate.scale == 4.0 and math.isinf(result.estimate.hi)


def test_estimate_without_a_full_failing_step_is_the_bracket_midpoint() -> None:
    steps = [StepOutcome(1.0, {SLO: -0.2}), StepOutcome(2.0, {SLO: 5.0}, stopped_early=True)]
    est = estimate_capacity(steps, 1.0, 2.0, noise=0.05)
    assert est.method == "bracket midpoint" and est.scale == pytest.approx(math.sqrt(2))
    assert (est.lo, est.hi) == (1.0, 2.0)


def test_a_noisy_step_cannot_bend_the_curve_back() -> None:
    """Margins that dip at a higher scale are pooled (isotonic), never a second crossing."""
    steps = [
        StepOutcome(1.0, {SLO: -0.3}),
        StepOutcome(1.2, {SLO: 0.1}),
        StepOutcome(1.1, {SLO: -0.05}),
        StepOutcome(1.15, {SLO: -0.1}),  # noise: lower than the step below it
    ]
    est = estimate_capacity(steps, 1.15, 1.2, noise=0.0)
    assert est.method == "interpolated" and 1.15 <= est.scale <= 1.2


def test_a_losing_configuration_stops_after_two_steps_bounded_from_below() -> None:
    capacity, incumbent = 0.7, 1.0
    settings = CapacitySettings(start_scale=1.0, tolerance=0.05, max_steps=10, noise=0.0)
    full = search_capacity(fake_server(capacity), settings)
    raced = search_capacity(fake_server(capacity), _race(settings, incumbent))
    assert raced.raced and not raced.raced_out
    # The race step's margin (1 / 0.7 - 1) points at 0.7: the bounding step is at 0.9 x 0.7.
    assert [s.scale for s in raced.steps] == pytest.approx([1.0, 0.63])
    assert (raced.lo, raced.hi) == (pytest.approx(0.63), 1.0)
    assert "raced out" in raced.stop
    # The estimate from the two steps' margins, not the bracket's lower end.
    assert raced.estimate.method == "interpolated"
    assert raced.lo <= raced.estimate.scale <= raced.hi
    assert abs(raced.estimate.scale - capacity) < abs(raced.scale - capacity)
    # Cheaper than today's search of the same configuration by at least 3x in steps.
    assert len(full.steps) >= 3 * len(raced.steps), [s.scale for s in full.steps]


def test_a_much_worse_configuration_is_raced_out_after_one_step() -> None:
    """Its race step was stopped early (far over the SLO): nothing to bound it with."""
    raced = search_capacity(
        fake_server(0.3), _race(CapacitySettings(min_scale=0.0625, noise=0.0), 1.0)
    )
    assert raced.raced_out and raced.scale == 0.0 and raced.hi == 1.0
    assert len(raced.steps) == 1 and raced.steps[0].stopped_early


def test_a_near_miss_that_fails_its_bounding_step_is_raced_out_below_it() -> None:
    """A margin that grows slowly above capacity: the linear guess lands above it."""

    def flat_above(scale: float, attempt: int) -> StepOutcome:
        return StepOutcome(scale, {SLO: 0.05 * (scale / 0.5 - 1)})

    raced = search_capacity(flat_above, _race(CapacitySettings(min_scale=0.0625, noise=0.0), 0.6))
    assert raced.raced_out and len(raced.steps) == 2, raced.steps
    below = raced.steps[1].scale
    assert 0.6 / 2 <= below < 0.6 and raced.hi == below
    assert f"below x{below:.3g}" in raced.stop


def test_a_better_configuration_passes_the_race_and_is_searched_up_from_there() -> None:
    capacity, incumbent = 1.4, 1.0
    settings = _race(CapacitySettings(tolerance=0.05, max_steps=10, noise=0.0), incumbent)
    result = search_capacity(fake_server(capacity), settings)
    assert not result.raced and result.converged
    assert result.steps[0].scale == incumbent and result.steps[0].passed
    assert result.steps[1].scale == pytest.approx(incumbent * settings.race_growth)
    assert result.scale <= capacity < result.hi
    assert abs(result.estimate.scale - capacity) <= _half_bracket(result)


def test_a_winner_far_above_the_incumbent_is_bracketed_not_told_as_a_lower_bound() -> None:
    """x6 the incumbent within the default 8 steps: the climb widens (x1.25, x1.5625, x2, ...),
    where a constant 1.25 would stop at x4.8 (1.25**7) with a lower bound."""
    capacity, incumbent = 6.0, 1.0
    settings = _race(CapacitySettings(max_steps=8, noise=0.0, max_scale=64.0), incumbent)
    result = search_capacity(fake_server(capacity), settings)
    scales = [st.scale for st in result.steps]
    ups = [round(b / a, 4) for a, b in itertools.pairwise(scales)][:4]
    assert ups == [1.25, 1.5625, 2.0, 2.0], [st.scale for st in result.steps]
    assert result.estimate.method != "lower bound" and math.isfinite(result.hi)
    assert result.scale <= capacity < result.hi


def test_a_small_winner_costs_what_it_did_with_a_constant_climb() -> None:
    """x1.1 the incumbent: pass at the race, fail at x1.25, then bisect: the widening never
    comes into play (it starts after a second pass going up)."""
    settings = _race(CapacitySettings(tolerance=0.05, noise=0.0), 1.0)
    result = search_capacity(fake_server(1.1), settings)
    assert [round(st.scale, 4) for st in result.steps[:2]] == [1.0, 1.25]
    assert not result.steps[1].passed and result.scale <= 1.1 < result.hi


def test_the_race_margin_moves_the_first_step() -> None:
    settings = _race(CapacitySettings(noise=0.0, race_margin=0.1), 1.0)
    result = search_capacity(fake_server(2.0), settings)
    assert result.steps[0].scale == pytest.approx(1.1) and result.race_scale == pytest.approx(1.1)


def _race(settings: CapacitySettings, incumbent: float) -> CapacitySettings:
    from dataclasses import replace

    return replace(settings, race_at=incumbent)
