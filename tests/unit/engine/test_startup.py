"""A server's start split into phases (issue 16): milestones, missing phases, vLLM's figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimizer.engine.process import _LogTail
from optimizer.engine.startup import PHASES, StartupClock, phase_table_rows, phases_from_log

# The milestone lines of a GPU start of an 8B model (vLLM V1 on CUDA), with the seconds since
# launch at which each appeared; the text as vLLM writes it (prefixes shortened).
GPU_START = [
    (14.2, "(APIServer pid=1) INFO 12-01 10:00:14 [api_utils.py:286] non-default args: {...}"),
    (
        21.0,
        "(EngineCore_DP0 pid=2) INFO 12-01 10:00:21 [core.py:93] Initializing a V1 LLM "
        "engine (v0.26.0) with config: model='/models/llama8b'",
    ),
    (
        27.5,
        "(EngineCore_DP0 pid=2) INFO [gpu_model_runner.py:2602] Starting to load model "
        "/models/llama8b...",
    ),
    (30.1, "(EngineCore_DP0 pid=2) INFO [default_loader.py:267] Loading weights took 2.10 s"),
    (
        30.2,
        "(EngineCore_DP0 pid=2) INFO [gpu_model_runner.py:2653] Model loading took 14.99 GiB "
        "memory and 2.841 seconds",
    ),
    (36.0, "(EngineCore_DP0 pid=2) INFO [backends.py:559] Dynamo bytecode transform time: 5.90 s"),
    (57.0, "(EngineCore_DP0 pid=2) INFO [monitor.py:34] torch.compile takes 26.40 s in total"),
    (59.0, "(EngineCore_DP0 pid=2) INFO [gpu_worker.py:298] Available KV cache memory: 105.03 GiB"),
    (
        59.4,
        "(EngineCore_DP0 pid=2) INFO [kv_cache_utils.py:1087] GPU KV cache size: 860,432 tokens",
    ),
    (
        70.0,
        "(EngineCore_DP0 pid=2) INFO [gpu_model_runner.py:3480] Graph capturing finished in "
        "10 secs, took 0.84 GiB",
    ),
    (
        71.0,
        "(EngineCore_DP0 pid=2) INFO [core.py:210] init engine (profile, create kv cache, "
        "warmup model) took 43.40 seconds",
    ),
    (
        74.0,
        "(APIServer pid=1) INFO [api_server.py:1634] Starting vLLM API server 0 on "
        "http://127.0.0.1:8000",
    ),
    (74.6, "INFO:     Application startup complete."),
]


def test_a_gpu_start_splits_into_every_phase_in_order() -> None:
    doc = phases_from_log(GPU_START, healthy_s=75.0)
    phases = doc["phases"]
    assert list(phases) == list(PHASES[1:])  # every phase but the preload's, in order
    assert phases["imports"] == pytest.approx(14.2)
    assert phases["engine_start"] == pytest.approx(6.8)
    assert phases["weights"] == pytest.approx(2.6)  # first line that ends the phase counts
    assert phases["torch_compile"] == pytest.approx(57.0 - 30.1)
    assert phases["cuda_graphs"] == pytest.approx(10.6)
    assert phases["health"] == pytest.approx(75.0 - 74.0)
    assert sum(phases.values()) == pytest.approx(75.0)
    assert doc["reported"] == {
        "weights": 2.10,
        "torch_compile": 26.40,
        "cuda_graphs": 10.0,
        "engine_init": 43.40,
    }


def test_absent_phases_hand_their_time_to_the_next_phase_seen() -> None:
    # An eager start: no torch.compile, no CUDA graphs; a line of each is never written.
    eager = [x for x in GPU_START if "torch.compile" not in x[1] and "Graph capturing" not in x[1]]
    phases = phases_from_log(eager, healthy_s=75.0)["phases"]
    assert "torch_compile" not in phases and "cuda_graphs" not in phases
    assert phases["memory_profiling"] == pytest.approx(59.0 - 30.1)
    assert phases["engine_warmup"] == pytest.approx(71.0 - 59.4)
    assert sum(phases.values()) == pytest.approx(75.0)


def test_a_start_that_never_got_healthy_has_no_health_phase() -> None:
    clock = StartupClock()
    clock.feed([GPU_START[0][1], GPU_START[1][1]], 21.0)  # both seen at one poll
    assert clock.phases() == {"imports": 21.0, "engine_start": 0.0}


def test_compile_cache_hits_and_summed_compile_times_are_counted() -> None:
    clock = StartupClock()
    clock.feed(
        [
            "INFO [backends.py:296] Directly load the compiled graph(s) for compile range "
            "(1, 8192) from the cache, took 1.2 s",
            "INFO [monitor.py:62] torch.compile took 1.50 s in total",
            "INFO [monitor.py:62] torch.compile took 0.50 s in total",
        ],
        3.0,
    )
    assert clock.reported == {"compile_cache_hit": 1.0, "torch_compile": 2.0}


def test_the_table_adds_a_total() -> None:
    rows = phase_table_rows(phases_from_log(GPU_START, healthy_s=75.0))
    assert rows[0] == ("API server imports", "14.2", "")
    assert ("torch.compile", "26.9", "26.4") in rows
    assert rows[-1] == ("total (launch to healthy)", "75.0", "")


def test_the_log_tail_returns_complete_lines_only(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"# header written before launch\n")
    tail = _LogTail(log, offset=log.stat().st_size)
    assert tail.new_lines() == []
    with open(log, "ab") as f:
        f.write(b"first line\nsecond li")
    assert tail.new_lines() == ["first line"]
    with open(log, "ab") as f:
        f.write(b"ne\n")
    assert tail.new_lines() == ["second line"]
    assert _LogTail(tmp_path / "missing.log").new_lines() == []
