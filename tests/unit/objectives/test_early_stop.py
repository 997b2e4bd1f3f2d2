"""Tests for objectives.early_stop: exact boundaries, in-flight lower bounds, error rate."""

from __future__ import annotations

import numpy as np
import pytest

from objectives import (
    EarlyStopper,
    Observations,
    decidable,
    hopeless,
    misses_to_break,
    parse_slo,
    summarize,
)
from optimizer.types import RequestRecord

P95_TTFT = parse_slo("p95_ttft_ms<=500")


def _ttft(misses: int, hits: int = 0, value: float = 501.0) -> Observations:
    return Observations(ttft_ms=[value] * misses + [100.0] * hits)


class TestMissesToBreak:
    def test_p95_of_100(self) -> None:
        # "more than 5% of 100": the sixth miss decides it.
        assert misses_to_break(95, 100) == 6

    def test_no_samples(self) -> None:
        assert misses_to_break(95, 0) == 0

    @pytest.mark.parametrize("percentile", [50, 90, 95, 99, 99.9])
    @pytest.mark.parametrize("m", [1, 2, 3, 7, 10, 20, 21, 99, 100, 101, 1000])
    def test_agrees_with_numpy(self, percentile: float, m: int) -> None:
        threshold = 500.0
        needed = misses_to_break(percentile, m)
        assert 1 <= needed <= m
        # At `needed` misses the percentile exceeds T even with the misses barely above it
        # and every other sample at 0 ...
        low = [0.0] * (m - needed) + [threshold + 1e-6] * needed
        assert np.percentile(low, percentile) > threshold
        # ... and one fewer miss leaves a sample set whose percentile still meets T.
        fewer = needed - 1
        ok = [0.0] * (m - fewer) + [threshold + 1e-6] * fewer
        assert np.percentile(ok, percentile) <= threshold


class TestPercentileSlo:
    def test_boundary_and_one_past(self) -> None:
        stopper = EarlyStopper([P95_TTFT], expected=100)
        assert stopper.check(_ttft(5, hits=50)) is None
        reason = stopper.check(_ttft(6, hits=50))
        assert reason is not None
        assert "p95_ttft_ms<=500" in reason and "6 of at most 100" in reason

    def test_value_equal_to_threshold_is_not_a_miss(self) -> None:
        stopper = EarlyStopper([P95_TTFT], expected=100)
        assert stopper.check(_ttft(50, value=500.0)) is None

    def test_strict_bound_counts_equality(self) -> None:
        stopper = EarlyStopper([parse_slo("p95_ttft_ms<500")], expected=100)
        assert stopper.check(_ttft(5, value=500.0)) is None
        assert stopper.check(_ttft(6, value=500.0)) is not None

    def test_waiting_requests_count_for_ttft(self) -> None:
        stopper = EarlyStopper([P95_TTFT], expected=100)
        obs = Observations(ttft_ms=[900.0] * 3, waiting_ms=[501.0, 600.0, 499.0])
        assert stopper.check(obs) is None  # 5 certain misses
        obs = Observations(ttft_ms=[900.0] * 3, waiting_ms=[501.0, 600.0, 700.0])
        assert stopper.check(obs) is not None  # 6

    def test_streaming_requests_do_not_count_for_ttft(self) -> None:
        stopper = EarlyStopper([P95_TTFT], expected=100)
        assert stopper.check(Observations(in_flight_ms=[10_000.0] * 50)) is None

    def test_e2el_uses_every_in_flight_request(self) -> None:
        stopper = EarlyStopper([parse_slo("p90_e2el_ms<=2000")], expected=20)
        # 20 samples: floor(0.9 * 19) = 17, so 3 misses decide it.
        assert misses_to_break(90, 20) == 3
        obs = Observations(e2el_ms=[2500.0], waiting_ms=[2100.0], in_flight_ms=[1999.0])
        assert stopper.check(obs) is None
        obs = Observations(e2el_ms=[2500.0], waiting_ms=[2100.0], in_flight_ms=[2001.0])
        assert stopper.check(obs) is not None

    def test_tpot_only_from_completed(self) -> None:
        stopper = EarlyStopper([parse_slo("median_tpot_ms<=50")], expected=10)
        # median of 10: floor(0.5 * 9) = 4, 6 misses decide it.
        assert stopper.check(Observations(tpot_ms=[60.0] * 5, waiting_ms=[1e9] * 5)) is None
        assert stopper.check(Observations(tpot_ms=[60.0] * 6)) is not None

    def test_failures_shrink_the_sample(self) -> None:
        # Percentiles are over successful requests: 10 failures leave at most 90.
        stopper = EarlyStopper([parse_slo("p90_ttft_ms<=500")], expected=100)
        assert (misses_to_break(90, 100), misses_to_break(90, 90)) == (11, 10)
        assert stopper.check(Observations(ttft_ms=[501.0] * 10)) is None
        assert stopper.check(Observations(ttft_ms=[501.0] * 9, failed=10)) is None
        assert stopper.check(Observations(ttft_ms=[501.0] * 10, failed=10)) is not None

    def test_everything_failed_is_left_to_error_rate(self) -> None:
        assert EarlyStopper([P95_TTFT], expected=5).check(Observations(failed=5)) is None


class TestCountSlos:
    def test_error_rate_boundary(self) -> None:
        stopper = EarlyStopper([parse_slo("error_rate<=0.05")], expected=100)
        assert stopper.check(Observations(failed=5)) is None
        reason = stopper.check(Observations(failed=6))
        assert reason is not None and "6 of 100" in reason

    def test_error_rate_strict(self) -> None:
        stopper = EarlyStopper([parse_slo("error_rate<0.05")], expected=100)
        assert stopper.check(Observations(failed=4)) is None
        assert stopper.check(Observations(failed=5)) is not None

    def test_zero_errors_allowed(self) -> None:
        stopper = EarlyStopper([parse_slo("error_rate<=0")], expected=10)
        assert stopper.check(Observations()) is None
        assert stopper.check(Observations(failed=1)) is not None

    def test_failed_count(self) -> None:
        stopper = EarlyStopper([parse_slo("failed<=2")], expected=10)
        assert stopper.check(Observations(failed=2)) is None
        assert stopper.check(Observations(failed=3)) is not None

    def test_completed(self) -> None:
        stopper = EarlyStopper([parse_slo("completed>=95")], expected=100)
        assert stopper.check(Observations(failed=5)) is None
        assert stopper.check(Observations(failed=6)) is not None


class TestUndecidable:
    @pytest.mark.parametrize(
        "text",
        [
            "mean_ttft_ms<=500",
            "output_throughput>=100",
            "p95_itl_ms<=20",
            "p95_ttft_ms>=1",
            "std_tpot_ms<=5",
            "request_goodput>=1",
        ],
    )
    def test_ignored(self, text: str) -> None:
        slo = parse_slo(text)
        assert not decidable(slo)
        stopper = EarlyStopper([slo], expected=10)
        assert not stopper.active()
        worst = Observations(ttft_ms=[1e9] * 10, tpot_ms=[1e9] * 10, e2el_ms=[1e9] * 10)
        assert stopper.check(worst) is None

    def test_active(self) -> None:
        assert EarlyStopper([P95_TTFT], expected=10).active()
        assert not EarlyStopper([P95_TTFT], expected=0).active()

    def test_negative_expected(self) -> None:
        with pytest.raises(ValueError, match="expected"):
            EarlyStopper([P95_TTFT], expected=-1)


def test_hopeless_reports_first_broken_slo() -> None:
    slos = [parse_slo("error_rate<=0.5"), P95_TTFT, parse_slo("p95_tpot_ms<=10")]
    obs = Observations(ttft_ms=[501.0] * 6, tpot_ms=[11.0] * 6)
    reason = hopeless(slos, 100, obs)
    assert reason is not None and reason.startswith("p95_ttft_ms<=500")
    assert hopeless(slos, 100, Observations()) is None


def _record(
    index: int, ttft_s: float, *, warmup: bool = False, error: str | None = None
) -> RequestRecord:
    sent = float(index)
    return RequestRecord(
        index=index,
        scheduled_s=sent,
        sent_s=sent,
        first_token_s=None if error else sent + ttft_s,
        chunk_times_s=() if error else (sent + ttft_s, sent + ttft_s + 0.1),
        end_s=sent + ttft_s + 0.1,
        input_tokens=10,
        output_tokens=2,
        error=error,
        warmup=warmup,
    )


class TestFromRecords:
    def test_matches_summarize_definitions(self) -> None:
        records = [
            _record(0, 5.0, warmup=True),
            _record(1, 0.2),
            _record(2, 0.3),
            _record(3, 0.0, error="boom"),
        ]
        obs = Observations.from_records(
            records, now_s=10.0, in_flight_sent_s=[9.0], waiting_sent_s=[9.5]
        )
        assert obs.failed == 1
        assert obs.ttft_ms == pytest.approx([200.0, 300.0])
        assert obs.tpot_ms == pytest.approx([100.0, 100.0])
        assert obs.e2el_ms == pytest.approx([300.0, 400.0])
        assert obs.waiting_ms == pytest.approx([500.0])
        assert obs.in_flight_ms == pytest.approx([1000.0])
        summary = summarize(records)
        assert summary["mean_ttft_ms"] == pytest.approx(np.mean(obs.ttft_ms))
        assert summary["mean_e2el_ms"] == pytest.approx(np.mean(obs.e2el_ms))
        assert summary["failed"] == obs.failed

    def test_final_decision_agrees_with_summary(self) -> None:
        # When the replay is over and the stopper says hopeless, the summary misses the SLO.
        records = [_record(i, 0.6 if i < 6 else 0.1) for i in range(100)]
        obs = Observations.from_records(records, now_s=200.0)
        assert EarlyStopper([P95_TTFT], expected=100).check(obs) is not None
        assert not P95_TTFT.met(summarize(records))
        records_ok = [_record(i, 0.6 if i < 5 else 0.1) for i in range(100)]
        obs_ok = Observations.from_records(records_ok, now_s=200.0)
        assert EarlyStopper([P95_TTFT], expected=100).check(obs_ok) is None
