"""The replayer's latency figures against a server whose latencies are known.

The fake server (``tests.fakes.openai_stream_server``, a process of its own) answers every
request with its first token ``--ttft-ms`` after reading it and the next tokens at fixed
``--itl-ms`` intervals (absolute deadlines, so timer lateness does not add up), and logs when
it actually wrote each token. TTFT, TPOT and ITL as the project computes them
(``objectives.summarize``, vLLM bench's definitions) must come out within 2 % of the truth:
the times the server logged (on a busy machine its timers can fire late, which is the server's
latency, not a client error), which must in turn be close to the nominal values. What is left
over is loopback and the client's own delay in reading a chunk.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.request
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from objectives import summarize
from optimizer.types import Trace, TraceRequest
from optimizer.workload.http11 import LeanTransport
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayResult, replay, run_replay
from tests.fakes.openai_stream_server import in_subprocess

TTFT_MS = 100.0
ITL_MS = 20.0
OUTPUT_TOKENS = 11


@pytest.fixture(scope="module")
def timed_server() -> Iterator[str]:
    with in_subprocess("--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS)) as (url, _):
        yield url


def _reset(url: str) -> None:
    request = urllib.request.Request(url + "/arrivals/reset", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=10):
        pass


def _misses_of_one_replay(url: str) -> list[str]:
    """One replay against the timed server: the figures further than 2 % from the truth."""
    _reset(url)
    # 24 requests, 10/s, overlapping (each lasts 0.3 s): 4 warm-up, 20 measured.
    trace = Trace(tuple(TraceRequest(i / 10, 32, OUTPUT_TOKENS) for i in range(24)))
    result = run_replay(
        trace, url, "fake-model", vocab=TokenRange(256, 1000), seed=0, warmup_requests=4
    )
    summary = summarize(result.records)
    assert summary["failed"] == 0 and summary["completed"] == 20
    with urllib.request.urlopen(url + "/timings", timeout=10) as response:
        timings = sorted(json.loads(response.read()))[4:]  # arrival order; warm-up dropped
    assert len(timings) == 20 and all(len(t) == 1 + OUTPUT_TOKENS for t in timings)
    served = {
        "ttft": [t[1] - t[0] for t in timings],
        "tpot": [(t[-1] - t[1]) / (OUTPUT_TOKENS - 1) for t in timings],
        "itl": [b - a for t in timings for a, b in itertools.pairwise(t[1:])],
    }
    # The server kept its nominal latencies (medians: robust to a scheduler hiccup).
    assert np.median(served["ttft"]) * 1e3 == pytest.approx(TTFT_MS, rel=0.05)
    assert np.median(served["itl"]) * 1e3 == pytest.approx(ITL_MS, rel=0.05)
    stats = {"mean": np.mean, "median": np.median, "p95": lambda v: np.percentile(v, 95)}
    misses = []
    for metric, values in served.items():
        for stat, function in stats.items():
            key = f"{stat}_{metric}_ms"
            truth_ms = float(function(values)) * 1e3
            print(f"{key}: replay {summary[key]:.3f}, server {truth_ms:.3f}")
            if stat == "p95" and metric != "tpot":
                # The P95 of 20 TTFTs (or of 200 gaps) is one or a few values: a single late
                # read of the client on a shared 2-core machine moves it by a few ms. Printed;
                # TPOT, a per-request mean, is checked.
                continue
            if summary[key] != pytest.approx(truth_ms, rel=0.02):
                misses.append(f"{key}: replay {summary[key]:.3f} vs server {truth_ms:.3f}")
    return misses


def test_ttft_tpot_itl_within_2_percent_of_the_truth(timed_server: str) -> None:
    """Every figure within 2 % of the server's log, in one of at most three replays.

    A single read of the client delayed by the other processes of a shared 2-core machine (a
    40 ms stall) moves the mean TTFT of 20 requests by 2 ms, which is 2 %: seen once in CI. A
    client that is off systematically misses in every replay; a stall does not repeat on cue.
    """
    attempts = [_misses_of_one_replay(timed_server)]
    while attempts[-1] and len(attempts) < 3:
        attempts.append(_misses_of_one_replay(timed_server))
    assert not attempts[-1], attempts


class _SlowToSend(httpx.AsyncBaseTransport):
    """Holds every other request 150 ms before it reaches a socket (a busy client's pool)."""

    def __init__(self) -> None:
        self.inner = LeanTransport()
        self.count = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.count += 1
        if self.count % 2 == 0:
            await asyncio.sleep(0.15)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_send_lag_is_what_the_server_sees(timed_server: str) -> None:
    """A request held inside the client counts as late: sent_s is the socket write."""
    with urllib.request.urlopen(
        urllib.request.Request(timed_server + "/arrivals/reset", data=b"", method="POST"),
        timeout=10,
    ):
        pass
    trace = Trace(tuple(TraceRequest(i * 0.2, 8, 2) for i in range(10)))

    async def go() -> ReplayResult:
        return await replay(
            trace,
            timed_server,
            "fake-model",
            vocab=TokenRange(256, 1000),
            seed=0,
            transport=_SlowToSend(),
        )

    result = asyncio.run(go())
    assert all(r.ok for r in result.records)
    lags = [r.sent_s - r.scheduled_s for r in result.records]
    # Held requests are late by the hold at least, on any machine; the others, whatever a busy
    # machine adds to both, by less than the held ones (bounds, not timings: CI shares 2 cores).
    held, free = lags[1::2], lags[::2]
    assert all(lag >= 0.15 for lag in held)
    assert float(np.median(free)) < min(held)
    assert result.p99_send_lag_ms >= 150 and not result.schedule_kept
    # The server's arrival log agrees with the recorded send times (same monotonic clock).
    with urllib.request.urlopen(timed_server + "/arrivals", timeout=10) as response:
        arrivals = sorted(json.loads(response.read()))
    sent = [r.sent_s for r in result.records]
    # A send time taken before the hold would be off by 150 ms; a busy machine's thread
    # scheduling may add some tens of ms to either side.
    for arrival, sent_s in zip(arrivals, sent, strict=True):
        assert (arrival - arrivals[0]) - (sent_s - sent[0]) == pytest.approx(0.0, abs=0.06)


def test_several_client_processes_replay_one_schedule(timed_server: str) -> None:
    """processes=2: one schedule, every request once, the prompts of a one-process replay."""
    with urllib.request.urlopen(
        urllib.request.Request(timed_server + "/arrivals/reset", data=b"", method="POST"),
        timeout=10,
    ):
        pass
    trace = Trace(tuple(TraceRequest(i * 0.05, 12, 2, prefix_blocks=(i % 2,)) for i in range(20)))
    result = run_replay(
        trace,
        timed_server,
        "fake-model",
        vocab=TokenRange(256, 1000),
        seed=3,
        warmup_requests=3,
        processes=2,
    )
    assert [r.index for r in result.records] == list(range(20))
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok]
    assert [r.warmup for r in result.records] == [True] * 3 + [False] * 17
    assert [r.scheduled_s for r in result.records] == pytest.approx([i * 0.05 for i in range(20)])
    # One schedule: the server saw the requests about 50 ms apart from both processes (two
    # unsynchronised schedules would put pairs ~0 ms apart: a median gap near 25 ms or less).
    with urllib.request.urlopen(timed_server + "/arrivals", timeout=10) as response:
        arrivals = sorted(json.loads(response.read()))
    gaps = np.diff(arrivals)
    assert len(arrivals) == 20 and np.median(gaps) == pytest.approx(0.05, abs=0.02)
    assert arrivals[-1] - arrivals[0] >= 19 * 0.05 - 0.05
