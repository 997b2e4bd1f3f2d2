"""The plan on one server, against the FAKE OpenAI server (a process of its own, no vLLM):
one timeline for records and samples, the server's process group sampled, verdicts from the
fake's metrics; and what a study folder keeps (stability.json, the export header's line, the
verdict table)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from objectives import parse_slo
from optimizer.export.command import _with_stability_note
from optimizer.export.render import ExportContext
from optimizer.stability.plan import PlanSettings, build_load, build_plan
from optimizer.stability.run import RunOutcome, Target, measure, progress_lines, write_outcome
from optimizer.stability.stored import STABILITY_FILE, header_note, stability_doc
from optimizer.stability.verdicts import Verdict
from optimizer.stability_check.command import verdict_table
from optimizer.types import Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayProgress
from tests.fakes.openai_stream_server import in_subprocess


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, int]]:
    with in_subprocess("--ttft-ms", "20", "--itl-ms", "2", new_session=True) as (url, process):
        yield url, os.getpgid(process.pid)


def test_measure_puts_records_and_samples_on_one_timeline(
    fake_server: tuple[str, int], tmp_path: Path
) -> None:
    url, pgid = fake_server
    settings = PlanSettings(
        sustained_s=3,
        burst_s=1,
        recovery_s=2,
        long_input_s=2,
        long_every_s=1,
        long_group=2,
        window_s=1,
        sample_interval_s=0.25,
        drain_grace_s=10,
    )
    plan = build_plan(settings, base_scale=1.0, burst_scale=3.0, max_model_len=512)
    trace = Trace(tuple(TraceRequest(0.25 * i, 32, 4) for i in range(4)), block_size=16)
    load = build_load(trace, plan)
    counter = iter(range(10_000))

    def metrics() -> dict[str, float]:  # one preemption per sample: the counter moves
        return {"vllm:num_preemptions_total": float(next(counter)), "vllm:kv_cache_usage_perc": 0.1}

    target = Target(
        model="fake-model",
        vocab=TokenRange(256, 1000),
        seed=1,
        slos=(parse_slo("p95_ttft_ms<=1000"), parse_slo("error_rate<=0.01")),
        max_send_lag_ms=math.inf,
    )
    out = measure(url, metrics, pgid, load, plan, target, label="fake", engine_args={"a": 1})
    assert len(out.records) == len(load.trace) and all(r.ok for r in out.records)
    assert out.samples[0].t_s < 0 < out.samples[-1].t_s  # sampled from before time zero
    assert out.samples[-1].t_s >= plan.duration_s - 0.5
    assert all(s.rss_mib and s.rss_mib > 1 for s in out.samples)
    assert all(s.gpu_mib is None for s in out.samples) or os.path.exists("/dev/nvidia0")
    v = {x.name: x for x in out.verdicts}
    assert v["long_inputs"].status == "pass" and v["long_inputs"].numbers["served"] == 4
    assert v["preemptions"].status == "fail"  # the fake's counter grows in every phase
    assert v["errors"].status == "pass" and v["recovery"].status == "pass"
    assert out.status == "unstable"
    assert out.phases["sustained"]["kv_usage_peak"] == 0.1
    assert out.phases["burst"]["rss_mib_mean"] > 1
    write_outcome(out, tmp_path)
    assert json.loads((tmp_path / "outcome.json").read_text())["requests"] == len(load.trace)
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(out.samples)


def _outcome(label: str, memory: str) -> RunOutcome:
    return RunOutcome(
        label=label,
        engine_args={},
        verdicts=[Verdict("memory_rss", memory, "slope [x]"), Verdict("spikes", "pass", "none")],
    )


def test_study_folder_keeps_the_check_and_export_quotes_it(tmp_path: Path) -> None:
    plan = build_plan(
        PlanSettings(sustained_s=120), base_scale=0.5, burst_scale=2, max_model_len=512
    )
    doc = stability_doc(
        3,
        plan,
        [_outcome("chosen", "fail"), _outcome("baseline", "pass")],
        folder=tmp_path,
        runs_dir=tmp_path / "stability" / "x",
    )
    assert doc["status"] == "unstable" and doc["runs_dir"] == "stability/x"
    assert [w.split(":")[0] for w in doc["worse_than_baseline"]] == ["memory_rss"]
    (tmp_path / STABILITY_FILE).write_text(json.dumps(doc))
    (line,) = header_note(tmp_path, 3)
    assert "2 min sustained at rate x0.5): unstable (failed: memory_rss)" in line
    assert "WORSE THAN THE BASELINE on memory_rss" in line
    assert header_note(tmp_path, 4) == ()  # another trial was checked
    assert header_note(tmp_path / "none", 3) == ()
    ctx = ExportContext(
        study="s", trial=3, model="m", args={}, vllm="v", hardware="h", trace="t", gain="g"
    )
    assert "NOTE: Stability check" in _with_stability_note(ctx, tmp_path, 3).header()
    console = Console(width=200, record=True)
    console.print(verdict_table(doc))
    text = console.export_text()
    assert "memory_rss" in text and "slope [x]" in text and "baseline" in text


def test_progress_lines_say_the_phase_every_30_s_and_once_at_the_end() -> None:
    plan = build_plan(
        PlanSettings(sustained_s=60, burst_s=10, recovery_s=30, long_input_s=20),
        base_scale=1.0,
        burst_scale=3.0,
        max_model_len=2048,
    )
    lines: list[str] = []
    on = progress_lines("chosen", plan, lines.append)
    for t in range(0, 121):  # a call a second, as the replay's progress would come
        done = min(t, 100)
        on(ReplayProgress(float(t), 100, done, done, 0, 0, 250.0 if t else None))
    on(ReplayProgress(121.0, 100, 100, 100, 0, 0, 250.0))  # a late call after the end
    assert [ln.split(",")[0] for ln in lines] == [
        "chosen: sustained at 0/120 s",
        "chosen: sustained at 30/120 s",
        "chosen: burst at 60/120 s",
        "chosen: recovery at 90/120 s",
        "chosen: long_input at 100/120 s",
    ]
    assert "100/100 done, 0 failed, P95 TTFT so far 250 ms" in lines[-1]
    assert "P95 TTFT so far -" in lines[0]
