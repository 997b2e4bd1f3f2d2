"""What every part of the runners room shares: Ray's auto-init off, and the CPU priority the
trials and the service's request path take."""

from __future__ import annotations

__all__ = ["TRIAL_NICENESS", "WORKER_NICENESS_ENV", "no_auto_init"]

#: The CPU priority (niceness) a trial actor takes, and with it the replay client and the vLLM
#: server it starts: Ray starts its workers at nice 15, where they would lose the CPU to
#: everything else. The service's API replica starts at the same niceness
#: (:func:`serve_deployment`), and :func:`serve_run` raises Serve's proxy and the replica to it
#: where permitted: the API's request path is never below the trials it serves beside.
TRIAL_NICENESS = 0
#: Ray's environment variable of a worker's niceness, read by the worker process as it starts.
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def no_auto_init() -> None:
    """Ray's auto-init off in this process (call it after ``import ray``).

    A Ray call made before ``ray.init`` (``ray.get_gpu_ids()``, ``ray.get``, ...) would
    otherwise start a cluster, or join the one the machine registered (live, or dead: then it
    waits on the dead cluster's GCS for minutes). Off, such a call raises at once: Ray is
    started or joined only by :func:`start_ray`. Inside an actor Ray is up, and nothing
    changes.
    """
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False
