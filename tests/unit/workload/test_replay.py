"""The replayer on a scripted clock against httpx.MockTransport: schedule, accounting, failures."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from optimizer.errors import ReplayError
from optimizer.types import Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import (
    ReplayOptions,
    ReplayProgress,
    ReplayResult,
    ReplaySnapshot,
    build_request_bodies,
    replay,
)

VOCAB = TokenRange(256, 1000)
URL = "http://fake"


class FakeClock:
    """Virtual time for the replayer: a tiny discrete-event scheduler.

    ``sleep_until`` parks the caller; once the event loop has had a number of idle turns
    (enough for every instantly-answered request to finish), time jumps to the earliest parked
    deadline (plus a scripted lateness, to model a client that wakes up late) and that sleeper
    resumes. Every requested deadline is recorded.
    """

    def __init__(self, start: float = 1000.0, late_s: Callable[[float], float] | None = None):
        self.t = start
        self.start = start
        self.late_s = late_s or (lambda deadline: 0.0)
        self.deadlines: list[float] = []
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._ticking = False

    def now(self) -> float:
        return self.t

    async def sleep_until(self, deadline: float) -> None:
        self.deadlines.append(deadline)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (deadline, next(self._seq), future))
        self._kick()
        await future

    def _kick(self) -> None:
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_soon(self._tick, 200)

    def _tick(self, turns_left: int) -> None:
        if turns_left:
            asyncio.get_running_loop().call_soon(self._tick, turns_left - 1)
            return
        self._ticking = False
        while self._waiters:
            deadline, _, future = heapq.heappop(self._waiters)
            if not future.done():  # skip sleepers that were cancelled
                self.t = max(self.t, deadline + self.late_s(deadline))
                future.set_result(None)
                break
        if self._waiters:
            self._kick()


def sse_body(n_tokens: int, *, usage: bool = True, error_after: int | None = None) -> list[bytes]:
    pieces = []
    for i in range(n_tokens):
        if error_after is not None and i == error_after:
            pieces.append(
                b'data: {"error": {"message": "EngineCore died", "type": "InternalServerError",'
                b' "code": 500}}\n\n'
            )
            break
        finish = '"length"' if i == n_tokens - 1 else "null"
        choice = f'{{"index":0,"text":" t{i}","finish_reason":{finish}}}'
        pieces.append(f'data: {{"choices":[{choice}]}}\n\n'.encode())
    if usage and error_after is None:
        usage_json = f'{{"prompt_tokens":1,"completion_tokens":{n_tokens}}}'
        pieces.append(f'data: {{"choices":[],"usage":{usage_json}}}\n\n'.encode())
    pieces.append(b"data: [DONE]\n\n")
    return pieces


class FakeServer:
    """httpx.MockTransport handler: answers like vLLM, optionally with virtual-time delays."""

    def __init__(self, clock: FakeClock | None = None, itl_s: float = 0.0) -> None:
        self.clock = clock
        self.itl_s = itl_s
        self.bodies: list[dict[str, object]] = []
        self.arrivals: list[float] = []
        self.behaviour: dict[int, str] = {}  # by max_tokens (which the tests make unique)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.clock is not None:
            self.arrivals.append(self.clock.now())
        n = int(body["max_tokens"])
        mode = self.behaviour.get(n, "ok")
        if mode == "500":
            return httpx.Response(500, content=b'{"error": "boom: KV cache exhausted"}')
        if mode == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        if mode == "error_in_stream":
            pieces = sse_body(n, error_after=1)
        elif mode == "short":
            pieces = sse_body(n - 1)
        elif mode == "no_usage":
            pieces = sse_body(n, usage=False)
        elif mode == "no_done":
            pieces = sse_body(n)[:-1]
        else:
            pieces = sse_body(n)
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self._stream(pieces)
        )

    async def _stream(self, pieces: list[bytes]) -> AsyncIterator[bytes]:
        for i, piece in enumerate(pieces):
            # Delays between token chunks only; usage and [DONE] follow the last token at once.
            if self.itl_s and self.clock is not None and i and b'"text"' in piece:
                await self.clock.sleep_until(self.clock.now() + self.itl_s)
            yield piece


def make_trace(arrivals: list[float], *, out: list[int] | None = None, inp: int = 8) -> Trace:
    outs = out or [3] * len(arrivals)
    return Trace(
        tuple(TraceRequest(a, inp, o) for a, o in zip(arrivals, outs, strict=True)), block_size=4
    )


def run(trace: Trace, server: FakeServer, clock: FakeClock, **kwargs: object) -> ReplayResult:
    async def go() -> ReplayResult:
        return await replay(
            trace,
            URL,
            "m",
            vocab=VOCAB,
            seed=1,
            clock=clock,
            transport=httpx.MockTransport(server.handle),
            **kwargs,  # type: ignore[arg-type]
        )

    return asyncio.run(go())


def test_sends_at_scheduled_times_in_order_with_absolute_deadlines() -> None:
    clock = FakeClock()
    server = FakeServer(clock)
    arrivals = [5.0, 5.0, 5.5, 7.0, 7.25]
    trace = make_trace(arrivals, out=[1, 2, 3, 4, 5])
    result = run(trace, server, clock)

    scheduled = [0.0, 0.0, 0.5, 2.0, 2.25]
    assert [r.scheduled_s for r in result.records] == scheduled
    assert [r.sent_s for r in result.records] == scheduled
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]
    # Sent in trace order, at the right virtual times.
    assert [b["max_tokens"] for b in server.bodies] == [1, 2, 3, 4, 5]
    assert [a - clock.start for a in server.arrivals] == scheduled
    # Deadlines are absolute (start + offset), never accumulated relative sleeps; no sleep
    # for the request that was already due.
    assert clock.deadlines == [clock.start + s for s in (0.5, 2.0, 2.25)]
    assert result.p99_send_lag_ms == 0.0
    assert result.schedule_kept and result.message == ""
    assert all(r.ok for r in result.records), [r.error for r in result.records]


def test_lag_recorded_and_schedule_judged() -> None:
    # The clock wakes the dispatcher 30 ms late at the 2.0 s deadline.
    clock = FakeClock(late_s=lambda d: 0.030 if d == 1002.0 else 0.0)
    result = run(make_trace([0.0, 0.5, 2.0, 3.0]), FakeServer(clock), clock)
    lags = [round((r.sent_s - r.scheduled_s) * 1e3, 6) for r in result.records]
    assert lags == [0.0, 0.0, 30.0, 0.0]
    assert result.max_send_lag_ms == pytest.approx(30.0)
    assert result.p99_send_lag_ms > 10.0
    assert not result.schedule_kept
    assert "could not keep" in result.message and "10 ms" in result.message
    # The lag is measured, not compounded: the next request is on time again.
    assert result.records[3].sent_s == 3.0


def test_lag_bound_is_a_parameter() -> None:
    clock = FakeClock(late_s=lambda d: 0.030 if d == 1002.0 else 0.0)
    result = run(make_trace([0.0, 2.0]), FakeServer(clock), clock, max_send_lag_ms=50.0)
    assert result.schedule_kept and result.max_send_lag_bound_ms == 50.0


def test_records_tokens_chunks_and_bodies() -> None:
    clock = FakeClock()
    server = FakeServer(clock, itl_s=0.01)
    trace = make_trace([0.0, 1.0], out=[4, 6], inp=10)
    result = run(trace, server, clock, extra_body={"temperature": 0.5})
    for record, wanted in zip(result.records, (4, 6), strict=True):
        assert record.ok
        assert record.output_tokens == wanted
        assert len(record.chunk_times_s) == wanted
        assert record.first_token_s == record.chunk_times_s[0]
        assert record.sent_s <= record.first_token_s <= record.end_s
        assert list(record.chunk_times_s) == sorted(record.chunk_times_s)
        assert record.chunk_times_s[-1] - record.chunk_times_s[0] == pytest.approx(
            0.01 * (wanted - 1)
        )
        assert record.input_tokens == 10
    body = server.bodies[0]
    assert len(body["prompt"]) == 10  # type: ignore[arg-type]
    assert all(256 <= t < 1000 for t in body["prompt"])  # type: ignore[attr-defined]
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.5 and body["model"] == "m"
    assert server.bodies[0]["prompt"] != server.bodies[1]["prompt"]


def test_failures_are_data_and_every_request_is_accounted_for() -> None:
    clock = FakeClock()
    server = FakeServer(clock)
    modes = {2: "ok", 3: "500", 4: "error_in_stream", 5: "short", 6: "connect", 7: "no_usage"}
    modes[8] = "no_done"
    server.behaviour = modes
    trace = make_trace([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], out=list(modes))
    result = run(trace, server, clock)
    assert len(result.records) == len(trace)
    errors = {r.index: r.error for r in result.records}
    assert errors[0] is None
    assert errors[1] is not None and errors[1].startswith("HTTP 500") and "KV cache" in errors[1]
    assert errors[2] is not None and "EngineCore died" in errors[2]
    assert errors[3] == "short output: 4 of 5 tokens"
    assert errors[4] is not None and errors[4].startswith("ConnectError")
    assert errors[5] is None  # no usage chunk: output counted from text chunks
    assert result.records[5].output_tokens == 7
    assert errors[6] == "stream ended without [DONE]"
    assert result.failed == 5
    assert result.records[2].first_token_s is not None  # the chunk before the error counts


def test_warmup_marking() -> None:
    clock = FakeClock()
    result = run(make_trace([0.0, 0.1, 0.2, 0.3]), FakeServer(clock), clock, warmup_requests=2)
    assert [r.warmup for r in result.records] == [True, True, False, False]


def test_max_duration_accounts_for_every_request() -> None:
    clock = FakeClock()
    # Requests every second, each streaming 3 tokens 0.4 s apart (0.8 s long).
    server = FakeServer(clock, itl_s=0.4)
    trace = make_trace([float(i) for i in range(10)])
    result = run(trace, server, clock, max_duration_s=4.5)
    assert len(result.records) == 10 and result.stopped_early
    for record in result.records[:4]:
        assert record.ok, record.error
    cancelled = result.records[4]
    assert cancelled.error == "cancelled: max duration reached"
    assert cancelled.sent_s == 4.0 and cancelled.end_s == 4.5
    assert len(cancelled.chunk_times_s) == 2  # tokens at 4.0 and 4.4 arrived before the stop
    for record in result.records[5:]:
        assert record.error == "not sent: max duration reached"
        assert record.first_token_s is None and record.output_tokens == 0
        assert record.sent_s == record.end_s == 4.5
    # Requests scheduled after the stop do not count as client lag.
    assert result.schedule_kept


def test_stop_check_ends_the_replay_with_its_reason_and_accounts_for_everything() -> None:
    clock = FakeClock()
    server = FakeServer(clock, itl_s=0.4)
    trace = make_trace([float(i) for i in range(10)])
    seen: list[ReplaySnapshot] = []

    def stop_after_three(snap: ReplaySnapshot) -> str | None:
        seen.append(snap)
        return "3 requests done" if len(snap.finished) >= 3 else None

    result = run(trace, server, clock, stop_check=stop_after_three, stop_check_interval_s=0.5)
    assert result.stopped_early and result.stop_reason == "3 requests done"
    assert len(result.records) == 10
    assert sum(r.ok for r in result.records) == 3
    assert all(r.error and "early stop: 3 requests done" in r.error for r in result.records[3:])
    # Snapshots saw in-flight requests with their send times.
    assert any(s.waiting_sent_s or s.streaming_sent_s for s in seen)
    assert all(t <= s.now_s for s in seen for t in (*s.waiting_sent_s, *s.streaming_sent_s))


def test_max_duration_longer_than_trace_changes_nothing() -> None:
    clock = FakeClock()
    result = run(make_trace([0.0, 1.0]), FakeServer(clock), clock, max_duration_s=100.0)
    assert not result.stopped_early and all(r.ok for r in result.records)


def test_progress_is_rate_limited_and_ends_with_totals() -> None:
    clock = FakeClock()
    calls: list[ReplayProgress] = []
    trace = make_trace([i * 0.05 for i in range(40)])
    run(trace, FakeServer(clock), clock, progress=calls.append)
    # 2 s of replay at <= 5 calls/s plus the final one.
    assert 2 <= len(calls) <= 12
    last = calls[-1]
    assert (last.total, last.sent, last.completed, last.failed, last.in_flight) == (
        40,
        40,
        40,
        0,
        0,
    )
    elapsed = [c.elapsed_s for c in calls[:-1]]
    assert all(b - a >= 0.2 - 1e-9 for a, b in itertools.pairwise(elapsed))


def test_outer_cancellation_leaves_no_tasks() -> None:
    async def go() -> None:
        clock = FakeClock()
        server = FakeServer(clock, itl_s=0.4)
        task = asyncio.create_task(
            replay(
                make_trace([0.0, 0.1, 5.0]),
                URL,
                "m",
                vocab=VOCAB,
                seed=0,
                clock=clock,
                transport=httpx.MockTransport(server.handle),
            )
        )
        for _ in range(50):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(go())


def test_invalid_arguments() -> None:
    clock = FakeClock()
    with pytest.raises(ReplayError):
        run(Trace(()), FakeServer(clock), clock)
    with pytest.raises(ReplayError):
        run(make_trace([1.0, 0.0]), FakeServer(clock), clock)
    with pytest.raises(ReplayError):
        run(make_trace([0.0]), FakeServer(clock), clock, max_duration_s=0.0)


def test_pool_overflow_makes_schedule_not_kept() -> None:
    # One connection, requests overlapping in virtual time: the second queues in the pool.
    clock = FakeClock()
    server = FakeServer(clock, itl_s=0.4)
    result = run(make_trace([0.0, 0.1]), server, clock, max_connections=1)
    assert all(r.ok for r in result.records)
    assert not result.schedule_kept and "max_connections" in result.message


def test_options_record_and_keyword_overrides() -> None:
    clock = FakeClock()
    options = ReplayOptions(warmup_requests=1, max_send_lag_ms=50.0)
    result = run(make_trace([0.0, 0.1, 0.2]), FakeServer(clock), clock, options=options)
    assert [r.warmup for r in result.records] == [True, False, False]
    assert result.max_send_lag_bound_ms == 50.0
    # A keyword replaces the record's field (the pre-record call style keeps working).
    clock = FakeClock()
    result = run(
        make_trace([0.0, 0.1]), FakeServer(clock), clock, options=options, warmup_requests=0
    )
    assert [r.warmup for r in result.records] == [False, False]
    with pytest.raises(TypeError, match="no_such_option"):
        run(make_trace([0.0]), FakeServer(clock), clock, no_such_option=1)
    with pytest.raises(ReplayError):
        ReplayOptions(client_shards=0)


def test_a_part_of_a_trace_builds_the_prompts_the_whole_trace_would() -> None:
    trace = Trace(
        tuple(TraceRequest(i * 0.1, 12, 2, prefix_blocks=(i % 2,)) for i in range(6)),
        block_size=4,
    )
    whole = build_request_bodies(trace, "m", vocab=VOCAB, seed=5)
    indices = (1, 3, 5)
    part = Trace(tuple(trace.requests[i] for i in indices), block_size=4)
    assert build_request_bodies(part, "m", vocab=VOCAB, seed=5, indices=indices) == [
        whole[i] for i in indices
    ]
    assert build_request_bodies(part, "m", vocab=VOCAB, seed=5) != [whole[i] for i in indices]
