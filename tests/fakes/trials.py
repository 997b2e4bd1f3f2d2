"""Shared FAKES for trials: a runner's handle and base runner (study tests), and an engine that
serves through the fake OpenAI server (run_trial tests). Import them; do not copy them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path
from typing import Any

from optimizer.types import MemoryAccount, TrialResult, TrialSpec
from tests.fakes.openai_stream_server import FakeOpenAIServer

__all__ = [
    "FakeEngine",
    "FakeHandle",
    "GpuRecordingFakeEngine",
    "ScriptedRunner",
    "gpu_recording_engine",
]


class FakeHandle:
    """A submitted trial whose result is known at once (or, with None, when set later)."""

    def __init__(self, spec: TrialSpec | None, result: TrialResult | None = None) -> None:
        self.spec = spec
        self.future: concurrent.futures.Future[TrialResult] = concurrent.futures.Future()
        if result is not None:
            self.future.set_result(result)


class ScriptedRunner:
    """A runner whose trials end as :meth:`result` says, at once; it records every spec."""

    capacity = 1

    def __init__(self) -> None:
        self.specs: list[TrialSpec] = []

    def result(self, spec: TrialSpec) -> TrialResult:
        raise NotImplementedError

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        self.specs.append(spec)
        return FakeHandle(spec, self.result(spec))

    def cancel(self, handle: FakeHandle) -> None:
        pass

    def close(self) -> None:
        pass


class FakeEngine:
    """A server for :func:`optimizer.trial.run_trial` without vLLM: the fake OpenAI server
    on a loopback port, in a thread of its own.

    Args:
        ttft_s: The fake server's time to first token.
        fail_start: Raise this from :meth:`start` (e.g. an EngineError).
        die_after_replay: Raise this from :meth:`check_alive` (the engine died mid-measure).
        memory: The memory account it reports (default: none).
    """

    def __init__(
        self,
        *,
        ttft_s: float = 0.0,
        fail_start: BaseException | None = None,
        die_after_replay: BaseException | None = None,
        log_path: Path | None = None,
        memory: MemoryAccount | None = None,
    ) -> None:
        self._memory = memory
        self._server = FakeOpenAIServer(ttft_s=ttft_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._fail_start = fail_start
        self._die = die_after_replay
        self.log_path = log_path or Path("fake-engine.log")
        self.startup_s: float | None = None
        self.stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    def start(self) -> None:
        if self._fail_start is not None:
            raise self._fail_start
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(10)
        self.startup_s = 0.01

    @property
    def startup_phases(self) -> dict[str, dict[str, float]]:
        """A fake start: all of it in the first /health answer (none before a start)."""
        return {"phases": {"health": 0.01} if self.startup_s else {}, "reported": {}}

    def stop(self) -> None:
        self.stopped = True
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._server.close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def check_alive(self) -> None:
        if self._die is not None:
            raise self._die

    def memory_account(self) -> MemoryAccount | None:
        return self._memory

    def effective_config(self) -> dict[str, str]:
        return {}

    def scrape_metrics(self) -> dict[str, Any]:
        return {}


class GpuRecordingFakeEngine(FakeEngine):
    """A FAKE engine that notes, in its trial's folder (``gpus.json``), the GPUs its process
    was given (``CUDA_VISIBLE_DEVICES``), its pid, and when it served: packing checks on
    logical GPUs without vLLM."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(ttft_s=0.05)
        self._note = workdir / "gpus.json"
        self._doc: dict[str, Any] = {}

    def start(self) -> None:
        import json
        import os
        import time

        self._doc = {
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "pid": os.getpid(),
            "start": time.time(),
        }
        super().start()
        self._note.parent.mkdir(parents=True, exist_ok=True)
        self._note.write_text(json.dumps(self._doc))

    def stop(self) -> None:
        import json
        import time

        super().stop()
        if self._doc:
            self._note.write_text(json.dumps({**self._doc, "stop": time.time()}))


def gpu_recording_engine(spec: TrialSpec) -> GpuRecordingFakeEngine:
    """Engine factory for :class:`optimizer.runners.RayRunner` (picklable: module level)."""
    return GpuRecordingFakeEngine(Path(spec.workdir))
