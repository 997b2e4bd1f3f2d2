"""A Ray already registered on the machine (issue 45, item 6): ``ray start`` (here a real
``ray.cluster_utils.Cluster`` on loopback) registers its address in ``ray_current_cluster``,
and the file outlives the cluster. ``ray.init()`` without an address joins whatever it names,
so a study without ``--ray-address`` landed on someone else's cluster or crashed ("When
connecting to an existing cluster, object_store_memory must not be provided"), and a Ray call
made outside an actor (``ray.get_gpu_ids()`` in the placement record) waited on a dead
cluster's GCS for as long as pytest let it. Each test runs with the registered cluster live
and dead (its processes killed, the file left); trials run on the real Ray runner with the
engine FAKE (tests/fakes/trials.py), never a vLLM server."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from optimizer.errors import ConfigError
from optimizer.runners import RayRunner, _TrialActor, own_node_alive, start_ray
from optimizer.types import TrialStatus
from tests.fakes.gated import tiny_spec
from tests.fakes.trials import gpu_recording_engine
from tests.integration.loopback_cluster import (
    ray_temp_dir,
    registered_address,
    start_cluster,
    stop_cluster,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ray = pytest.importorskip("ray")


@dataclass
class Registered:
    """The cluster the machine registered: its address, and the cluster while it lives."""

    address: str
    cluster: Any
    live: bool

    def drivers(self) -> list[int]:
        """Pids of the drivers that ever joined it (none known once it is dead)."""
        if not self.live:
            return []
        return [job["DriverPid"] for job in self.cluster.global_state.job_table()]


class _Machine:
    """The machine's registered cluster, started once for the module: live, then killed."""

    def __init__(self, temp: Path) -> None:
        self.temp = temp
        self.cluster: Any = None
        self.address = ""

    def live(self) -> Registered:
        if self.cluster is None or self.cluster.head_node is None:
            self.stop()
            self.cluster, _ = start_cluster({"num_cpus": 1})
            self.address = self.cluster.address
        assert registered_address(self.temp) == self.address
        return Registered(self.address, self.cluster, live=True)

    def dead(self) -> Registered:
        if self.cluster is None or self.cluster.head_node is None:
            self.live()
        self.cluster.remove_node(self.cluster.head_node)  # killed, as a crash leaves it
        assert registered_address(self.temp) == self.address
        return Registered(self.address, self.cluster, live=False)

    def stop(self) -> None:
        if self.cluster is not None:
            stop_cluster(self.cluster)
            self.cluster = None


@pytest.fixture(scope="module")
def machine() -> Iterator[_Machine]:
    if ray.is_initialized():
        ray.shutdown()
    with ray_temp_dir() as temp:
        held = _Machine(temp)
        try:
            yield held
        finally:
            held.stop()


@pytest.fixture(scope="module", params=["live", "dead"])
def registered(request: pytest.FixtureRequest, machine: _Machine) -> Registered:
    """The registered cluster, live or dead (the module's tests run live first)."""
    return machine.live() if request.param == "live" else machine.dead()


@pytest.fixture(autouse=True)
def _disconnected() -> Iterator[None]:
    """Each test starts and ends connected to no Ray."""
    if ray.is_initialized():
        ray.shutdown()
    try:
        yield
    finally:
        ray.shutdown()


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or a test failure when it has not returned in ``seconds`` (a call
    waiting on a dead cluster never returns on its own)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds:g} s (on a registered cluster?)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_without_an_address_a_study_runs_on_a_cluster_of_its_own(
    registered: Registered, tmp_path: Path
) -> None:
    """The runner `tune` builds without --ray-address starts a private cluster and runs its
    trial there; the registered cluster is neither joined nor replaced as the machine's."""
    drivers = registered.drivers()
    runner = RayRunner(capacity=1, engine_factory=gpu_recording_engine)
    try:
        assert ray.get_runtime_context().gcs_address != registered.address
        handle = runner.submit(tiny_spec(tmp_path / "trial-0", 0), 0)
        result = handle.future.result(timeout=120)
        runner.release(handle)
        assert result.status is TrialStatus.COMPLETE, result.message
        placed = json.loads((tmp_path / "trial-0" / "placement.json").read_text())
        mine = [n["NodeID"] for n in ray.nodes()]
        assert placed["node_id"] in mine, placed
        assert registered.drivers() == drivers
    finally:
        runner.close()
        ray.shutdown()
    assert registered_address(Path(os.environ["RAY_TMPDIR"])) == registered.address


def test_a_cluster_is_joined_only_when_asked(registered: Registered) -> None:
    """--ray-address auto (or the address) joins the registered cluster when it lives; a dead
    one is a clear error at once, naming the address, never a wait on its GCS."""
    if registered.live:
        for asked in ("auto", registered.address):
            start_ray(asked, log_to_driver=False)
            try:
                assert ray.get_runtime_context().gcs_address == registered.address
                assert os.getpid() in registered.drivers()
            finally:
                ray.shutdown()
        return
    for asked in ("auto", registered.address):
        answers = f"no Ray cluster answers at .*{re.escape(registered.address)}"
        with pytest.raises(ConfigError, match=answers):
            _within(60, lambda asked=asked: start_ray(asked, log_to_driver=False))
        assert not ray.is_initialized()


def test_no_ray_call_outside_an_actor_starts_or_joins_a_cluster(
    registered: Registered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial actor's class run without Ray (as test_engine's preload test runs it) records
    its placement without Ray's GPU ids; Ray's auto-init is off once the runners' Ray is
    loaded, so a Ray call before `start_ray` raises at once instead of joining the registered
    cluster (or waiting on a dead one); the cluster-health probe answers no."""
    from ray._private import auto_init_hook

    # As in a fresh interpreter: Ray's auto-init on until the runners' Ray is loaded.
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", True)
    drivers = registered.drivers()
    actor = _TrialActor(engine_factory=gpu_recording_engine)
    result = _within(120, lambda: actor.run(tiny_spec(tmp_path / "trial-0", 0)))
    assert result.status is TrialStatus.COMPLETE, result.message
    assert not ray.is_initialized()
    placed = json.loads((tmp_path / "trial-0" / "placement.json").read_text())
    assert placed["ray_gpu_ids"] == [] and placed["node_id"] is None, placed
    with pytest.raises(ray.exceptions.RaySystemError, match="not been started"):
        _within(60, ray.get_gpu_ids)
    assert _within(60, lambda: own_node_alive(timeout_s=30)) is False
    assert not ray.is_initialized()
    assert registered.drivers() == drivers
