"""FAKES for trials on a Ray cluster: a small trial spec, and an engine that tells a gate (a Ray
actor) where it started and holds its trial, GPUs and all, until the test releases it. Tests
wait on the gate's events, never on the clock, to see which trials run at once and where."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from optimizer.types import EngineConfig, Trace, TraceRequest, TrialSpec
from tests.fakes.trials import FakeEngine

__all__ = ["FileGatedEngines", "Gate", "GatedEngine", "GatedEngines", "QuickEngines", "tiny_spec"]


def tiny_spec(workdir: Path, number: int, *, model: str = "fake-model") -> TrialSpec:
    """A trial of a few short requests, its records in ``workdir``."""
    trace = Trace(
        requests=tuple(
            TraceRequest(arrival_s=0.05 * i, input_tokens=8, output_tokens=4) for i in range(6)
        )
    )
    return TrialSpec(
        number=number,
        engine=EngineConfig(model=model, args={}),
        trace=trace,
        workdir=str(workdir),
        token_range=(1000, 2000),
        seed=number + 1,
        warmup_requests=1,
        max_send_lag_ms=1000.0,
    )


class Gate:
    """A Ray actor (async) that trials report to: ``arrive`` when a trial's engine is up,
    ``hold`` until the test ``release``-s it. ``started`` waits for a trial's arrival and
    answers where it landed (None when it did not arrive in time)."""

    def __init__(self) -> None:
        self._arrived: dict[int, asyncio.Event] = {}
        self._released: dict[int, asyncio.Event] = {}
        self._notes: dict[int, dict[str, Any]] = {}

    def _event(self, table: dict[int, asyncio.Event], number: int) -> asyncio.Event:
        return table.setdefault(number, asyncio.Event())

    async def arrive(self, number: int, note: dict[str, Any]) -> None:
        self._notes[number] = note
        self._event(self._arrived, number).set()

    async def hold(self, number: int) -> None:
        await self._event(self._released, number).wait()

    async def release(self, number: int) -> None:
        self._event(self._released, number).set()

    async def started(self, number: int, timeout_s: float) -> dict[str, Any] | None:
        try:
            await asyncio.wait_for(self._event(self._arrived, number).wait(), timeout_s)
        except TimeoutError:
            return None
        return self._notes[number]

    async def arrivals(self) -> list[int]:
        return sorted(self._notes)


class GatedEngine(FakeEngine):
    """The fake server of one trial, reporting to the :class:`Gate` named ``gate`` in Ray
    namespace ``namespace``: where it started (Ray node, ``CUDA_VISIBLE_DEVICES``, pid) once
    up, and holding its trial in ``stop`` until released."""

    def __init__(self, spec: TrialSpec, gate: str, namespace: str) -> None:
        super().__init__(ttft_s=0.01, log_path=Path(spec.workdir) / "engine.log")
        self._number = spec.number
        self._gate = (gate, namespace)

    def _gate_actor(self) -> Any:
        import ray

        name, namespace = self._gate
        return ray.get_actor(name, namespace=namespace)

    def start(self) -> None:
        import ray

        super().start()
        note = {
            "node_id": ray.get_runtime_context().get_node_id(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "pid": os.getpid(),
            "start": time.time(),
        }
        ray.get(self._gate_actor().arrive.remote(self._number, note))

    def stop(self) -> None:
        import ray

        if self.startup_s is not None:
            ray.get(self._gate_actor().hold.remote(self._number))
        super().stop()


class GatedEngines:
    """Engine factory for :class:`optimizer.runners.RayRunner` (picklable: module level) of
    engines reporting to the gate named ``gate`` in Ray namespace ``namespace`` (made once
    Ray is up)."""

    def __init__(self, gate: str, namespace: str) -> None:
        self.gate = gate
        self.namespace = namespace

    def __call__(self, spec: TrialSpec) -> GatedEngine:
        return GatedEngine(spec, self.gate, self.namespace)


class FileGatedEngine(FakeEngine):
    """The fake server of one trial, gated through files and never through Ray, as a real
    trial's actor is busy replaying while it runs: once up it writes ``started.json`` in its
    trial folder (Ray node, pid), and holds its trial in ``stop`` until ``release`` appears
    there (polled, no Ray call: a raylet's death does not reach it through a Ray call)."""

    def __init__(self, spec: TrialSpec) -> None:
        super().__init__(ttft_s=0.01, log_path=Path(spec.workdir) / "engine.log")
        self._dir = Path(spec.workdir)

    def start(self) -> None:
        import json

        import ray

        super().start()
        note = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        (self._dir / "started.json.tmp").write_text(json.dumps(note))
        (self._dir / "started.json.tmp").rename(self._dir / "started.json")

    def stop(self) -> None:
        if self.startup_s is not None:
            while not (self._dir / "release").exists():
                time.sleep(0.1)
        super().stop()


class FileGatedEngines:
    """Engine factory (picklable) of :class:`FileGatedEngine`."""

    def __call__(self, spec: TrialSpec) -> FileGatedEngine:
        return FileGatedEngine(spec)


class QuickEngines:
    """Engine factory (picklable) of plain fake servers: each trial replays its trace against
    the fake OpenAI server in its actor and ends by itself."""

    def __call__(self, spec: TrialSpec) -> FakeEngine:
        return FakeEngine(ttft_s=0.005, log_path=Path(spec.workdir) / "engine.log")
