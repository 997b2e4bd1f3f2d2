"""A trial's Ray node lost mid-trial (issue 45, item 2): a real ``ray.cluster_utils.Cluster``
on loopback, a head that declares no CPUs and no GPUs and two worker nodes of one logical GPU
each, the runner ``tune --ray-address`` builds (:class:`optimizer.runners.RayRunner`), and each
trial's engine a FAKE (tests/fakes/gated.py, :class:`FileGatedEngine`) that writes where it
started (node, actor pid) into its trial folder and holds its trial until a file there releases
it, making no Ray call meanwhile, as a real trial's actor makes none while it replays.

First only a worker's raylet is killed, the machine (and the trial actor's process) left
alive: before, the trial came back as an ``ActorDiedError`` the study told as a failed
configuration, and the actor's process lived on for minutes, reparented to init, with its
vLLM server. Now the actor exits within seconds (the engine guard then stops a real server's
process group) and the trial comes back as :class:`~optimizer.errors.TrialNodeLost`, naming
the node; the same trial submitted once more runs on the node that is alive. Then that node
is removed whole (every process of it): the trial on it is lost the same way. What the study
does with a lost trial (runs it once more, never tells it as a failure) is tested with a
FAKE runner in tests/unit/test_study_loop.py."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from optimizer.errors import TrialNodeLost
from optimizer.runners import RayRunner
from optimizer.types import TrialStatus
from tests.fakes.gated import FileGatedEngines, tiny_spec
from tests.integration.loopback_cluster import ray_temp_dir, start_cluster, stop_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ray = pytest.importorskip("ray")

#: Long enough for a trial actor to start on this loaded two-core machine.
ARRIVAL_S = 120.0
#: How soon a lost node's trial must come back (the cluster marks a silent node dead by its
#: health checks, Ray's defaults here: a node taken away whole shows first as an unreachable
#: actor, and the verdict on its node is awaited), and its orphaned actor end.
LOST_S = 150.0
ACTOR_GONE_S = 10.0


@pytest.fixture
def cluster() -> Iterator[tuple[Any, list[Any]]]:
    if ray.is_initialized():
        ray.shutdown()
    with ray_temp_dir():
        cluster, workers = start_cluster(
            {"num_cpus": 0, "num_gpus": 0},
            {"num_cpus": 2, "num_gpus": 1},
            {"num_cpus": 2, "num_gpus": 1},
        )
        try:
            yield cluster, workers
        finally:
            stop_cluster(cluster)


def _started(workdir: Path) -> dict[str, Any]:
    """Where the trial of ``workdir`` started (its engine's note), once it has."""
    path = workdir / "started.json"
    t0 = time.monotonic()
    while not path.exists():
        assert time.monotonic() - t0 < ARRIVAL_S, f"{workdir.name} did not start in {ARRIVAL_S:g} s"
        time.sleep(0.2)
    note: dict[str, Any] = json.loads(path.read_text())
    return note


def _gone_within(pid: int, seconds: float) -> float | None:
    """Seconds until process ``pid`` is gone (None: still alive after ``seconds``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - t0
        except psutil.NoSuchProcess:
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def test_a_trial_whose_node_dies_comes_back_lost_and_its_actor_ends(
    cluster: tuple[Any, list[Any]], tmp_path: Path
) -> None:
    the_cluster, workers = cluster
    by_id = {w.node_id: w for w in workers}
    runner = RayRunner(
        the_cluster.address, capacity=2, cpus_per_trial=0.25, engine_factory=FileGatedEngines()
    )
    orphans: list[int] = []
    try:
        # 1. Only the raylet of the trial's node dies; the machine lives.
        t1 = tmp_path / "t1" / "attempt-0"
        first = runner.submit(tiny_spec(t1, 1), 1)
        note = _started(t1)
        lost_node = by_id[note["node_id"]]
        lost_node.kill_raylet()
        with pytest.raises(TrialNodeLost) as caught:
            first.future.result(timeout=LOST_S)
        assert caught.value.node_id == note["node_id"]
        assert note["node_id"] in str(caught.value)
        gone = _gone_within(note["pid"], ACTOR_GONE_S)
        if gone is None:
            orphans.append(note["pid"])
        assert gone is not None, f"trial 1's actor (pid {note['pid']}) outlived its raylet"
        print(f"\nraylet killed: trial lost ({caught.value}); its actor ended after {gone:.1f} s")
        runner.release(first)

        # 2. The same configuration, once more: it runs on the node that is alive.
        t1b = tmp_path / "t1" / "attempt-1"
        again = runner.submit(tiny_spec(t1b, 1), 1)
        note = _started(t1b)
        assert note["node_id"] != lost_node.node_id
        (t1b / "release").touch()
        assert again.future.result(timeout=ARRIVAL_S).status is TrialStatus.COMPLETE
        runner.release(again)

        # 3. That node removed whole, mid-trial: lost the same way.
        live = by_id[note["node_id"]]
        t2 = tmp_path / "t2" / "attempt-0"
        second = runner.submit(tiny_spec(t2, 2), 1)
        note = _started(t2)
        assert note["node_id"] == live.node_id
        the_cluster.remove_node(live, allow_graceful=False)
        with pytest.raises(TrialNodeLost) as caught:
            second.future.result(timeout=LOST_S)
        assert caught.value.node_id == live.node_id
        assert _gone_within(note["pid"], ACTOR_GONE_S) is not None
        runner.release(second)
    finally:
        runner.close()
        for pid in orphans:  # never leave one behind, even when the test fails
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
