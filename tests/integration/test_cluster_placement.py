"""Trials placed on a Ray cluster of several nodes (issue 45, item 1): a real
``ray.cluster_utils.Cluster`` on loopback, a head that declares no CPUs and no GPUs, and two
worker nodes declaring GPUs as GPU nodes would (``num_gpus``: 2 on one, 1 on the other; logical
GPUs on this CPU machine). The runner `tune --ray-address` builds
(:class:`optimizer.runners.RayRunner` with the cluster's address) runs each trial in an actor
that asks for its GPUs; each trial's engine is a FAKE (tests/fakes/gated.py) that tells a gate
actor where it started and holds its GPUs until the test releases it, so which trials run at
once, and where, is known from events, not from the clock."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from optimizer.errors import ConfigError
from optimizer.runners import RayRunner
from optimizer.types import TrialResult, TrialStatus
from tests.fakes.gated import Gate, GatedEngines, tiny_spec
from tests.integration.loopback_cluster import (
    LOOPBACK,
    listening_off_loopback,
    ray_temp_dir,
    start_cluster,
    stop_cluster,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ray = pytest.importorskip("ray")

#: Where the gate lives: a named actor the trials' engines find.
GATE = "placement-gate"
NAMESPACE = "tests"
#: Long enough for a trial actor to start on this loaded two-core machine.
ARRIVAL_S = 120.0


@dataclass
class Fleet:
    """The cluster: its head's node id, and each worker's node id and declared GPUs."""

    cluster: Any
    head: str
    gpus: dict[str, int]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    if ray.is_initialized():
        ray.shutdown()
    with ray_temp_dir():
        declared = (2, 1)
        cluster, workers = start_cluster(
            {"num_cpus": 0, "num_gpus": 0},
            *({"num_cpus": 2, "num_gpus": gpus} for gpus in declared),
        )
        try:
            gpus = {node.node_id: n for node, n in zip(workers, declared, strict=True)}
            yield Fleet(cluster, cluster.head_node.node_id, gpus)
        finally:
            stop_cluster(cluster)


@dataclass
class Trials:
    """A runner on the fleet, the gate its trials report to, and their folders."""

    runner: RayRunner
    gate: Any
    root: Path

    def submit(self, number: int, gpus: int) -> Any:
        return self.runner.submit(tiny_spec(self.root / f"trial-{number}", number), gpus)

    def started(self, number: int) -> dict[str, Any]:
        note = ray.get(self.gate.started.remote(number, ARRIVAL_S))
        assert note is not None, f"trial {number} did not start in {ARRIVAL_S:g} s"
        return note  # type: ignore[no-any-return]

    def arrivals(self) -> list[int]:
        return ray.get(self.gate.arrivals.remote())  # type: ignore[no-any-return]

    def finish(self, number: int, handle: Any) -> TrialResult:
        ray.get(self.gate.release.remote(number))
        result: TrialResult = handle.future.result(timeout=ARRIVAL_S)
        self.runner.release(handle)
        return result

    def placement(self, number: int) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(
            (self.root / f"trial-{number}" / "placement.json").read_text()
        )
        return doc


@pytest.fixture
def trials(fleet: Fleet, tmp_path: Path) -> Iterator[Trials]:
    runner = RayRunner(
        fleet.cluster.address,
        capacity=4,
        cpus_per_trial=0.25,
        engine_factory=GatedEngines(GATE, NAMESPACE),
    )
    gate = (
        ray.remote(Gate)
        .options(name=GATE, namespace=NAMESPACE, num_cpus=0, max_concurrency=64)
        .remote()
    )
    try:
        yield Trials(runner, gate, tmp_path)
    finally:
        runner.close()
        ray.kill(gate)
        ray.shutdown()


def _ids(note: dict[str, Any]) -> set[str]:
    return {g for g in note["cuda_visible_devices"].split(",") if g}


def test_trials_land_on_the_workers_packed_by_their_gpus(fleet: Fleet, trials: Trials) -> None:
    """Joined with the cluster's address, the runner places every trial on a worker (never on
    the head, which declares no GPUs), as many at once as the declared GPUs allow, trials of
    one and two GPUs side by side: a two-GPU trial waiting for GPUs held by another does not
    hold back a one-GPU trial that fits on the other worker, and gets its GPUs once they are
    freed (no deadlock). Trials held at once on a node never share a GPU, each sees exactly
    the GPUs it asked for, and placement.json names the node each ran on as Ray reports it."""
    assert ray.get_runtime_context().gcs_address == fleet.cluster.address
    big, small = list(fleet.gpus)  # two GPUs, one GPU
    sizes: dict[int, int] = {}
    notes: dict[int, dict[str, Any]] = {}
    handles: dict[int, Any] = {}

    def submit(number: int, gpus: int) -> None:
        sizes[number] = gpus
        handles[number] = trials.submit(number, gpus)

    # A two-GPU trial takes the two-GPU worker; a second one waits for it; a one-GPU trial
    # meanwhile runs on the other worker.
    submit(0, 2)
    notes[0] = trials.started(0)
    submit(1, 2)
    submit(2, 1)
    notes[2] = trials.started(2)
    assert notes[0]["node_id"] == big and notes[2]["node_id"] == small
    assert 1 not in trials.arrivals()  # both of the two-GPU worker's GPUs are trial 0's
    results = {0: trials.finish(0, handles[0])}
    notes[1] = trials.started(1)
    assert notes[1]["node_id"] == big
    results |= {n: trials.finish(n, handles[n]) for n in (1, 2)}

    # Three one-GPU trials and a CPU-only one (no GPU): all four at once on three GPUs.
    for number, gpus in ((3, 1), (4, 1), (5, 1), (6, 0)):
        submit(number, gpus)
    held = {n: trials.started(n) for n in (3, 4, 5, 6)}
    notes |= held
    on_big = [n for n in (3, 4, 5) if held[n]["node_id"] == big]
    on_small = [n for n in (3, 4, 5) if held[n]["node_id"] == small]
    assert len(on_big) == 2 and len(on_small) == 1, held
    assert not _ids(held[on_big[0]]) & _ids(held[on_big[1]]), held
    assert held[6]["node_id"] in fleet.gpus and _ids(held[6]) == set(), held[6]
    assert listening_off_loopback() == []  # every Ray server of the fleet, on loopback
    results |= {n: trials.finish(n, handles[n]) for n in (3, 4, 5, 6)}

    for number, result in results.items():
        assert result.status is TrialStatus.COMPLETE, (number, result.message)
        note, placed = notes[number], trials.placement(number)
        assert len(_ids(note)) == sizes[number], (number, note)
        assert placed["node_id"] == note["node_id"] != fleet.head, (number, placed)
        assert placed["node_ip"] == LOOPBACK, placed
        assert placed["node_hostname"] == socket.gethostname(), placed
        assert placed["cuda_visible_devices"] in (note["cuda_visible_devices"], None), placed
        assert len(placed["ray_gpu_ids"]) == sizes[number], placed


def test_a_node_that_does_not_see_a_path_fails_the_trial_before_anything_starts(
    fleet: Fleet, trials: Trials, tmp_path: Path
) -> None:
    """Issue 45, item 4: a trial checks, once it lands on a node, that the node sees the
    study folder and the model at the paths the driver saw them: where one is missing the
    trial fails with an error naming each missing path and the node (IP, hostname and Ray
    node id), before any server starts and without writing anything there. Here the driver
    sees both when it submits the trial, which waits for a GPU; both are gone when it lands
    (the trace travels in the trial's spec: nothing to see)."""
    big, small = list(fleet.gpus)
    held = {0: trials.submit(0, 2), 1: trials.submit(1, 1)}  # every GPU of the fleet
    assert trials.started(0)["node_id"] == big and trials.started(1)["node_id"] == small
    study, model = tmp_path / "study", tmp_path / "model"
    study.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = tiny_spec(study / "trials" / "0007" / "attempt-0", 7, model=str(model))
    waiting = trials.runner.submit(spec, 1)
    shutil.rmtree(study)
    shutil.rmtree(model)
    trials.finish(1, held[1])  # the one-GPU worker's GPU is free: trial 7 lands there
    with pytest.raises(ConfigError) as info:
        waiting.future.result(timeout=ARRIVAL_S)
    trials.runner.release(waiting)
    message = str(info.value)
    assert f"the study folder {study} nor the model {model}" in message, message
    assert f"Ray node {LOOPBACK} ({socket.gethostname()}, node id {small})" in message, message
    assert not study.exists()  # nothing written on the node
    assert 7 not in trials.arrivals()  # no server started
    assert trials.finish(0, held[0]).status is TrialStatus.COMPLETE
