"""Tests for objectives.presets: parsing, presets, NaN to worst case, constraint signs."""

from __future__ import annotations

import math

import pytest

from objectives import (
    FAILED_CONSTRAINT,
    OBJECTIVE_PRESETS,
    WORST_MINIMIZE,
    Objective,
    ObjectiveError,
    ObjectiveSet,
    SloError,
    load_objectives,
    parse_objective,
    parse_slo,
)
from optimizer.errors import ConfigError

SUMMARY = {
    "p95_ttft_ms": 400.0,
    "p95_tpot_ms": 60.0,
    "p99_ttft_ms": 900.0,
    "output_throughput": 1500.0,
    "request_goodput": 3.0,
    "error_rate": 0.0,
}


class TestParse:
    @pytest.mark.parametrize(
        ("text", "metric", "direction"),
        [
            ("min:p95_ttft_ms", "p95_ttft_ms", "minimize"),
            ("max:output_throughput", "output_throughput", "maximize"),
            (" minimize : p99.9_itl_ms ", "p99.9_itl_ms", "minimize"),
            ("MAX:request_goodput", "request_goodput", "maximize"),
        ],
    )
    def test_valid(self, text: str, metric: str, direction: str) -> None:
        objective = parse_objective(text)
        assert (objective.metric, objective.direction) == (metric, direction)

    @pytest.mark.parametrize(
        ("text", "pattern"),
        [
            ("p95_ttft_ms", "write min:METRIC or max:METRIC"),
            ("least:p95_ttft_ms", "direction 'least' is not min or max"),
            ("min:p95_ttft", r"did you mean 'p95_ttft_ms'\?.*output_throughput"),
            ("max:throughput", "did you mean 'output_throughput'"),
            ("max:p95_ttft_ms", "write min:p95_ttft_ms"),
            ("min:output_throughput", "write max:output_throughput"),
        ],
    )
    def test_invalid(self, text: str, pattern: str) -> None:
        with pytest.raises(ObjectiveError, match=pattern):
            parse_objective(text)

    def test_error_is_config_error(self) -> None:
        with pytest.raises(ConfigError):
            parse_objective("min:nothing")


class TestObjective:
    def test_default_worst(self) -> None:
        assert Objective("p95_ttft_ms", "minimize").worst == WORST_MINIMIZE
        assert Objective("error_rate", "minimize").worst == 1.0
        assert Objective("output_throughput", "maximize").worst == 0.0
        assert Objective("p95_ttft_ms", "minimize", worst=5e4).worst == 5e4

    def test_nan_and_inf_become_worst(self) -> None:
        ttft = Objective("p95_ttft_ms", "minimize")
        assert ttft.value({"p95_ttft_ms": math.nan}) == WORST_MINIMIZE
        assert ttft.value({"p95_ttft_ms": math.inf}) == WORST_MINIMIZE
        assert ttft.value({"p95_ttft_ms": 12.5}) == 12.5

    def test_missing_key_names_it(self) -> None:
        with pytest.raises(KeyError, match="p95_ttft_ms"):
            Objective("p95_ttft_ms", "minimize").value({})

    def test_invalid_direction(self) -> None:
        with pytest.raises(ObjectiveError, match="'minimize' or 'maximize'"):
            Objective("p95_ttft_ms", "lower")  # type: ignore[arg-type]

    def test_non_finite_worst(self) -> None:
        with pytest.raises(ObjectiveError, match="finite"):
            Objective("p95_ttft_ms", "minimize", worst=math.inf)


class TestPresets:
    def test_default(self) -> None:
        objectives = load_objectives(None, None, [])
        assert objectives.metrics == ["p95_ttft_ms", "p95_tpot_ms", "output_throughput"]
        assert objectives.directions == ["minimize", "minimize", "maximize"]

    @pytest.mark.parametrize(
        ("preset", "metrics"),
        [
            ("latency", ["p95_ttft_ms", "p95_tpot_ms"]),
            ("throughput", ["output_throughput", "p95_ttft_ms"]),
            ("goodput", ["request_goodput"]),
        ],
    )
    def test_named(self, preset: str, metrics: list[str]) -> None:
        assert load_objectives(preset, None, ["p95_ttft_ms<=500"]).metrics == metrics

    def test_every_preset_loads(self) -> None:
        for name in OBJECTIVE_PRESETS:
            assert load_objectives(name, None, ["p95_ttft_ms<=500"]).objectives

    def test_unknown_preset(self) -> None:
        with pytest.raises(ObjectiveError, match="did you mean 'latency'"):
            load_objectives("latncy", None, [])

    def test_explicit_objectives_win(self) -> None:
        objectives = load_objectives("goodput", ["min:p99_ttft_ms"], [])
        assert objectives.metrics == ["p99_ttft_ms"]

    def test_goodput_needs_slos(self) -> None:
        with pytest.raises(ObjectiveError, match="no SLO is given"):
            load_objectives("goodput", None, [])

    def test_bad_slo(self) -> None:
        with pytest.raises(SloError):
            load_objectives(None, None, ["p95_ttft<=5"])

    def test_repeated_metric(self) -> None:
        with pytest.raises(ObjectiveError, match="listed twice"):
            load_objectives(None, ["min:p95_ttft_ms", "min:p95_ttft_ms"], [])

    def test_empty(self) -> None:
        with pytest.raises(ObjectiveError, match="at least one objective"):
            ObjectiveSet(objectives=())


class TestObjectiveSet:
    def test_values_replace_nan(self) -> None:
        objectives = load_objectives("default", None, [])
        summary = {**SUMMARY, "p95_tpot_ms": math.nan, "output_throughput": math.nan}
        assert objectives.values(summary) == [400.0, WORST_MINIMIZE, 0.0]
        assert not any(math.isnan(v) for v in objectives.values(summary))

    def test_worst(self) -> None:
        assert load_objectives("default", None, []).worst() == [WORST_MINIMIZE, WORST_MINIMIZE, 0.0]

    def test_constraint_signs(self) -> None:
        objectives = load_objectives(
            "latency", None, ["p95_ttft_ms<=500", "p95_tpot_ms<=50", "output_throughput>=1500"]
        )
        met_ttft, missed_tpot, met_exactly = objectives.constraints(SUMMARY)
        assert met_ttft < 0
        assert missed_tpot > 0
        assert met_exactly == 0.0
        assert missed_tpot == pytest.approx(0.2)

    def test_constraint_of_nan_is_violated(self) -> None:
        objectives = load_objectives("latency", None, ["p95_ttft_ms<=500"])
        assert objectives.constraints({"p95_ttft_ms": math.nan}) == [pytest.approx(1e6)]

    def test_failed_constraints_all_positive(self) -> None:
        objectives = load_objectives("latency", None, ["p95_ttft_ms<=500", "error_rate<=0.01"])
        assert objectives.failed_constraints() == [FAILED_CONSTRAINT, FAILED_CONSTRAINT]
        assert all(v > 0 for v in objectives.failed_constraints())

    def test_no_slos_no_constraints(self) -> None:
        objectives = load_objectives("default", None, [])
        assert objectives.constraints(SUMMARY) == []
        assert objectives.failed_constraints() == []

    def test_percentiles_cover_objectives_and_slos(self) -> None:
        objectives = load_objectives(None, ["min:p99.9_ttft_ms"], ["p75_tpot_ms<=40"])
        percentiles = objectives.percentiles()
        assert {50, 90, 95, 99, 99.9, 75} <= set(percentiles)
        assert list(percentiles) == sorted(percentiles)

    def test_slos_parsed(self) -> None:
        objectives = load_objectives(None, None, ["p95_ttft_ms<=500"])
        assert objectives.slos == (parse_slo("p95_ttft_ms<=500"),)


def test_capacity_presets_need_slos_and_mark_the_set_as_capacity() -> None:
    from objectives import load_objectives

    cap = load_objectives("capacity", None, ["p95_ttft_ms<=500"])
    assert cap.is_capacity and cap.metrics == ["capacity_rps"]
    assert cap.directions == ["maximize"]
    lat = load_objectives("capacity-latency", None, ["p95_ttft_ms<=500"])
    assert lat.metrics == ["capacity_rps", "nominal_p95_ttft_ms", "nominal_p95_tpot_ms"]
    assert lat.directions == ["maximize", "minimize", "minimize"]
    # An unmeasured nominal latency (its step stopped early) is told its worst case.
    assert lat.values(
        {"capacity_rps": 2.0, "nominal_p95_ttft_ms": float("nan"), "nominal_p95_tpot_ms": 30.0}
    ) == [2.0, 1e9, 30.0]
    assert not load_objectives("default", None, []).is_capacity
    with pytest.raises(ObjectiveError, match="no SLO"):
        load_objectives("capacity", None, [])
    # Without a bound on waiting (TTFT / E2EL) a queueing server meets TPOT at any load.
    with pytest.raises(ObjectiveError, match="bounds the time a request waits"):
        load_objectives("capacity", None, ["p95_tpot_ms<=250", "error_rate<=0.01"])
    assert load_objectives("capacity", None, ["p99_e2el_ms<=9000"]).is_capacity
