"""A real study logged to a real MLflow tracking server on loopback: the parent run, one child
per trial with params and metrics, Pareto tags exactly on the feasible front, and the front's
artifacts on the parent, all read back through MLflow's REST API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
import yaml

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """``mlflow server`` on a free loopback port, SQLite backend, artifacts proxied to tmp."""
    port = _free_port()
    log = (tmp_path / "mlflow-server.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow-server.db'}",
            "--artifacts-destination",
            str(tmp_path / "mlflow-server-artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not become healthy"
            time.sleep(0.5)
        yield url
    finally:
        # The server runs in its own session: stop its whole group (workers included).
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _job(tmp_path: Path, tiny_model: Path, tracking_uri: str) -> dict[str, Any]:
    # The shape of tests/integration/test_study_cpu.py's job, shorter: 3 trials, 12 s of trace.
    return {
        "name": "ci-mlflow",
        "model": {"path": str(tiny_model)},
        "engine": {
            "args": {
                "max-model-len": 2048,
                "enforce-eager": True,
                "kv-cache-memory-bytes": 256 * 1024**2,
            },
            "startup_timeout_s": 600,
        },
        "trace": {
            "path": str(REPO / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {
                "window_s": [0, 12],
                "compress": 2.0,
                "max_model_len": 2048,
                "max_output_tokens": 24,
            },
            "warmup_requests": 2,
            "max_duration_s": 120,
            "max_send_lag_ms": 50,
        },
        "search_space": {
            "name": "ci",
            "params": {
                "max-num-seqs": {"type": "int", "low": 4, "high": 64, "log": True},
                "enable-prefix-caching": {"type": "categorical", "choices": [True, False]},
            },
        },
        "objectives": {"preset": "default", "slos": ["p95_ttft_ms<=60000"]},
        "sampler": {"name": "tpe", "seed": 3, "n_startup_trials": 2},
        "trials": 3,
        "out": str(tmp_path / "ci-mlflow"),
        "mlflow": {"tracking_uri": tracking_uri, "experiment": "ci-mlflow-review"},
    }


def _api(url: str, method: str, endpoint: str, **kw: Any) -> dict[str, Any]:
    resp = httpx.request(method, f"{url}/api/2.0/mlflow/{endpoint}", timeout=30, **kw)
    assert resp.status_code == 200, f"{endpoint}: {resp.status_code} {resp.text[:500]}"
    data: dict[str, Any] = resp.json()
    return data


def _artifacts(url: str, run_id: str, path: str = "") -> set[str]:
    params = {"run_id": run_id, **({"path": path} if path else {})}
    files = _api(url, "GET", "artifacts/list", params=params).get("files", [])
    return {f["path"] for f in files}


def test_real_study_is_reviewed_in_a_real_mlflow_server(
    tmp_path: Path, tiny_model: Path, vllm_install: object, mlflow_server: str
) -> None:
    job = _job(tmp_path, tiny_model, mlflow_server)
    job_path = tmp_path / "ci-mlflow.yaml"
    job_path.write_text(yaml.safe_dump(job))
    proc = subprocess.run(
        [sys.executable, "-m", "optimizer.cli", "tune", str(job_path), "--runner", "local"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1500,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "not fully logged" not in out, out[-4000:]

    study = optuna.load_study(
        study_name="ci-mlflow", storage=f"sqlite:///{tmp_path / 'ci-mlflow' / 'study.db'}"
    )
    trials = study.get_trials()
    assert len(trials) == 3
    front = {t.number for t in study.best_trials if all(v <= 0 for v in t.constraints.values())}
    assert front

    exp = _api(
        mlflow_server,
        "GET",
        "experiments/get-by-name",
        params={"experiment_name": "ci-mlflow-review"},
    )["experiment"]
    runs = _api(
        mlflow_server,
        "POST",
        "runs/search",
        json={"experiment_ids": [exp["experiment_id"]], "max_results": 100},
    )["runs"]

    def tags(run: dict[str, Any]) -> dict[str, str]:
        return {t["key"]: t["value"] for t in run["data"].get("tags", [])}

    parents = [r for r in runs if tags(r).get("vllm_autotune.role") == "study"]
    children = [r for r in runs if tags(r).get("vllm_autotune.role") == "trial"]
    assert len(parents) == 1
    parent = parents[0]
    parent_id = parent["info"]["run_id"]
    assert parent["info"]["status"] == "FINISHED"
    assert tags(parent)["vllm_autotune.study"] == "ci-mlflow"

    by_trial = {int(tags(r)["vllm_autotune.trial"]): r for r in children}
    assert len(by_trial) == len(children) == 3
    assert set(by_trial) == {t.number for t in trials}
    for t in trials:
        run = by_trial[t.number]
        tg = tags(run)
        params = {p["key"]: p["value"] for p in run["data"].get("params", [])}
        metrics = {m["key"]: m["value"] for m in run["data"].get("metrics", [])}
        assert tg["mlflow.parentRunId"] == parent_id
        assert tg["pareto"] == ("true" if t.number in front else "false")
        assert tg["baseline"] == ("true" if t.user_attrs.get("baseline") else "false")
        assert tg["state"] == t.user_attrs["status"]
        assert params["trial_number"] == str(t.number)
        assert "max-num-seqs" in params and params["sampler"] == "tpe"
        if t.user_attrs["status"] == "complete":
            assert metrics["p95_ttft_ms"] > 0 and metrics["output_throughput"] > 0
            assert metrics["kv_cache_tokens"] > 0 and "startup_s" in metrics
            files = _artifacts(mlflow_server, run["info"]["run_id"])
            assert {"records.jsonl.gz", "engine.log", "plots"} <= files

    top = _artifacts(mlflow_server, parent_id)
    assert {"pareto", "report.md", "importance.json", "inputs"} <= top
    pareto = _artifacts(mlflow_server, parent_id, "pareto")
    assert {"pareto/front.json", "pareto/front.csv"} <= pareto
    assert any(p.endswith(".png") for p in pareto)
    hv = _api(
        mlflow_server,
        "GET",
        "metrics/get-history",
        params={"run_id": parent_id, "metric_key": "hypervolume"},
    )["metrics"]
    complete = {t.number for t in trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert {int(m["step"]) for m in hv} == complete
