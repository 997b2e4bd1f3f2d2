"""A 3-trial study through the RayRunner on a real GPU: each trial's actor gets one GPU from
Ray, its vLLM server runs on exactly that GPU, and the GPU is idle again after every trial."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from optimizer.config import load_job
from optimizer.runners import RayRunner
from optimizer.study import prepare
from optimizer.study_driver import StudyDriver, StudyEvent
from optimizer.types import TrialSpec
from tests.gpu.conftest import (
    GPU_SERVER_ENV,
    IDLE_SLACK_MIB,
    gpu_memory_used_mib,
    wait_gpu_idle,
)

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


class _Recording:
    """The RayRunner, recording each submitted trial's handle and GPU count."""

    def __init__(self, inner: RayRunner) -> None:
        self.inner = inner
        self.capacity = inner.capacity
        self.submitted: dict[int, tuple[Any, int]] = {}

    def submit(self, spec: TrialSpec, gpus: int) -> Any:
        handle = self.inner.submit(spec, gpus)
        self.submitted[spec.number] = (handle, gpus)
        return handle

    def cancel(self, handle: Any) -> None:
        self.inner.cancel(handle)

    def release(self, handle: Any) -> None:
        self.inner.release(handle)

    def close(self) -> None:
        self.inner.close()


class _ServerWatch(threading.Thread):
    """Finds the trial's vLLM API server process and samples GPU memory while it runs."""

    def __init__(self, model: Path) -> None:
        super().__init__(daemon=True)
        self.model = str(model)
        self.stop = threading.Event()
        self.servers: dict[int, dict[str, str | None]] = {}
        self.peak_mib: list[int] = []

    def run(self) -> None:
        while not self.stop.wait(1.0):
            used = gpu_memory_used_mib()
            self.peak_mib = [max(a, b) for a, b in zip(self.peak_mib or used, used, strict=True)]
            for p in psutil.process_iter(["cmdline"]):
                if p.pid in self.servers:
                    continue
                cmd = p.info["cmdline"] or []
                # The server itself, not its guard (whose argv carries the server's).
                if (
                    "vllm.entrypoints.openai.api_server" in cmd
                    and self.model in cmd
                    and "optimizer.engine.guard" not in cmd
                ):
                    try:
                        env = p.environ()
                    except psutil.Error:
                        continue
                    self.servers[p.pid] = {
                        "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES"),
                        "engine_id": env.get("VLLM_AUTOTUNE_ENGINE_ID"),
                    }


def test_three_trials_in_ray_actors_each_on_its_assigned_gpu(
    llama8b_model: Path, idle_gpu_mib: list[int], tmp_path: Path
) -> None:
    raw = {
        "name": "gpu-ray-study",
        "model": {"path": str(llama8b_model)},
        "engine": {
            "args": {"max-model-len": 8192, "enforce-eager": True},
            "env": GPU_SERVER_ENV,
            "startup_timeout_s": 600,
        },
        "gpus_per_trial": 1,
        "trace": {
            "path": str(REPO / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {"window_s": [190, 200], "max_model_len": 8192, "max_output_tokens": 32},
            "warmup_requests": 5,
            "max_duration_s": 90,
            "max_send_lag_ms": 100,
        },
        "search_space": {
            "name": "gpu-ci",
            "params": {
                "max-num-seqs": {"type": "int", "low": 16, "high": 256, "log": True},
                "enable-prefix-caching": {"type": "categorical", "choices": [True, False]},
            },
        },
        "objectives": {"preset": "default", "slos": ["p95_ttft_ms<=60000"]},
        "sampler": {"name": "random", "seed": 7},
        "trials": 3,
        "retries": 0,
        "out": str(tmp_path / "study"),
        "mlflow": {"enabled": False},
    }
    job, base = load_job(raw, base=tmp_path)
    plan = prepare(job, base)
    assert plan.vllm.startswith("vllm ")
    assert not plan.context.cpu_build
    runner = _Recording(RayRunner(capacity=1))
    assert runner.inner.cluster_gpus() >= 1

    seen: dict[int, dict[str, Any]] = {}
    watch: dict[int, _ServerWatch] = {}

    def on_event(ev: StudyEvent) -> None:
        if ev.kind == "started":
            handle, gpus = runner.submitted[ev.number]
            seen[ev.number] = {"gpus": gpus, "actor": runner.inner.environment(handle)}
            watch[ev.number] = _ServerWatch(llama8b_model)
            watch[ev.number].start()
        elif ev.kind == "finished":
            w = watch.pop(ev.number)
            w.stop.set()
            w.join()
            used, waited = wait_gpu_idle(idle_gpu_mib)
            seen[ev.number].update(
                servers=w.servers,
                peak_mib=w.peak_mib,
                after_mib=used,
                idle_after_s=waited,
                result=ev.result,
            )
            print(f"trial {ev.number}: {seen[ev.number]['actor']} servers {w.servers}")
            print(f"  GPU MiB peak {w.peak_mib} after {used} ({waited:.1f} s) idle {idle_gpu_mib}")

    driver = StudyDriver(plan, runner, on_event=on_event)
    try:
        study = driver.run()
    finally:
        for w in watch.values():
            w.stop.set()
        runner.close()

    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert trials[0].user_attrs["baseline"] is True
    assert sorted(seen) == [0, 1, 2]
    for number, obs in seen.items():
        result = obs["result"]
        assert result.status.value == "complete", (number, result.message, result.log_lines[-10:])
        assert result.summary["completed"] > 0 and result.summary["failed"] == 0
        assert result.memory.kv_cache_tokens > 0
        # Ray pinned the actor to one GPU and said so in its environment ...
        actor = obs["actor"]
        assert obs["gpus"] == 1
        assert len(actor["gpu_ids"]) == 1
        assert actor["cuda_visible_devices"] == ",".join(actor["gpu_ids"])
        # ... the actor's server inherited exactly that GPU ...
        assert len(obs["servers"]) == 1, obs["servers"]
        (server,) = obs["servers"].values()
        assert server["CUDA_VISIBLE_DEVICES"] == actor["cuda_visible_devices"]
        assert server["engine_id"]
        # ... and that physical GPU is where the memory went: weights + KV cache, gigabytes.
        gpu = int(actor["gpu_ids"][0])
        assert obs["peak_mib"][gpu] - idle_gpu_mib[gpu] > 20 * 1024
        # After the trial the GPU is idle again, before the next trial starts.
        assert obs["after_mib"][gpu] <= idle_gpu_mib[gpu] + IDLE_SLACK_MIB, obs
    # The sampler was told everything: three scored trials, the baseline among the feasible.
    assert all(len(t.values) == 3 for t in trials)
    assert all(t.user_attrs["status"] == "complete" for t in trials)
    assert optuna.load_study(study_name=job.name, storage=plan.storage_url).trials[0].params == {}
