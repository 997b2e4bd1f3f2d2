"""The server's state sampled over time, in a thread beside the replay.

Every ``interval_s``: the gauges and the preemption counter of ``/metrics`` (KV-cache usage,
running, waiting), the resident memory of the server's whole process group (psutil: the API
server, the engine core and their workers), and, where ``nvidia-smi`` exists, the GPU memory
its processes use (or its visible GPUs hold, where ``nvidia-smi`` lists other pids:
:func:`optimizer.engine.gpus.server_gpu_mib`). A sample that cannot be read keeps None in its
fields; sampling never fails
the run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable

import psutil

from optimizer.engine.gpus import server_gpu_mib
from optimizer.engine.process import group_alive_pids
from optimizer.stability.verdicts import Sample

__all__ = ["Sampler", "group_rss_mib"]

_MIB = 1024.0 * 1024.0
_GAUGES = {
    "kv_usage": "vllm:kv_cache_usage_perc",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
}


def group_rss_mib(pgid: int) -> float | None:
    """Resident memory of a process group's live processes, MiB (None: none could be read)."""
    total, seen = 0, False
    for pid in group_alive_pids(pgid):
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
            seen = True
    return total / _MIB if seen else None


class Sampler:
    """Samples a server every ``interval_s`` until stopped; times relative to ``t0``
    (a ``time.perf_counter`` value: the replay's schedule time zero).

    Args:
        metrics: Reads the server's ``/metrics`` as {sample: value}.
        pgid: The server's process group (None: no memory samples).
        t0: Time zero on ``perf_counter``'s scale.
        interval_s: Seconds between two samples.
        gpu: Sample GPU memory (only where ``nvidia-smi`` exists).
    """

    def __init__(
        self,
        metrics: Callable[[], dict[str, float]],
        pgid: int | None,
        t0: float,
        interval_s: float = 1.0,
        *,
        gpu: bool = True,
    ) -> None:
        self.metrics = metrics
        self.pgid = pgid
        self.t0 = t0
        self.interval_s = interval_s
        self.gpu = gpu and shutil.which("nvidia-smi") is not None
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stability-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Sample]:
        """Stop, take one last sample, and return every sample."""
        self._stop.set()
        self._thread.join(timeout=30)
        self.samples.append(self.sample())
        return self.samples

    def _loop(self) -> None:
        next_at = time.perf_counter()
        while not self._stop.is_set():
            self.samples.append(self.sample())
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.perf_counter()))

    def sample(self) -> Sample:
        """One sample now."""
        t = time.perf_counter() - self.t0
        values: dict[str, float | None] = dict.fromkeys(_GAUGES)
        try:
            m = self.metrics()
            values = {k: m.get(name) for k, name in _GAUGES.items()}
        except Exception:  # a slow or busy server: this sample has no gauges
            pass
        rss = group_rss_mib(self.pgid) if self.pgid is not None else None
        gpu = None
        if self.gpu and self.pgid is not None:
            gpu = server_gpu_mib(
                group_alive_pids(self.pgid), os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        return Sample(t_s=t, rss_mib=rss, gpu_mib=gpu, **values)
