"""The local Ray cluster a study starts (optimizer.runners.start_ray): real Ray, no fakes."""

from __future__ import annotations

import glob
import os

import pytest

from optimizer.runners import start_ray


def test_a_local_cluster_records_no_metrics() -> None:
    """Ray 2.60's OpenTelemetry metrics thread once killed a tune driver (SIGSEGV in
    TemporalMetricStorage::buildMetrics); a local cluster, whose metrics nobody reads, runs
    with metrics collection off, and its driver says so in its own log."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    start_ray(log_to_driver=False)
    try:
        from ray._private import worker

        session = worker._global_node.get_session_dir_path()
        assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
        logs = glob.glob(os.path.join(session, "logs", f"python-core-driver-*_{os.getpid()}.log"))
        assert logs, f"no driver log of this process under {session}"
        with open(logs[0], encoding="utf-8", errors="replace") as f:
            assert "Disabled stats." in f.read()
    finally:
        ray.shutdown()


def _where() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _refuse() -> None:
    from optimizer.errors import ConfigError

    raise ConfigError("refused inside the actor")


def test_the_runners_call_runs_in_an_actor_of_its_own_that_ends_with_it() -> None:
    """``RayRunner.call`` (the quality gate's servers in a Ray study): the function runs in
    an actor process of its own on the GPUs asked (none here), at the trials' priority; the
    actor ends with the call, and the project's own error comes back as itself."""
    import time

    import psutil

    from optimizer.errors import ConfigError
    from optimizer.runners import TRIAL_NICENESS, RayRunner

    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    runner = RayRunner(capacity=1, cpus_per_trial=0.5)
    try:
        seen = runner.call(_where, 0)
        assert seen["pid"] != os.getpid() and seen["nice"] == TRIAL_NICENESS
        pid = int(str(seen["pid"]))
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the call's actor outlived the call"
            time.sleep(0.2)
        with pytest.raises(ConfigError, match="refused inside the actor"):
            runner.call(_refuse, 0)
    finally:
        runner.close()
        ray.shutdown()


def _hold() -> None:
    import time

    time.sleep(120)


def test_closing_the_runner_ends_a_call_in_flight() -> None:
    """A cancelled service study's quality gate: ``close`` kills the call's actor (and the
    servers it started), and the call raises Ray's error at once."""
    import threading
    import time

    from optimizer.runners import RayRunner

    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    runner = RayRunner(capacity=1, cpus_per_trial=0.5)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            runner.call(_hold, 0)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while not runner._calls:
            assert time.monotonic() < deadline, "the call never started"
            time.sleep(0.1)
        time.sleep(2.0)
        t0 = time.monotonic()
        runner.close()
        thread.join(30)
        assert raised and isinstance(raised[0], ray.exceptions.RayActorError)
        assert time.monotonic() - t0 < 30
    finally:
        runner.close()
        ray.shutdown()
