"""Plots of a stability run from what it stored: rolling percentiles on SYNTHETIC records, SLO
lines, and the PNGs made again from a copied study folder whose runs are FAKE servers
(tests/fakes/stability.py) written with the real ``write_outcome``."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from objectives import parse_slo
from optimizer.stability.plan import PlanSettings, build_load, build_plan
from optimizer.stability.plots import (
    LATENCY_PNG,
    SERVER_PNG,
    _slo_lines,
    plot_stability,
    read_series,
    rolling_latency,
)
from optimizer.stability.run import Target, write_outcome
from optimizer.stability.stored import STABILITY_FILE, stability_doc
from optimizer.types import RequestRecord, Trace, TraceRequest
from optimizer.workload.prompts import TokenRange
from tests.fakes.stability import FakeServer, fake_outcome

SLOS = ("p95_ttft_ms<=200", "p99_tpot_ms<=30", "error_rate<=0.01")


def _record(i: int, t: float, ttft_ms: float, *, ok: bool = True) -> RequestRecord:
    first = t + ttft_ms / 1000
    return RequestRecord(
        index=i,
        scheduled_s=t,
        sent_s=t,
        first_token_s=first if ok else None,
        chunk_times_s=(first, first + 0.01, first + 0.02) if ok else (),
        end_s=first + 0.02,
        input_tokens=10,
        output_tokens=3,
        error=None if ok else "HTTP 500",
    )


def test_rolling_percentiles_follow_a_latency_step_and_count_failures() -> None:
    # 4 requests a second; TTFT 50 ms for 20 s, then 500 ms; two failures at 30 s.
    records = [_record(i, i / 4, 50 if i / 4 < 20 else 500) for i in range(160)]
    records += [_record(1000, 30.0, 0, ok=False), _record(1001, 30.1, 0, ok=False)]
    roll = rolling_latency(records, width_s=5, step_s=1, start_s=0, end_s=40)
    t = roll["t"]
    assert t[0] == 1 and t[-1] == 40
    at = {float(x): i for i, x in enumerate(t)}
    assert roll["p95_ttft_ms"][at[15]] == pytest.approx(50, abs=1)
    assert roll["p99_ttft_ms"][at[35]] == pytest.approx(500, abs=1)
    assert 50 < roll["p95_ttft_ms"][at[22]] <= 500  # the window straddles the step
    assert roll["p95_tpot_ms"][at[15]] == pytest.approx(10, abs=0.5)
    assert roll["requests"][at[15]] == 20 and roll["failed"][at[15]] == 0
    assert roll["failed"][at[31]] == 2 and roll["requests"][at[31]] == 22
    empty = rolling_latency([], width_s=5, step_s=1, start_s=0, end_s=3)
    assert np.isnan(empty["p95_ttft_ms"]).all() and (empty["requests"] == 0).all()


def test_slo_lines_are_drawn_on_the_metric_they_bound() -> None:
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    _slo_lines(ax, [*SLOS, "mean_ttft_ms<=150", "not an slo"], "ttft")
    drawn = sorted(float(line.get_ydata()[0]) for line in ax.get_lines())
    assert drawn == [150.0, 200.0]
    ax = Figure().add_subplot()
    _slo_lines(ax, SLOS, "tpot")
    assert [line.get_label() for line in ax.get_lines()] == ["SLO p99_tpot_ms<=30"]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _fake_check(folder: Path, *, gpu: float | None = None) -> dict[str, object]:
    """A study folder's stability check whose two runs are FAKE servers: the chosen one's RSS
    grows 60 MiB a minute, the baseline's stays level."""
    settings = PlanSettings(
        sustained_s=60, burst_s=6, recovery_s=12, long_input_s=12, window_s=5, long_every_s=4
    )
    plan = build_plan(settings, base_scale=1.0, burst_scale=3.0, max_model_len=1024)
    trace = Trace(tuple(TraceRequest(0.5 * i, 64, 8) for i in range(8)), block_size=16)
    load = build_load(trace, plan)
    target = Target(
        model="m", vocab=TokenRange(10, 100), seed=1, slos=tuple(parse_slo(s) for s in SLOS)
    )
    runs_dir = folder / "stability" / "20260101-000000"
    outcomes = []
    for label, growth in (("chosen", 60.0), ("baseline", 0.0)):
        server = FakeServer(rss_growth_mib_per_min=growth, gpu_mib=gpu)
        outcome = fake_outcome(server, load, plan, target, label=label)
        write_outcome(outcome, runs_dir / label)
        outcomes.append(outcome)
    doc = stability_doc(3, plan, outcomes, folder=folder, runs_dir=runs_dir)
    doc |= {"baseline_trial": 0, "policy": "knee", "slos": list(SLOS)}
    (folder / STABILITY_FILE).write_text(json.dumps(doc))
    return doc


def test_plots_are_made_again_from_a_copied_study_folder(tmp_path: Path) -> None:
    doc = _fake_check(tmp_path / "study")
    assert [w.split(":")[0] for w in doc["worse_than_baseline"]] == ["memory_rss"]  # type: ignore[union-attr]
    copy = tmp_path / "copied"
    shutil.copytree(tmp_path / "study", copy)
    shutil.rmtree(tmp_path / "study")  # nothing may point back at the original
    series = read_series(copy, json.loads((copy / STABILITY_FILE).read_text()))
    assert [s.label for s in series] == ["chosen", "baseline"]
    assert series[0].title == "chosen (trial 3): unstable" and series[1].title.startswith(
        "baseline (trial 0)"
    )
    assert series[0].records and series[0].samples and series[0].windows
    files = plot_stability(copy)
    runs = copy / "stability" / "20260101-000000"
    assert files == [runs / LATENCY_PNG, runs / SERVER_PNG]
    latency_w, _ = _png_size(files[0])
    server_w, server_h = _png_size(files[1])
    assert latency_w > 1000 and server_w > 1000  # two columns: chosen and baseline

    # With GPU memory sampled the server plot gets its row; without the records files the
    # latency plot falls back to the windows stored in stability.json.
    _fake_check(tmp_path / "gpu", gpu=2048.0)
    for label in ("chosen", "baseline"):
        (tmp_path / "gpu" / "stability" / "20260101-000000" / label / "records.jsonl.gz").unlink()
    gpu_files = plot_stability(tmp_path / "gpu")
    assert _png_size(gpu_files[1])[1] > server_h
    assert _png_size(gpu_files[0])[0] == latency_w


def test_no_check_no_plots(tmp_path: Path) -> None:
    assert plot_stability(tmp_path) == []
