"""Tests for objectives.metrics: exact values on hand-built records, then invariants."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from objectives import DEFAULT_PERCENTILES, LATENCY_METRICS, parse_slo, percentile_key, summarize
from optimizer.types import RequestRecord

# Times are multiples of 1/4 s so every expected value below is exact in binary floating point.


def rec(
    index: int,
    *,
    scheduled_s: float,
    sent_s: float,
    chunks_s: tuple[float, ...],
    end_s: float | None = None,
    output_tokens: int | None = None,
    input_tokens: int = 10,
    error: str | None = None,
    warmup: bool = False,
    first_token_s: float | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        scheduled_s=scheduled_s,
        sent_s=sent_s,
        first_token_s=first_token_s if first_token_s is not None or not chunks_s else chunks_s[0],
        chunk_times_s=chunks_s,
        end_s=end_s if end_s is not None else (chunks_s[-1] if chunks_s else sent_s),
        input_tokens=input_tokens,
        output_tokens=output_tokens if output_tokens is not None else len(chunks_s),
        error=error,
        warmup=warmup,
    )


# A: on time; TTFT 250 ms, E2EL 1000 ms, TPOT 375 ms, ITL 250 and 500 ms.
A = rec(0, scheduled_s=0.0, sent_s=0.0, chunks_s=(0.25, 0.5, 1.0), input_tokens=10)
# B: sent 500 ms late; TTFT 500 ms (1000 from scheduled), E2EL 1000 ms (the usage chunk at
# 2.75 s is not a token), TPOT 500 ms, ITL 500 ms.
B = rec(1, scheduled_s=1.0, sent_s=1.5, chunks_s=(2.0, 2.5), end_s=2.75, input_tokens=20)
# C: failed after 2 s without a token.
C = rec(2, scheduled_s=2.0, sent_s=2.0, chunks_s=(), end_s=4.0, input_tokens=30, error="timeout")
# W: warm-up, far outside the measured window; must change nothing.
W = rec(3, scheduled_s=50.0, sent_s=60.0, chunks_s=(70.0, 99.0), end_s=100.0, warmup=True)
RECORDS = (A, B, C, W)


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-9)
        for k in a
    )


class TestExactValues:
    def test_counts_duration_and_throughput(self) -> None:
        s = summarize(RECORDS)
        assert s["completed"] == 2
        assert s["failed"] == 1
        assert s["error_rate"] == pytest.approx(1 / 3)
        assert s["total_input_tokens"] == 30  # failed requests' prompts do not count (vLLM)
        assert s["total_output_tokens"] == 5
        # First scheduled send (0 s) to the last completion (the failure, 4 s).
        assert s["duration_s"] == 4.0
        assert s["request_throughput"] == 0.5
        assert s["output_throughput"] == 1.25
        assert s["total_token_throughput"] == 35 / 4

    def test_ttft(self) -> None:
        s = summarize(RECORDS)
        assert s["mean_ttft_ms"] == 375.0
        assert s["median_ttft_ms"] == 375.0
        assert s["std_ttft_ms"] == 125.0
        assert s["p50_ttft_ms"] == 375.0
        assert s["p90_ttft_ms"] == 475.0
        assert s["p99_ttft_ms"] == pytest.approx(497.5)

    def test_ttft_from_scheduled_shows_client_lag(self) -> None:
        s = summarize(RECORDS)
        assert s["mean_ttft_from_scheduled_ms"] == 625.0  # (250 + 1000) / 2
        assert s["p95_ttft_from_scheduled_ms"] == pytest.approx(250 + 0.95 * 750)
        assert s["mean_ttft_from_scheduled_ms"] > s["mean_ttft_ms"]

    def test_tpot_excludes_first_token(self) -> None:
        s = summarize(RECORDS)
        assert s["mean_tpot_ms"] == 437.5  # (375 + 500) / 2
        assert s["median_tpot_ms"] == 437.5
        assert s["std_tpot_ms"] == 62.5

    def test_itl_pooled(self) -> None:
        s = summarize(RECORDS)
        # Gaps 250, 500 (A) and 500 (B), pooled rather than averaged per request.
        assert s["mean_itl_ms"] == pytest.approx(1250 / 3)
        assert s["median_itl_ms"] == 500.0
        assert s["p50_itl_ms"] == 500.0

    def test_e2el_ends_at_last_token_chunk(self) -> None:
        s = summarize(RECORDS)
        assert s["mean_e2el_ms"] == 1000.0
        assert s["std_e2el_ms"] == 0.0

    def test_e2el_falls_back_to_end_without_chunks(self) -> None:
        r = rec(
            0,
            scheduled_s=0.0,
            sent_s=0.0,
            chunks_s=(),
            first_token_s=0.5,
            end_s=2.0,
            output_tokens=5,
        )
        s = summarize([r])
        assert s["mean_e2el_ms"] == 2000.0
        assert s["mean_ttft_ms"] == 500.0
        assert s["mean_tpot_ms"] == 375.0
        assert math.isnan(s["mean_itl_ms"])

    def test_send_lag_includes_failed_requests(self) -> None:
        s = summarize(RECORDS)
        lags_ms = [0.0, 500.0, 0.0]
        assert s["mean_send_lag_ms"] == pytest.approx(500 / 3)
        assert s["max_send_lag_ms"] == 500.0
        assert s["p50_send_lag_ms"] == 0.0
        assert s["p99_send_lag_ms"] == pytest.approx(float(np.percentile(lags_ms, 99)))
        assert s["p99_send_lag_ms"] == pytest.approx(490.0)

    def test_send_lag_always_has_p50_and_p99(self) -> None:
        s = summarize(RECORDS, percentiles=(90,))
        assert {"p50_send_lag_ms", "p90_send_lag_ms", "p99_send_lag_ms"} <= s.keys()
        assert "p99_ttft_ms" not in s
        assert "p90_ttft_ms" in s

    def test_warmup_records_excluded(self) -> None:
        assert same(summarize(RECORDS), summarize([A, B, C]))

    def test_single_output_token_has_no_tpot(self) -> None:
        one = rec(0, scheduled_s=0.0, sent_s=0.0, chunks_s=(0.5,))
        s = summarize([one])
        assert s["completed"] == 1
        assert s["mean_ttft_ms"] == 500.0
        assert math.isnan(s["mean_tpot_ms"])
        assert math.isnan(s["p99_tpot_ms"])
        assert math.isnan(s["mean_itl_ms"])
        # ... and it does not drag other requests' TPOT towards 0.
        assert summarize([one, A])["mean_tpot_ms"] == 375.0

    def test_ok_record_without_first_token_is_failed(self) -> None:
        silent = rec(0, scheduled_s=0.0, sent_s=0.0, chunks_s=(), end_s=1.0)
        s = summarize([silent, A])
        assert s["completed"] == 1
        assert s["failed"] == 1

    def test_failed_with_partial_stream_excluded_from_latency(self) -> None:
        broken = rec(
            5, scheduled_s=0.0, sent_s=0.0, chunks_s=(0.125, 3.0), error="error event in stream"
        )
        s = summarize([A, broken])
        assert s["failed"] == 1
        assert s["error_rate"] == 0.5
        assert s["mean_ttft_ms"] == 250.0
        assert s["mean_itl_ms"] == 375.0
        assert s["total_output_tokens"] == 3
        assert s["duration_s"] == 3.0  # the failure still took wall time

    def test_key_names_follow_vllm(self) -> None:
        s = summarize(RECORDS)
        for metric in LATENCY_METRICS:
            for stat in ("mean", "median", "std"):
                assert f"{stat}_{metric}_ms" in s
            for p in DEFAULT_PERCENTILES:
                assert percentile_key(p, metric) in s
        assert percentile_key(99.9, "itl") == "p99.9_itl_ms"
        assert percentile_key(95.0, "ttft") == "p95_ttft_ms"
        assert "p99.9_itl_ms" in summarize(RECORDS, percentiles=(99.9,))
        assert "request_goodput" not in s  # only with SLOs, as in vLLM
        assert all(isinstance(v, (int, float)) for v in s.values())

    def test_bad_percentile_raises(self) -> None:
        with pytest.raises(ValueError, match="percentile"):
            summarize(RECORDS, percentiles=(101,))


class TestGoodput:
    def test_ttft_slo(self) -> None:
        s = summarize(RECORDS, slos=[parse_slo("p95_ttft_ms<=300")])
        assert s["good_completed"] == 1  # A (250 ms); B has 500 ms
        assert s["request_goodput"] == 0.25

    def test_every_slo_must_hold(self) -> None:
        slos = [parse_slo("p95_ttft_ms<=600"), parse_slo("mean_tpot_ms<400")]
        s = summarize(RECORDS, slos=slos)
        assert s["good_completed"] == 1  # B misses TPOT (500 ms)
        slos = [parse_slo("p95_ttft_ms<=600"), parse_slo("p99_e2el_ms<=1000")]
        assert summarize(RECORDS, slos=slos)["good_completed"] == 2

    def test_ttft_from_scheduled_slo(self) -> None:
        s = summarize(RECORDS, slos=[parse_slo("p99_ttft_from_scheduled_ms<=500")])
        assert s["good_completed"] == 1  # B waited 1000 ms from its scheduled arrival

    def test_aggregate_slos_do_not_restrict_goodput(self) -> None:
        slos = [parse_slo("output_throughput>=1e9"), parse_slo("p99_itl_ms<=1")]
        s = summarize(RECORDS, slos=slos)
        assert s["good_completed"] == 2
        assert s["request_goodput"] == s["request_throughput"]

    def test_single_token_request_has_zero_tpot_for_goodput(self) -> None:
        one = rec(0, scheduled_s=0.0, sent_s=0.0, chunks_s=(0.5,))
        s = summarize([one], slos=[parse_slo("p99_tpot_ms<=1")])
        assert s["good_completed"] == 1

    def test_failed_requests_are_never_good(self) -> None:
        s = summarize([C], slos=[parse_slo("p99_ttft_ms<=1e9")])
        assert s["good_completed"] == 0
        assert s["request_goodput"] == 0.0


class TestDegenerateInputs:
    def test_empty(self) -> None:
        s = summarize([], slos=[parse_slo("p95_ttft_ms<=500")])
        assert s["completed"] == 0
        assert s["failed"] == 0
        assert s["duration_s"] == 0.0
        assert s["request_throughput"] == 0.0
        assert s["output_throughput"] == 0.0
        assert s["total_token_throughput"] == 0.0
        assert s["request_goodput"] == 0.0
        assert math.isnan(s["error_rate"])
        assert math.isnan(s["p95_ttft_ms"])
        assert math.isnan(s["max_send_lag_ms"])
        assert s.keys() == summarize(RECORDS, slos=[parse_slo("p95_ttft_ms<=500")]).keys()

    def test_only_warmup(self) -> None:
        assert same(summarize([W]), summarize([]))

    def test_all_failed(self) -> None:
        s = summarize([C, rec(9, scheduled_s=1.0, sent_s=1.25, chunks_s=(), error="500")])
        assert s["completed"] == 0
        assert s["failed"] == 2
        assert s["error_rate"] == 1.0
        assert s["duration_s"] == 3.0
        assert s["request_throughput"] == 0.0
        assert s["output_throughput"] == 0.0
        for metric in ("ttft", "tpot", "itl", "e2el", "ttft_from_scheduled"):
            assert math.isnan(s[f"mean_{metric}_ms"])
            assert math.isnan(s[f"p99_{metric}_ms"])
        assert s["max_send_lag_ms"] == 250.0  # the replayer's fidelity is still measured

    def test_zero_duration(self) -> None:
        instant = rec(0, scheduled_s=1.0, sent_s=1.0, chunks_s=(1.0,))
        s = summarize([instant])
        assert s["duration_s"] == 0.0
        assert s["request_throughput"] == 0.0
        assert s["mean_ttft_ms"] == 0.0


def _random_records(rng: random.Random, n: int) -> list[RequestRecord]:
    records = []
    for i in range(n):
        scheduled_s = rng.uniform(0, 60)
        sent_s = scheduled_s + rng.expovariate(200)
        output_tokens = rng.randint(1, 40)
        t = sent_s + rng.uniform(0.01, 2.0)
        chunks = [t]
        for _ in range(output_tokens - 1):
            t += rng.expovariate(30)
            chunks.append(t)
        kind = rng.random()
        error = None
        if kind < 0.1:
            error = "connect error"
            chunks = []
        elif kind < 0.2:
            error = "error event in stream"
            chunks = chunks[: rng.randint(1, len(chunks))]
        records.append(
            RequestRecord(
                index=i,
                scheduled_s=scheduled_s,
                sent_s=sent_s,
                first_token_s=chunks[0] if chunks else None,
                chunk_times_s=tuple(chunks),
                end_s=(chunks[-1] if chunks else sent_s) + rng.uniform(0, 0.01),
                input_tokens=rng.randint(1, 4000),
                output_tokens=output_tokens,
                error=error,
                warmup=rng.random() < 0.1,
            )
        )
    return records


@pytest.mark.parametrize("seed", range(25))
def test_invariants_on_random_records(seed: int) -> None:
    rng = random.Random(seed)
    records = _random_records(rng, rng.randint(0, 60))
    s = summarize(records)
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]

    assert s["completed"] == len(ok)
    assert s["completed"] + s["failed"] == len(measured)
    assert s["total_output_tokens"] == sum(r.output_tokens for r in ok)

    # Warm-up records change nothing; neither does the order of records.
    assert same(s, summarize(measured))
    shuffled = list(records)
    rng.shuffle(shuffled)
    assert same(s, summarize(shuffled))

    if not ok:
        assert math.isnan(s["mean_ttft_ms"])
        return

    # Per request: E2EL - TTFT == sum of its ITL gaps; with one chunk per token, TPOT is the
    # mean of its gaps (the first token excluded).
    for r in ok:
        one = summarize([r])
        n_gaps = len(r.chunk_times_s) - 1
        if n_gaps:
            gaps_sum_ms = one["mean_itl_ms"] * n_gaps
            assert one["mean_e2el_ms"] - one["mean_ttft_ms"] == pytest.approx(gaps_sum_ms)
            assert one["mean_tpot_ms"] == pytest.approx(one["mean_itl_ms"])
        else:
            assert math.isnan(one["mean_itl_ms"])
            assert math.isnan(one["mean_tpot_ms"])

    # Pooled: the ITL count is sum(chunks - 1), so mean ITL x count == sum(E2EL - TTFT).
    n_itl = sum(len(r.chunk_times_s) - 1 for r in ok)
    if n_itl:
        lhs = s["mean_itl_ms"] * n_itl
        rhs = (s["mean_e2el_ms"] - s["mean_ttft_ms"]) * len(ok)
        assert lhs == pytest.approx(rhs)

    # Percentiles are numpy's linear ones over successful requests.
    ttfts_ms = [(r.chunk_times_s[0] - r.sent_s) * 1000 for r in ok]
    for p in DEFAULT_PERCENTILES:
        assert s[percentile_key(p, "ttft")] == pytest.approx(np.percentile(ttfts_ms, p))
    lags_ms = [(r.sent_s - r.scheduled_s) * 1000 for r in measured]
    assert s["max_send_lag_ms"] == pytest.approx(max(lags_ms))
    assert 0 <= s["p50_send_lag_ms"] <= s["p99_send_lag_ms"] <= s["max_send_lag_ms"]
    assert s["mean_ttft_from_scheduled_ms"] >= s["mean_ttft_ms"]
    assert s["p50_ttft_ms"] <= s["p90_ttft_ms"] <= s["p95_ttft_ms"] <= s["p99_ttft_ms"]


def test_objectives_imports_no_heavy_dependency() -> None:
    code = (
        "import sys, objectives\n"
        "bad = {'ray', 'mlflow', 'vllm', 'torch', 'httpx', 'optuna'} & set(sys.modules)\n"
        "own = {m for m in sys.modules if m.startswith('optimizer.')}\n"
        "assert not bad, bad\n"
        "assert own <= {'optimizer.types', 'optimizer.errors'}, own\n"
    )
    repo_root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)
