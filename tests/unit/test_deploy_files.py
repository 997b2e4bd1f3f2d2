"""The deployment templates parse and say what they must (they are not applied to a cluster
here: no Kubernetes in this environment)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def test_rayjob_runs_the_tuner_against_the_cluster_with_shared_storage() -> None:
    job = yaml.safe_load((DEPLOY / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"].startswith("ray.io/")
    assert job["spec"]["entrypoint"].split()[:3] == ["vllm-autotune", "tune", "/jobs/job.yaml"]
    assert "--ray-address auto" in job["spec"]["entrypoint"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    assert env["VLLM_AUTOTUNE_STORAGE"]["valueFrom"]["secretKeyRef"]["name"] == "autotune-db"
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][
        0
    ]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_ray_cluster_config_starts_head_and_workers() -> None:
    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("--address" in c for c in cfg["worker_start_ray_commands"])


def test_dockerfile_installs_the_tuner_on_a_vllm_base() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert "FROM ${VLLM_IMAGE}" in text and "vllm/vllm-openai" in text
    assert "pip install --no-cache-dir ." in text


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if "==" in spec:
            name, version = spec.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return out


def test_the_gpu_wheels_are_the_cpu_constraints_versions_and_carry_the_default_sampler() -> None:
    """What the GPU machine is staged with (benchmarks/gpu-requirements.txt) runs the versions
    the CPU venv was tested with, and holds SMAC's closure (the default sampler, rf)."""
    gpu = _pins(ROOT / "benchmarks" / "gpu-requirements.txt")
    cpu = _pins(ROOT / "deploy" / "constraints-cpu.txt")
    assert {n: v for n, v in gpu.items() if cpu.get(n) != v} == {}
    assert {"smac", "configspace", "scikit-learn", "dask", "distributed", "pynisher"} <= set(gpu)
    stage = (ROOT / "benchmarks" / "gpu_study.sh").read_text()
    # The two without a wheel are built first, at the versions of the requirements file.
    assert "grep -E '^(smac|pynisher)==' benchmarks/gpu-requirements.txt" in stage
