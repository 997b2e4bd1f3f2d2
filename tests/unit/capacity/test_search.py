"""The rate search against fake servers of known capacity (fakes: no server, no replay)."""

from __future__ import annotations

import math
import random

import pytest

from optimizer.capacity.search import CapacitySettings, StepOutcome, search_capacity
from optimizer.errors import ConfigError

SLO = "p95_ttft_ms<=500"


def fake_server(capacity: float, *, noise_sd: float = 0.0, seed: int = 0, stop_above: float = 2.0):
    """A fake server: its P95 TTFT margin is ``scale / capacity - 1`` (monotone), plus noise.

    Far above capacity (margin > ``stop_above - 1``) the step is stopped early, as a real
    replay's early stop would, with no usable margins.
    """
    rng = random.Random(seed)
    calls: list[tuple[float, int]] = []

    def measure(scale: float, attempt: int) -> StepOutcome:
        calls.append((scale, attempt))
        if capacity <= 0:
            return StepOutcome(scale, {SLO: 4.0}, reason="serves nothing")
        margin = scale / capacity - 1.0 + rng.gauss(0.0, noise_sd)
        if margin > stop_above - 1.0:
            return StepOutcome(scale, {SLO: margin}, stopped_early=True, reason="out of reach")
        return StepOutcome(scale, {SLO: margin})

    measure.calls = calls  # type: ignore[attr-defined]
    return measure


@pytest.mark.parametrize("capacity", [0.3, 1.0, 1.7, 3.14, 9.5])
def test_monotone_capacity_found_within_tolerance_and_step_limit(capacity: float) -> None:
    settings = CapacitySettings(tolerance=0.05, max_steps=12, noise=0.0)
    measure = fake_server(capacity)
    result = search_capacity(measure, settings)
    assert result.converged, result.stop
    assert len(result.steps) <= settings.max_steps
    # The answer is a passing scale at or below the true capacity, within the tolerance.
    assert result.scale <= capacity
    assert result.scale >= capacity / (1 + settings.tolerance)
    assert result.hi > capacity
    assert result.best_step() is not None and result.best_step().passed
    failure = result.first_failure()
    assert failure is not None and failure.broke == SLO


def test_step_limit_is_respected_and_bracket_reported() -> None:
    settings = CapacitySettings(tolerance=0.001, max_steps=4, noise=0.0)
    result = search_capacity(fake_server(2.6), settings)
    assert len(result.steps) == 4
    assert not result.converged
    assert "step limit" in result.stop
    assert 0 < result.lo <= 2.6 < result.hi
    assert result.bracket_width == pytest.approx(result.hi / result.lo - 1)


def test_noisy_server_repeats_near_threshold_steps_and_stays_close() -> None:
    capacity = 2.0
    hits = 0
    repeated = 0
    for seed in range(20):
        settings = CapacitySettings(tolerance=0.05, max_steps=14, noise=0.05, max_repeats=2)
        measure = fake_server(capacity, noise_sd=0.02, seed=seed)
        result = search_capacity(measure, settings)
        assert len(result.steps) <= settings.max_steps
        attempts = [a for _, a in measure.calls]  # type: ignore[attr-defined]
        # A repeat is asked for only with its step's margin within the noise band.
        for scale, attempt in measure.calls:  # type: ignore[attr-defined]
            if attempt > 0:
                assert abs(scale / capacity - 1.0) < 0.05 + 5 * 0.02
        repeated += any(a > 0 for a in attempts)
        # With noise of 2 % the answer lands within 10 % of the truth.
        if abs(result.scale / capacity - 1) <= 0.10:
            hits += 1
    assert hits >= 18
    # Bisection lands near the threshold, so most searches repeated a step there.
    assert repeated >= 10


def test_repeat_spread_is_reported() -> None:
    settings = CapacitySettings(tolerance=0.05, max_steps=14, noise=0.2, max_repeats=1)
    result = search_capacity(fake_server(1.5, noise_sd=0.05, seed=3), settings)
    assert result.spread > 0


def test_configuration_that_serves_nothing_has_capacity_zero() -> None:
    settings = CapacitySettings(min_scale=0.125, max_steps=10)
    measure = fake_server(0.0)
    result = search_capacity(measure, settings)
    assert result.scale == 0.0
    assert result.lo == 0.0
    assert result.hi == settings.min_scale
    assert "lowest scale" in result.stop
    assert result.best_step() is None
    lowest = result.lowest_step()
    assert lowest is not None and lowest.scale == settings.min_scale and not lowest.passed
    # 1, 1/2, 1/4, 1/8: bracketing down stops at min_scale.
    assert [s.scale for s in result.steps] == [1.0, 0.5, 0.25, 0.125]


def test_capacity_above_the_highest_scale_is_open_ended() -> None:
    settings = CapacitySettings(max_scale=4.0, max_steps=10, noise=0.0)
    result = search_capacity(fake_server(100.0), settings)
    assert result.scale == 4.0
    assert math.isinf(result.hi)
    assert not result.converged
    assert "highest scale" in result.stop


def test_early_stopped_step_is_a_certain_fail_and_never_repeated() -> None:
    settings = CapacitySettings(noise=10.0, max_repeats=3, max_steps=10)
    # stop_above 1.0: any miss is stopped early.
    measure = fake_server(1.0, stop_above=1.0)
    result = search_capacity(measure, settings)
    stopped = [s for s in result.steps if s.stopped_early]
    assert stopped
    for s in stopped:
        assert not s.passed
        assert sum(1 for t in result.steps if t.scale == s.scale) == 1


def test_invalid_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="min_scale"):
        CapacitySettings(start_scale=0.01, min_scale=0.1)
    with pytest.raises(ConfigError, match="tolerance"):
        CapacitySettings(tolerance=0)
    with pytest.raises(ConfigError, match="growth"):
        CapacitySettings(growth=1.0)
