"""Trial runners: where a trial's engine and replay run. The only module that imports Ray.

``RayRunner`` runs each trial in its own Ray actor that asks for ``num_gpus`` = tensor x
pipeline parallel size; the vLLM server is a child process of the actor and inherits the
``CUDA_VISIBLE_DEVICES`` Ray assigned, so concurrent trials never share a GPU. Killing the actor
(cancel, timeout) kills its server too: the engine guard watches the actor process. A local Ray
is started by default; an address joins a cluster. ``LocalRunner`` runs trials in a thread of the
driver (one at a time), for debugging and for machines where Ray is unwanted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from typing import Any, Protocol

from optimizer.trial import run_trial
from optimizer.types import TrialResult, TrialSpec

__all__ = ["LocalRunner", "RayRunner", "TrialRunner"]


class _Handle:
    """A submitted trial: its spec, a future of its result, and the actor running it (Ray)."""

    def __init__(
        self, spec: TrialSpec, future: concurrent.futures.Future[TrialResult], actor: Any = None
    ) -> None:
        self.spec = spec
        self.future = future
        self.actor = actor


class TrialRunner(Protocol):
    """Runs trials; ``capacity`` of them at once."""

    capacity: int

    def submit(self, spec: TrialSpec, gpus: int) -> _Handle:
        """Start a trial that may use ``gpus`` GPUs."""
        ...

    def cancel(self, handle: _Handle) -> None:
        """Stop a trial and its server."""
        ...

    def close(self) -> None:
        """Release the runner's resources."""
        ...


class LocalRunner:
    """Trials in a driver thread, one at a time (no Ray)."""

    capacity = 1

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="trial"
        )

    def submit(self, spec: TrialSpec, gpus: int) -> _Handle:
        return _Handle(spec, self._pool.submit(run_trial, spec, isolate_client=True))

    def cancel(self, handle: _Handle) -> None:
        # A running engine is a subprocess of this process: its guard outlives nothing, but a
        # thread cannot be interrupted; the trial finishes its replay. Queued ones are dropped.
        handle.future.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _TrialActor:
    """Runs one trial inside a Ray actor process."""

    def run(self, spec: TrialSpec) -> TrialResult:
        # Ray starts workers at a low priority (nice 15); the replay client and the server it
        # starts would then lose the CPU to everything else and the client's send lag would
        # distort every measurement. Back to normal priority where permitted.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        return run_trial(spec, isolate_client=True)

    def environment(self) -> dict[str, Any]:
        import ray

        return {
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }


class RayRunner:
    """One Ray actor per trial, pinned to ``gpus`` GPUs.

    Args:
        address: A Ray cluster to join; None starts (or reuses) a local Ray.
        capacity: Trials at once. On a machine without GPUs this should be 1 (the CPU build
            uses every core).
        cpus_per_trial: CPU resources each actor asks for.
    """

    def __init__(
        self, address: str | None = None, *, capacity: int = 1, cpus_per_trial: float = 1.0
    ) -> None:
        import ray

        self._ray = ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "configure_logging": False,
            }
            if address:
                ray.init(address=address, **kwargs)
            else:
                # A small object store: trial results are records, not tensors.
                ray.init(object_store_memory=256 * 1024**2, **kwargs)
        self.capacity = capacity
        self.cpus_per_trial = cpus_per_trial
        # max_concurrency 2: `environment` answers while `run` is busy.
        self._actor_cls = ray.remote(max_restarts=0, max_concurrency=2)(_TrialActor)  # type: ignore[call-overload]

    def cluster_gpus(self) -> int:
        """GPUs the Ray cluster has."""
        resources: dict[str, float] = self._ray.cluster_resources()  # type: ignore[no-untyped-call]
        return int(resources.get("GPU", 0))

    def submit(self, spec: TrialSpec, gpus: int) -> _Handle:
        actor = self._actor_cls.options(num_gpus=gpus, num_cpus=self.cpus_per_trial).remote()
        ref = actor.run.remote(spec)
        return _Handle(spec, ref.future(), actor)

    def environment(self, handle: _Handle) -> dict[str, Any]:
        """The actor's pid and GPU assignment (for tests and logs)."""
        result: dict[str, Any] = self._ray.get(handle.actor.environment.remote())
        return result

    def cancel(self, handle: _Handle) -> None:
        # The engine guard sees its owner (the actor process) die and kills the server group.
        if handle.actor is not None:
            self._ray.kill(handle.actor, no_restart=True)

    def release(self, handle: _Handle) -> None:
        """Free a finished trial's actor (and its GPUs)."""
        if handle.actor is not None:
            self._ray.kill(handle.actor, no_restart=True)
            handle.actor = None

    def close(self) -> None:
        pass
