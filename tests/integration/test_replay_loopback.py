"""The replayer over real sockets and real httpx against the fake streaming server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from optimizer.types import Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import run_replay
from tests.fakes.openai_stream_server import in_subprocess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fake_server_url() -> Iterator[str]:
    with in_subprocess("--itl-ms", "1") as (url, _):
        yield url


def test_200_requests_at_50_per_second(fake_server_url: str) -> None:
    rate_rps = 50.0
    trace = Trace(
        tuple(
            TraceRequest(i / rate_rps, 32 + i % 7, 4 + i % 5, prefix_blocks=(i % 3,))
            for i in range(200)
        ),
        block_size=16,
    )
    result = run_replay(
        trace,
        fake_server_url,
        "fake-model",
        vocab=TokenRange(256, 32_000),
        seed=0,
        warmup_requests=10,
    )
    assert len(result.records) == 200
    assert [r.index for r in result.records] == list(range(200))
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok][:3]
    assert sum(r.output_tokens for r in result.records) == sum(
        t.output_tokens for t in trace.requests
    )
    for record, request in zip(result.records, trace.requests, strict=True):
        assert len(record.chunk_times_s) == request.output_tokens
        assert record.sent_s <= record.chunk_times_s[0] <= record.chunk_times_s[-1] <= record.end_s
    assert sum(r.warmup for r in result.records) == 10
    # Loose bound: a 2-core CI box shares its cores with the server.
    print(f"p99 send lag {result.p99_send_lag_ms:.2f} ms, max {result.max_send_lag_ms:.2f} ms")
    # A bound that holds on a busy machine: a client that lost the schedule lags by seconds.
    assert result.p99_send_lag_ms < 250.0
    assert result.duration_s == pytest.approx(199 / rate_rps, abs=2.0)


def test_unreachable_server_is_recorded_not_raised() -> None:
    trace = Trace(tuple(TraceRequest(i * 0.01, 8, 2) for i in range(5)))
    # Port 9 (discard) on loopback: nothing listens there in a test environment.
    result = run_replay(trace, "http://127.0.0.1:9", "m", vocab=TokenRange(256, 1000), seed=0)
    assert len(result.records) == 5
    assert all(r.error is not None and "ConnectError" in r.error for r in result.records)
