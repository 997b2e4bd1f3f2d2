"""The regression comparison on synthetic figures: the noise band, directions, figures near
zero, a disturbed recorded run, the SLO row, a configuration that no longer runs, the verdict."""

from __future__ import annotations

import math

import pytest

from optimizer.regress.compare import (
    ConfigComparison,
    compare_figure,
    compare_slos,
    noise_band,
    verdict,
)


def test_a_change_below_the_floor_is_within_the_noise() -> None:
    row = compare_figure("output_throughput", "maximize", [100.0], [96.0], floor_pct=5)
    assert row.moved == "within noise"
    assert row.change_pct == pytest.approx(-4.0)
    assert row.noise == pytest.approx(5.0) and row.noise_pct == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("figure", "direction", "now", "moved"),
    [
        ("capacity_rps", "maximize", [0.80, 0.81, 0.79], "worse"),
        ("capacity_rps", "maximize", [1.20, 1.25], "better"),
        ("p95_ttft_ms", "minimize", [1.20, 1.25], "worse"),
        ("p95_ttft_ms", "minimize", [0.80, 0.81, 0.79], "better"),
    ],
)
def test_the_direction_says_which_way_is_worse(
    figure: str, direction: str, now: list[float], moved: str
) -> None:
    assert compare_figure(figure, direction, [1.0], now, floor_pct=5).moved == moved


def test_the_spread_of_the_runs_now_widens_the_band() -> None:
    # Median 1.1 is +10% over 1.0, but the runs now scatter by far more than that.
    row = compare_figure("output_throughput", "maximize", [1.0], [0.6, 1.1, 1.6], floor_pct=5)
    assert row.moved == "within noise"
    assert row.noise == pytest.approx(1.0)  # twice the median absolute deviation (0.5)


def test_the_recorded_spread_widens_the_band() -> None:
    recorded = [1.0, 1.2, 0.8]  # re-validation runs of the study's configuration
    assert compare_figure("capacity_rps", "maximize", recorded, [0.85]).moved == "within noise"
    assert compare_figure("capacity_rps", "maximize", recorded, [0.55]).moved == "worse"


def test_one_disturbed_recorded_run_does_not_hide_a_regression() -> None:
    # The CPU study's re-validations: one run measured capacity 0 while the machine was busy.
    # The range of the recorded runs would reach 0 and no drop could ever clear it.
    recorded = [1.065, 0.0, 0.821, 0.976, 1.065, 0.976]
    row = compare_figure("capacity_rps", "maximize", recorded, [0.6], floor_pct=9.05)
    assert row.recorded == pytest.approx(0.976)
    assert row.noise == pytest.approx(2 * 0.089, abs=1e-3)
    assert row.moved == "worse"
    assert compare_figure("capacity_rps", "maximize", recorded, [0.9]).moved == "within noise"


def test_figures_recorded_as_zero() -> None:
    assert compare_figure("capacity_rps", "maximize", [0.0, 0.0], [0.0]).moved == "within noise"
    up = compare_figure("capacity_rps", "maximize", [0.0], [0.3])
    assert up.moved == "better" and math.isnan(up.change_pct) and math.isnan(up.noise_pct)
    # The error rate has an absolute floor of one point: a stray failure is not a regression.
    assert compare_figure("error_rate", "minimize", [0.0], [0.005]).moved == "within noise"
    assert compare_figure("error_rate", "minimize", [0.0], [0.05]).moved == "worse"


def test_nothing_to_compare_is_not_a_verdict() -> None:
    assert compare_figure("nominal_p95_ttft_ms", "minimize", [math.nan], [900.0]).moved == "n/a"
    assert compare_figure("p95_ttft_ms", "minimize", [900.0], []).moved == "n/a"
    row = compare_figure("p95_ttft_ms", "minimize", [900.0, math.nan], [930.0])
    assert row.recorded_runs == (900.0,) and row.moved == "within noise"


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="direction"):
        compare_figure("x", "up", [1.0], [1.0])
    with pytest.raises(ValueError, match="floor"):
        compare_figure("x", "maximize", [1.0], [1.0], floor_pct=-1)


def test_noise_band_takes_the_largest_source() -> None:
    assert noise_band([10.0], [10.0], floor_pct=5) == pytest.approx(0.5)
    assert noise_band([10.0], [10.0], floor_pct=5, abs_floor=2) == pytest.approx(2.0)
    assert noise_band([10.0, 14.0], [10.0], floor_pct=5) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("recorded", "now", "moved"),
    [
        (True, [False, False], "worse"),
        (True, [True, False], "within noise"),
        (True, [True], "within noise"),
        (False, [True, True], "better"),
        (False, [False], "within noise"),
        (None, [True], "n/a"),
        (True, [], "n/a"),
    ],
)
def test_the_slo_row(recorded: bool | None, now: list[bool], moved: str) -> None:
    assert compare_slos(recorded, now).moved == moved


def _config(label: str, now: list[float], *, failures: tuple[str, ...] = ()) -> ConfigComparison:
    rows = (compare_figure("capacity_rps", "maximize", [1.0], now),)
    return ConfigComparison(
        label,
        3,
        rows,
        compare_slos(True, [True] * len(now)),
        runs=len(now) + len(failures),
        failures=failures,
    )


def test_verdict_names_what_moved_for_the_worse() -> None:
    line, worse = verdict([_config("chosen", [1.01, 0.99]), _config("baseline", [1.0])])
    assert worse == [] and line.startswith("no figure moved beyond the noise for the worse")
    line, worse = verdict([_config("chosen", [0.7, 0.72]), _config("baseline", [1.3])])
    assert line.startswith("REGRESSION: 1 figure")
    assert worse == ["chosen capacity_rps: 1 -> 0.71 (-29.0%, noise ±5.0%)"]
    assert _config("baseline", [1.3]).better() == [
        "baseline capacity_rps: 1 -> 1.3 (+30.0%, noise ±5.0%)"
    ]


def test_a_configuration_that_no_longer_runs_is_a_regression() -> None:
    gone = _config("chosen", [], failures=("run 1: failed (oom)", "run 2: failed (oom)"))
    assert gone.no_longer_runs
    _, worse = verdict([gone])
    assert worse == ["chosen: no run served now (run 1: failed (oom))"]
    doc = gone.doc()
    assert doc["figures"][0]["moved"] == "n/a" and doc["figures"][0]["now"] is None
    some = _config("chosen", [1.0], failures=("run 2: failed (oom)",))
    assert not some.no_longer_runs and verdict([some])[1] == []


def test_a_configuration_never_measured_for_the_clients_fault_is_not_a_pass() -> None:
    blind = _config("chosen", [])
    blind = ConfigComparison(
        "chosen",
        3,
        blind.figures,
        blind.slos,
        runs=2,
        unscored=("run 1: invalid_replay", "run 2: invalid_replay"),
    )
    assert blind.not_measured and not blind.no_longer_runs and blind.measured == 0
    line, worse = verdict([blind, _config("baseline", [1.0])])
    assert worse == [] and line.startswith("NOT MEASURED: no replay of chosen kept its schedule")
