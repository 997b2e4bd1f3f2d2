"""EngineProcess on a real GPU: a Llama-3.1-8B-shaped server with dummy weights, up and down."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from optimizer.engine.process import EngineProcess, group_alive_pids
from optimizer.types import EngineConfig
from tests.gpu.conftest import (
    GPU_SERVER_ENV,
    IDLE_SLACK_MIB,
    gpu_memory_total_mib,
    gpu_memory_used_mib,
    wait_gpu_idle,
)

pytestmark = pytest.mark.gpu

# 8.03 B parameters in bf16: 14.96 GiB of weights.
LLAMA8B_WEIGHTS_GIB = 8.03e9 * 2 / 1024**3


def test_llama8b_server_starts_on_the_gpu_streams_and_frees_it(
    llama8b_model: Path, idle_gpu_mib: list[int], tmp_path: Path
) -> None:
    config = EngineConfig(
        model=str(llama8b_model),
        args={
            "load-format": "dummy",
            "max-model-len": 8192,
            "max-num-seqs": 64,
            "max-num-batched-tokens": 8192,
            "gpu-memory-utilization": 0.9,
            # The start is what is measured here, not the kernels: skip torch.compile.
            "enforce-eager": True,
        },
        env=GPU_SERVER_ENV,
    )
    engine = EngineProcess(config, log_path=tmp_path / "server.log", startup_timeout_s=600)
    with engine:
        pgid = engine.pgid
        assert pgid is not None
        assert engine.startup_s is not None
        print(f"startup {engine.startup_s:.1f} s")
        # The weights and the KV cache live on the GPU: most of the 0.9 share vLLM was given.
        used = gpu_memory_used_mib()
        print(f"GPU memory in use while serving: {used} MiB (idle {idle_gpu_mib})")
        assert used[0] - idle_gpu_mib[0] > 0.8 * 0.9 * gpu_memory_total_mib()[0]
        account = engine.memory_account()
        print("memory account", account)
        assert account.weights_gib == pytest.approx(LLAMA8B_WEIGHTS_GIB, rel=0.03)
        # Llama-3.1-8B: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 128 KiB a token.
        assert account.kv_cache_tokens is not None and account.kv_cache_gib is not None
        per_token = account.kv_cache_gib * 1024**3 / account.kv_cache_tokens
        assert per_token == pytest.approx(128 * 1024, rel=0.02)
        assert account.max_model_len == 8192
        assert account.max_concurrency == pytest.approx(account.kv_cache_tokens / 8192, rel=0.01)
        reported = engine.cache_config()
        assert int(reported["num_gpu_blocks"]) * int(reported["block_size"]) == (
            account.kv_cache_tokens
        )

        # One visible chunk per generated token (DESIGN.md §7.11), on the GPU build too.
        n = 64
        body = {
            "model": str(llama8b_model),
            "prompt": list(range(1000, 1512)),
            "max_tokens": n,
            "ignore_eos": True,
            "stream": True,
            "skip_special_tokens": False,
            "stream_options": {"include_usage": True},
        }
        texts: list[str] = []
        usage = None
        with httpx.stream("POST", f"{engine.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("choices"):
                    texts.append(event["choices"][0]["text"])
                if event.get("usage"):
                    usage = event["usage"]
        assert usage is not None
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (512, n)
        assert len(texts) == n and all(t != "" for t in texts)
        metrics = engine.scrape_metrics()
        assert metrics["vllm:num_preemptions_total"] == 0
    assert group_alive_pids(pgid) == []
    used, waited = wait_gpu_idle(idle_gpu_mib)
    print(f"GPU memory after stop: {used} MiB (idle {idle_gpu_mib}), after {waited:.1f} s")
    assert used[0] <= idle_gpu_mib[0] + IDLE_SLACK_MIB
