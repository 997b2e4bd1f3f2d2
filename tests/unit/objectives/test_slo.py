"""Tests for objectives.slo: parsing, validation, met() and the sign of margin()."""

from __future__ import annotations

import math

import pytest

from objectives import UNMEASURED_MARGIN, Slo, SloError, is_summary_key, parse_slo, summarize
from optimizer.errors import ConfigError


class TestParse:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("p95_ttft_ms<=500", Slo("p95_ttft_ms", "<=", 500.0)),
            ("mean_tpot_ms < 50", Slo("mean_tpot_ms", "<", 50.0)),
            ("  output_throughput>=1e3 ", Slo("output_throughput", ">=", 1000.0)),
            ("request_goodput>0.5", Slo("request_goodput", ">", 0.5)),
            ("p99.9_itl_ms<=.25", Slo("p99.9_itl_ms", "<=", 0.25)),
            ("error_rate<=0", Slo("error_rate", "<=", 0.0)),
            ("p99_send_lag_ms<=20", Slo("p99_send_lag_ms", "<=", 20.0)),
            ("max_send_lag_ms<=100", Slo("max_send_lag_ms", "<=", 100.0)),
            ("p95_ttft_from_scheduled_ms<=800", Slo("p95_ttft_from_scheduled_ms", "<=", 800.0)),
        ],
    )
    def test_valid(self, text: str, expected: Slo) -> None:
        assert parse_slo(text) == expected

    def test_str_round_trips(self) -> None:
        for text in ("p95_ttft_ms<=500", "output_throughput>=1234.5", "mean_tpot_ms<0.25"):
            assert str(parse_slo(text)) == text
            assert parse_slo(str(parse_slo(text))) == parse_slo(text)

    @pytest.mark.parametrize(
        "text",
        [
            "",
            "p95_ttft_ms",
            "p95_ttft_ms=500",
            "p95_ttft_ms==500",
            "p95_ttft_ms=<500",
            "p95_ttft_ms<=500ms",
            "p95_ttft_ms<=",
            "<=500",
            "p95_ttft_ms<=nan",
            "p95_ttft_ms<=inf",
            "p95_ttft_ms<=1e999",
            "p95_ttft<=500",
            "ttft_ms<=500",
            "ttft:500",
            "p101_ttft_ms<=500",
            "p95_TTFT_ms<=500",
            "throughput>=10",
        ],
    )
    def test_invalid_names_the_string_and_forms(self, text: str) -> None:
        with pytest.raises(SloError) as excinfo:
            parse_slo(text)
        message = str(excinfo.value)
        assert "<=, <, >=, >" in message
        assert "p95_ttft_ms" in message
        assert repr(text) in message

    def test_error_is_a_config_error_and_a_value_error(self) -> None:
        with pytest.raises(ConfigError):
            parse_slo("nonsense")
        with pytest.raises(ValueError):
            parse_slo("nonsense")

    def test_hint_for_bare_per_request_metric(self) -> None:
        with pytest.raises(SloError, match="did you mean p95_ttft_ms"):
            parse_slo("ttft_ms<=500")

    def test_direct_construction_is_validated(self) -> None:
        with pytest.raises(SloError, match="operator"):
            Slo("p95_ttft_ms", "==", 1.0)
        with pytest.raises(SloError, match="metric"):
            Slo("p95_bogus_ms", "<=", 1.0)
        with pytest.raises(SloError, match="finite"):
            Slo("p95_ttft_ms", "<=", math.nan)

    def test_every_summary_key_is_accepted(self) -> None:
        slo = parse_slo("p95_ttft_ms<=500")
        for key in summarize([], slos=[slo], percentiles=(50, 99.9)):
            assert is_summary_key(key), key
            parse_slo(f"{key}<=1")


class TestPerRequestMetric:
    @pytest.mark.parametrize(
        ("metric", "expected"),
        [
            ("p95_ttft_ms", "ttft_ms"),
            ("mean_ttft_ms", "ttft_ms"),
            ("median_tpot_ms", "tpot_ms"),
            ("p99.9_e2el_ms", "e2el_ms"),
            ("p50_ttft_from_scheduled_ms", "ttft_from_scheduled_ms"),
            ("std_ttft_ms", None),
            ("p99_itl_ms", None),
            ("p99_send_lag_ms", None),
            ("max_send_lag_ms", None),
            ("output_throughput", None),
            ("error_rate", None),
        ],
    )
    def test_mapping(self, metric: str, expected: str | None) -> None:
        assert Slo(metric, "<=", 1.0).per_request_metric == expected


class TestMarginAndMet:
    @pytest.mark.parametrize(
        ("text", "value", "met"),
        [
            ("p95_ttft_ms<=500", 400.0, True),
            ("p95_ttft_ms<=500", 500.0, True),
            ("p95_ttft_ms<=500", 600.0, False),
            ("p95_ttft_ms<500", 400.0, True),
            ("p95_ttft_ms<500", 500.0, False),
            ("p95_ttft_ms<500", 600.0, False),
            ("output_throughput>=1000", 1200.0, True),
            ("output_throughput>=1000", 1000.0, True),
            ("output_throughput>=1000", 800.0, False),
            ("output_throughput>1000", 1000.0, False),
            ("output_throughput>1000", 1001.0, True),
            ("error_rate<=0", 0.0, True),
            ("error_rate<=0", 0.01, False),
            ("error_rate<0", 0.0, False),
        ],
    )
    def test_sign_agrees_with_met(self, text: str, value: float, met: bool) -> None:
        slo = parse_slo(text)
        summary = {slo.metric: value}
        assert slo.met(summary) is met
        margin = slo.margin(summary)
        assert (margin <= 0) is met
        assert math.isfinite(margin)

    def test_margin_is_relative(self) -> None:
        assert parse_slo("p95_ttft_ms<=500").margin({"p95_ttft_ms": 750.0}) == 0.5
        assert parse_slo("p95_ttft_ms<=500").margin({"p95_ttft_ms": 250.0}) == -0.5
        assert parse_slo("output_throughput>=1000").margin({"output_throughput": 500.0}) == 0.5
        assert parse_slo("output_throughput>=1000").margin({"output_throughput": 2000.0}) == -1.0
        # Zero threshold: the absolute excess.
        assert parse_slo("error_rate<=0").margin({"error_rate": 0.25}) == 0.25
        # Negative threshold keeps the sign right.
        assert parse_slo("p50_send_lag_ms>=-10").margin({"p50_send_lag_ms": -20.0}) == 1.0

    def test_nan_is_not_met(self) -> None:
        slo = parse_slo("p95_ttft_ms<=500")
        assert not slo.met({"p95_ttft_ms": math.nan})
        assert slo.margin({"p95_ttft_ms": math.nan}) == UNMEASURED_MARGIN > 0
        assert not parse_slo("output_throughput>=0").met({"output_throughput": math.nan})

    def test_all_failed_summary_violates_latency_slos(self) -> None:
        summary = summarize([])
        slo = parse_slo("p95_ttft_ms<=500")
        assert not slo.met(summary)
        assert slo.margin(summary) > 0

    def test_missing_key_raises_with_advice(self) -> None:
        slo = parse_slo("p97_ttft_ms<=500")
        with pytest.raises(KeyError, match="p97_ttft_ms"):
            slo.margin(summarize([]))
        with pytest.raises(KeyError):
            slo.met({})

    def test_holds(self) -> None:
        slo = parse_slo("p95_ttft_ms<=500")
        assert slo.holds(500.0)
        assert not slo.holds(500.1)
        assert not slo.holds(math.nan)

    def test_frozen_and_hashable(self) -> None:
        slo = parse_slo("p95_ttft_ms<=500")
        with pytest.raises(AttributeError):
            slo.threshold = 1.0  # type: ignore[misc]
        assert len({slo, parse_slo("p95_ttft_ms <= 500")}) == 1
