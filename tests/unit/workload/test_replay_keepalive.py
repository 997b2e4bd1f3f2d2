"""The keep-alive race: a server that closes idle connections while it is stalled.

vLLM's server closes a connection idle for 5 s. When it stalls (here: ``SIGSTOP``) across that
timeout, a request the client sends on an idle connection during the stall waits in the
socket; when the server resumes, the overdue idle timer runs first and resets the connection
with the request unread. Before the fix, such requests failed (``ReadError: no detail``);
now they are sent once more on a fresh connection and counted.

The fake server (``tests.fakes.openai_stream_server --keepalive-s``) runs in a process of its
own, so it can be stopped; a real-server version is in the integration tier.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest

from optimizer.types import Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayOptions, ReplayResult, ReplaySnapshot, replay
from optimizer.workload.replay_client import describe_error
from tests.fakes.openai_stream_server import in_subprocess

KEEPALIVE_S = 1.0
N1 = 16  # first phase: a connection in every one of up to 16 pools
N2 = 8  # second phase, during the stall: on idle connections
PHASE2_S = 2.0  # when the second phase is sent (the client's keep-alive expiry is 3 s)


@pytest.fixture()
def stoppable_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    with in_subprocess("--keepalive-s", str(KEEPALIVE_S)) as (url, process):
        yield process, url


def _stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url + "/stats", timeout=10) as response:
        data: dict[str, int] = json.loads(response.read())
        return data


def _replay_across_a_stall(pid: int, url: str, options: ReplayOptions) -> ReplayResult:
    """N1 requests at once (N1 connections), then N2 more while the server is stopped.

    Times on the replay clock (signals are sent from the replay's stop-check hook, polled
    every 20 ms): phase 1 at 0 s; SIGSTOP once it has finished (well before the server's 1 s
    idle timeout); phase 2 at 2.0 s, on connections idle for under 2 s on the client's clock
    (under its 3 s expiry, so they are reused); SIGCONT at 3.2 s, when they have been idle for
    over 1 s on the server's clock. Phase 1 may take up to 1.9 s (a loaded machine), since the
    race needs only that it ends before phase 2 starts.
    """
    # The idle connections must outlive phase 2's wait on the client's clock to be reused.
    assert options.keepalive_expiry_s > PHASE2_S + 0.5, options.keepalive_expiry_s
    arrivals = [0.0] * N1 + [PHASE2_S + 0.001 * i for i in range(N2)]
    trace = Trace(tuple(TraceRequest(a, 16, 2) for a in arrivals))
    state = {"stopped": False, "resumed": False}

    def signals(snapshot: ReplaySnapshot) -> None:
        if not state["stopped"] and len(snapshot.finished) >= N1:
            assert snapshot.now_s < PHASE2_S - 0.1, f"phase 1 too slow ({snapshot.now_s:.2f} s)"
            os.kill(pid, signal.SIGSTOP)
            state["stopped"] = True
        elif state["stopped"] and not state["resumed"] and snapshot.now_s >= PHASE2_S + 1.2:
            os.kill(pid, signal.SIGCONT)
            state["resumed"] = True

    async def go() -> ReplayResult:
        try:
            return await replay(
                trace,
                url,
                "fake-model",
                vocab=TokenRange(256, 1000),
                seed=0,
                options=dataclasses.replace(options, stop_check_interval_s=0.02),
                stop_check=lambda snapshot: signals(snapshot),
            )
        finally:
            os.kill(pid, signal.SIGCONT)

    result = asyncio.run(go())
    assert state["stopped"] and state["resumed"]
    return result


def test_keepalive_race_reproduced_with_the_old_connection_settings(
    stoppable_server: tuple[subprocess.Popen[str], str],
) -> None:
    process, url = stoppable_server
    # The settings before the fix: httpx's transport, 16 pools, a 60 s expiry, no retry.
    old = ReplayOptions(
        client_shards=16, keepalive_expiry_s=60.0, retry_reset=False, lean_transport=False
    )
    result = _replay_across_a_stall(process.pid, url, old)
    errors = [r.error for r in result.records if r.error is not None]
    assert all(r.ok for r in result.records[:N1])
    assert len(errors) == N2, errors  # every request sent during the stall failed
    assert _stats(url)["lost_requests"] == N2
    # The failures name the real error: the reset, with its errno.
    assert all("ECONNRESET" in e or "disconnected" in e for e in errors), errors
    assert not any("no detail" in e for e in errors)
    assert result.retried == 0


@pytest.mark.parametrize("lean", [True, False], ids=["lean-transport", "httpx-transport"])
def test_keepalive_race_no_spurious_failures_after_the_fix(
    stoppable_server: tuple[subprocess.Popen[str], str], lean: bool
) -> None:
    process, url = stoppable_server
    result = _replay_across_a_stall(process.pid, url, ReplayOptions(lean_transport=lean))
    assert [r.error for r in result.records if not r.ok] == []
    stats = _stats(url)
    # The server did reset the raced connections, and served every request exactly once.
    assert stats["lost_requests"] == N2
    assert stats["completions"] == N1 + N2
    assert result.retried == N2
    # The retried requests keep their first send time (their bytes reached the server's
    # socket on schedule): the stall shows in their TTFT, not as client send lag.
    for record in result.records[N1:]:
        # (a send time taken at the retry would be a second late: the stall)
        assert record.sent_s - record.scheduled_s < 0.5
        assert record.first_token_s is not None and record.first_token_s - record.sent_s > 0.9


def test_describe_error_finds_the_errno_under_empty_messages() -> None:
    try:
        try:
            try:
                raise ConnectionResetError(104, "Connection reset by peer")
            except OSError as exc:
                raise RuntimeError() from exc
        except RuntimeError as exc:
            raise ValueError("") from exc
    except ValueError as exc:
        text = describe_error(exc)
    assert text == "ValueError: [Errno 104] Connection reset by peer (ECONNRESET)"
    assert describe_error(KeyError()) == "KeyError (raised without a message or an OS error)"
    try:
        try:
            raise EOFError()
        except EOFError as exc:
            raise ValueError() from exc
    except ValueError as exc:
        assert describe_error(exc) == "ValueError (from EOFError)"
