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
