"""Two drivers of one study on two nodes of a Ray cluster (issue 45, item 3): a real
``ray.cluster_utils.Cluster`` on loopback (a head that declares no CPUs, two worker nodes), each
driver a Ray actor pinned to a worker of its own, both started at once on one study in one
storage (PostgreSQL where CI provides it, ``VLLM_AUTOTUNE_TEST_POSTGRES``; else an SQLite file
every node of this machine sees) with the same sampler seed, so that both enqueue a baseline
and propose the same configurations in the same order. Their trials run in actors the cluster
places, each engine a FAKE (tests/fakes/gated.py, :class:`QuickEngines`: the fake OpenAI
server). One baseline, no configuration measured twice, no trial left running, the trial count
kept, and both drivers' trials measured."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from optimizer.trial_view import TrialView
from tests.integration.loopback_cluster import ray_temp_dir, start_cluster, stop_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
TRIALS = 6


class _Driver:
    """A study's driver in a Ray actor (the test's own wrapper around the real StudyDriver
    and RayRunner, whose trials run fake engines: ones that end by themselves, or with
    ``held`` ones that hold each trial until a file releases it)."""

    def run(
        self, job_doc: dict[str, Any], base: str, held: bool = False, go: str | None = None
    ) -> str:
        """Prepare the study, then (with ``go``) say so in ``go``.ready-<node> and wait for
        the file ``go`` before driving it: both drivers then start at once, however long
        their actors took to start."""
        from optimizer.config import load_job
        from optimizer.runners import RayRunner
        from optimizer.study import prepare
        from optimizer.study_driver import StudyDriver
        from tests.fakes.gated import FileGatedEngines, QuickEngines

        job, where = load_job(job_doc, base=Path(base))
        plan = prepare(job, where, check_flags=False)
        engines = FileGatedEngines() if held else QuickEngines()
        runner = RayRunner(capacity=1, cpus_per_trial=0.25, engine_factory=engines)
        if go is not None:
            node = ray.get_runtime_context().get_node_id()
            Path(f"{go}.ready-{node}").touch()
            while not Path(go).exists():
                time.sleep(0.05)
        try:
            StudyDriver(plan, runner, heartbeat_interval_s=1, grace_period_s=5).run()
        finally:
            runner.close()
        return str(ray.get_runtime_context().get_node_id())


@pytest.fixture
def cluster() -> Iterator[tuple[Any, list[Any]]]:
    if ray.is_initialized():
        ray.shutdown()
    with ray_temp_dir():
        cluster, workers = start_cluster(
            {"num_cpus": 0, "num_gpus": 0},
            {"num_cpus": 1, "num_gpus": 0},
            {"num_cpus": 1, "num_gpus": 0},
        )
        try:
            yield cluster, workers
        finally:
            stop_cluster(cluster)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _job(tmp_path: Path, storage: str) -> dict[str, Any]:
    return {
        "name": f"two-drivers-{uuid.uuid4().hex[:8]}",
        "model": {"path": str(tmp_path / "model"), "make": "tiny"},
        "engine": {"args": {"max-model-len": 2048}},
        "trace": {
            "path": str(REPO / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {"window_s": [0, 3], "max_model_len": 2048, "max_output_tokens": 4},
            "warmup_requests": 0,
            "max_send_lag_ms": 5000,
        },
        "search_space": {
            "name": "t",
            "params": {"max-num-seqs": {"type": "categorical", "choices": [4, 8, 16, 32, 64]}},
        },
        "objectives": {"preset": "default"},
        "sampler": {"name": "random", "seed": 7},
        "trials": TRIALS,
        "storage": storage,
        "mlflow": {"enabled": False},
        "out": str(tmp_path / "out"),
    }


def test_two_drivers_on_two_nodes_share_one_study(
    cluster: tuple[Any, list[Any]], tmp_path: Path
) -> None:
    the_cluster, workers = cluster
    storage = os.environ.get("VLLM_AUTOTUNE_TEST_POSTGRES") or f"sqlite:///{tmp_path / 'db'}"
    job = _job(tmp_path, storage)
    ray.init(address=the_cluster.address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0)(_Driver)
    drivers = [
        actor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(w.node_id, soft=False)
        ).remote()
        for w in workers
    ]
    go = tmp_path / "go"
    runs = [d.run.remote(job, str(tmp_path), False, str(go)) for d in drivers]
    deadline = time.monotonic() + 180
    while len(list(tmp_path.glob("go.ready-*"))) < len(drivers):
        assert time.monotonic() < deadline, "the drivers did not get ready"
        time.sleep(0.1)
    go.touch()  # both at once: each enqueues a baseline and proposes with one seed
    ran_on = ray.get(runs, timeout=400)
    assert sorted(ran_on) == sorted(w.node_id for w in workers)

    study = optuna.load_study(study_name=job["name"], storage=storage)
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    measured = [t for t in trials if t.state == TrialState.COMPLETE]
    keys = [TrialView(t).engine_args_key for t in measured]
    assert len(keys) == len(set(keys)), keys
    assert sum(1 for t in measured if TrialView(t).is_baseline) == 1
    duplicates = [t for t in trials if TrialView(t).status == "duplicate"]
    assert TRIALS <= len(measured) + len(duplicates) <= TRIALS + 1
    pids = {(t.system_attrs["driver"]["host"], t.system_attrs["driver"]["pid"]) for t in measured}
    assert len(pids) == 2, pids


def test_a_study_whose_drivers_node_dies_resumes_with_another_driver(
    cluster: tuple[Any, list[Any]], tmp_path: Path
) -> None:
    """Issue 45, item 2: the driver's node lost mid-trial (removed whole, the driver with it);
    a driver on the other node resumes the study from its storage: the dead driver's trial is
    failed (``driver_died``) and its configuration re-queued, and no configuration is measured
    twice."""
    the_cluster, (first_node, second_node) = cluster
    storage = os.environ.get("VLLM_AUTOTUNE_TEST_POSTGRES") or f"sqlite:///{tmp_path / 'db'}"
    job = _job(tmp_path, storage)
    ray.init(address=the_cluster.address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def driver_on(node: Any) -> Any:
        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        return ray.remote(num_cpus=0)(_Driver).options(scheduling_strategy=strategy).remote()

    first = driver_on(first_node)
    first.run.remote(job, str(tmp_path), True)  # its trials hold until released: never here
    started = tmp_path / "out" / "trials" / "0000" / "attempt-0" / "started.json"
    deadline = time.monotonic() + 120
    while not started.exists():
        assert time.monotonic() < deadline, "the first driver's baseline never started"
        time.sleep(0.2)
    dead = optuna.load_study(study_name=job["name"], storage=storage).trials[0]
    pid = dead.system_attrs["driver"]["pid"]
    the_cluster.remove_node(first_node, allow_graceful=False)
    # The next driver fails a dead driver's trials when it starts: on this host by the dead
    # driver's pid (gone once its node is), elsewhere by Optuna's heartbeat (after its grace).
    deadline = time.monotonic() + 60
    while _alive(pid):
        assert time.monotonic() < deadline, f"the first driver (pid {pid}) outlived its node"
        time.sleep(0.2)

    ray.get(driver_on(second_node).run.remote(job, str(tmp_path)), timeout=300)
    trials = optuna.load_study(study_name=job["name"], storage=storage).get_trials()
    assert trials[0].state == TrialState.FAIL
    assert TrialView(trials[0]).status == "driver_died"
    assert not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    measured = [t for t in trials if t.state == TrialState.COMPLETE]
    keys = [TrialView(t).engine_args_key for t in measured]
    assert len(keys) == len(set(keys)), keys
    baselines = [t for t in measured if TrialView(t).is_baseline]
    assert len(baselines) == 1 and baselines[0].user_attrs.get("retry_of") == 0
