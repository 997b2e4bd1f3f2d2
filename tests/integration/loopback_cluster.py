"""A real multi-node Ray cluster on loopback for tests (issue 45): ``ray.cluster_utils.Cluster``,
each node its own raylet, every Ray server on 127.0.0.1 with Ray's multi-node switch off (as
:func:`optimizer.runners.start_ray` does for a local cluster), registered as ``ray start``
would register it (``ray_current_cluster``) but in a Ray temp folder of the test's own
(``RAY_TMPDIR``), so the machine's own registration is never touched."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "LOOPBACK",
    "listening_off_loopback",
    "ray_temp_dir",
    "registered_address",
    "start_cluster",
    "stop_cluster",
]

LOOPBACK = "127.0.0.1"
#: Small nodes: trial results are records, not tensors.
_NODE = {
    "node_ip_address": LOOPBACK,
    "object_store_memory": 80 * 1024**2,
    "include_log_monitor": False,
}


@contextlib.contextmanager
def ray_temp_dir() -> Iterator[Path]:
    """Ray's temp folder (``RAY_TMPDIR``: sessions, sockets, ``ray_current_cluster``) in a
    short folder of its own (a socket path has at most 107 bytes), and Ray's multi-node switch
    off, for this process and the Ray processes it starts; both restored after."""
    from ray._private import ray_constants

    folder = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", str(folder))
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def registered_address(temp_dir: Path) -> str | None:
    """The cluster address this Ray temp folder has registered (None: none)."""
    path = temp_dir / "ray" / "ray_current_cluster"
    return path.read_text().strip() if path.exists() else None


def start_cluster(head: dict[str, Any], *workers: dict[str, Any]) -> tuple[Any, list[Any]]:
    """A head and worker nodes (each a dict of ``Cluster.add_node`` arguments: ``num_cpus``,
    ``num_gpus``, ``resources``), all alive and registered when this returns: the cluster and
    its worker nodes in the order given."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **_NODE,
            "include_dashboard": False,
            "_system_config": {"enable_metrics_collection": False},
            **head,
        },
    )
    nodes = []
    try:
        for worker in workers:
            nodes.append(cluster.add_node(**{**_NODE, **worker}))
        cluster.wait_for_nodes()
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster, nodes


def stop_cluster(cluster: Any) -> None:
    """This process's Ray connection, then every node of ``cluster``."""
    import ray

    ray.shutdown()
    cluster.shutdown()
    assert not any(node.any_processes_alive() for node in cluster.list_all_nodes())


def listening_off_loopback() -> list[tuple[str, str]]:
    """The listening TCP sockets of this process and its descendants (the cluster's GCS,
    raylets, agents and workers) that are not on loopback, as ``(address, process)``; the
    test skips without ``ss`` (iproute2)."""
    import subprocess

    import psutil

    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2)")
    me = psutil.Process()
    tree = {me.pid} | {p.pid for p in me.children(recursive=True)}
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    mine = [
        (line.split()[3], line.split()[-1])
        for line in out.splitlines()
        if any(f"pid={pid}," in line for pid in tree)
    ]
    assert mine, "no listening socket found for this process tree"
    loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")
    return [(address, who) for address, who in mine if not address.startswith(loopback)]
