"""Capacity studies end to end with a FAKE runner (no vLLM): the capacity of each trial comes
from the real rate search over a fake server model, and the study, the answer, `show --json`,
report.md and the export header read it back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from objectives import FAILED_CONSTRAINT
from optimizer import cli
from optimizer.analysis.capacity import answer_for_plan, capacity_answer
from optimizer.capacity.search import StepOutcome, search_capacity
from optimizer.capacity.trial import (
    CAPACITY_KEYS,
    capacity_constraints,
    capacity_doc,
    capacity_summary,
)
from optimizer.config import load_job
from optimizer.study import prepare
from optimizer.study_driver import StudyDriver
from optimizer.trial_view import TrialView
from optimizer.types import MemoryAccount, TrialResult, TrialSpec, TrialStatus
from tests.fakes.trials import FakeHandle, ScriptedRunner

REPO = Path(__file__).resolve().parents[3]
SLOS = ["p95_ttft_ms<=500", "p95_tpot_ms<=50"]


def fake_capacity_result(
    spec: TrialSpec, capacity_scale: float, kv_cache_tokens: int | None = None
) -> TrialResult:
    """A capacity trial on a FAKE server whose TTFT margin is scale / capacity - 1 (and whose
    startup log, when ``kv_cache_tokens`` is given, said its KV cache holds that many)."""
    assert spec.capacity is not None

    def measure(scale: float, attempt: int) -> StepOutcome:
        ttft = 500.0 * scale / capacity_scale if capacity_scale > 0 else 5000.0
        summary = {"p95_ttft_ms": ttft, "p95_tpot_ms": 20.0, "completed": 50.0}
        margins = {SLOS[0]: ttft / 500.0 - 1.0, SLOS[1]: 20.0 / 50.0 - 1.0}
        stopped = margins[SLOS[0]] > 1.0  # far over: the replay would stop early
        return StepOutcome(
            scale,
            margins,
            stopped_early=stopped,
            reason="ttft" if margins[SLOS[0]] > 0 else "",
            summary=summary,
            detail={"step": 0, "offered_rps": 2.0 * scale, "partial": stopped},
        )

    search = search_capacity(measure, spec.capacity)
    best = search.best_step()
    summary = capacity_summary(spec, search)  # the real assembly of the trial's summary
    floors = (
        {}
        if best
        else {
            "burst_prompt_tokens": 9000.0,
            "burst_requests": 3.0,
            "prefill_tokens_per_s": 6000.0,
            "ttft_floor_ms": 1500.0,
            "tpot_floor_ms": 20.0,
        }
    )
    doc = capacity_doc(search, spec, isolation="drained, fresh prompts", floors=floors)
    return TrialResult(
        number=spec.number,
        status=TrialStatus.COMPLETE,
        summary=summary,
        startup_s=1.0,
        replay_s=2.0,
        capacity=doc,
        memory=MemoryAccount(kv_cache_tokens=kv_cache_tokens) if kv_cache_tokens else None,
    )


class FakeCapacityRunner(ScriptedRunner):
    """FAKE runner: max-num-seqs decides the fake server's capacity (16 serves nothing)."""

    def __init__(self, zero_everywhere: bool = False) -> None:
        super().__init__()
        self.zero_everywhere = zero_everywhere

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        self.specs.append(spec)
        seqs = int(spec.engine.args.get("max-num-seqs", 128))
        cap = 0.0 if self.zero_everywhere or seqs == 16 else {128: 0.8, 64: 1.3, 32: 2.1}[seqs]
        kv = {128: 40_000, 64: 50_000, 32: 90_000, 16: 10_000}[seqs]
        return FakeHandle(spec, fake_capacity_result(spec, cap, kv))


def _job(tmp_path: Path, **over: Any) -> dict[str, Any]:
    job = {
        "name": "cap",
        "model": {"path": str(tmp_path / "model"), "make": "tiny"},
        "engine": {"args": {"max-model-len": 2048}},
        "trace": {
            "path": str(REPO / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {"window_s": [0, 40], "max_model_len": 2048, "max_output_tokens": 32},
            "warmup_requests": 2,
        },
        "search_space": {
            "name": "t",
            "params": {"max-num-seqs": {"type": "categorical", "choices": [16, 32, 64]}},
        },
        "objectives": {"preset": "capacity", "slos": SLOS},
        "capacity": {
            "min_scale": 0.125,
            "max_scale": 8,
            "tolerance": 0.05,
            "max_steps": 12,
            "noise": 0.0,
            "peak_rps": 10,
            "gpu_hour_price": 4.0,
            "racing": False,  # full searches; racing (the default) has its own tests below
        },
        "sampler": {"name": "random", "seed": 1},
        "enqueue": [{"max-num-seqs": 32}, {"max-num-seqs": 16}, {"max-num-seqs": 64}],
        "trials": 4,
        "out": str(tmp_path / "out"),
    }
    job.update(over)
    return job


def _run(tmp_path: Path, runner: Any, **over: Any) -> tuple[Any, Any]:
    job, base = load_job(_job(tmp_path, **over), base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    study = StudyDriver(plan, runner, heartbeat_interval_s=1, grace_period_s=2).run()
    return plan, study


def test_capacity_study_tells_each_trial_its_capacity(tmp_path: Path) -> None:
    runner = FakeCapacityRunner()
    _plan, study = _run(tmp_path, runner)
    # Every trial was a capacity search with the job's settings; its server offers the
    # prefix-cache reset endpoint.
    assert all(s.capacity is not None and s.capacity.min_scale == 0.125 for s in runner.specs)
    assert all(s.engine.env.get("VLLM_SERVER_DEV_MODE") == "1" for s in runner.specs)
    # Issue 16: every trial's server shares the compile caches kept in the study folder.
    cache = tmp_path / "out" / "cache"
    assert all(
        s.engine.env["VLLM_CACHE_ROOT"] == str(cache / "vllm")
        and s.engine.env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
        and s.engine.env["TRITON_CACHE_DIR"] == str(cache / "triton")
        for s in runner.specs
    )
    trials = study.get_trials()
    caps = {t.number: t.values[0] for t in trials}
    # 2 req/s at scale 1: capacity = 2 x the fake server's capacity scale (within 5 %).
    assert caps[0] == pytest.approx(1.6, rel=0.06)  # baseline, max-num-seqs 128
    assert caps[1] == pytest.approx(4.2, rel=0.06)
    assert caps[2] == 0.0  # serves nothing: capacity 0, not a failure
    assert caps[3] == pytest.approx(2.6, rel=0.06)
    # Capacity > 0: feasible, the margins of the passing step; capacity 0: infeasible.
    assert all(v <= 0 for v in trials[1].constraints.values())
    assert trials[2].constraints[SLOS[0]] > 0
    assert [t.number for t in study.best_trials] == [1]
    for t in trials:
        assert set(CAPACITY_KEYS) <= set(t.user_attrs["summary"])
        assert TrialView(t).capacity is not None


def test_capacity_answer_in_a_users_terms(tmp_path: Path) -> None:
    _plan, study = _run(tmp_path, FakeCapacityRunner())
    answer = capacity_answer(study, peak_rps=10, gpu_hour_price=4.0)
    assert answer is not None
    assert answer.baseline is not None and answer.baseline.number == 0
    assert answer.best is not None and answer.best.number == 1
    assert answer.gain == pytest.approx(answer.best.rps / answer.baseline.rps)
    assert answer.gain == pytest.approx(4.2 / 1.6, rel=0.1)
    # ceil(10 / capacity) servers of one GPU each.
    assert answer.gpus["baseline"] == math.ceil(10 / answer.baseline.rps)
    assert answer.gpus["best"] == math.ceil(10 / answer.best.rps)
    # The memory account beside the capacity: the KV tokens each engine logged, and the ratio.
    assert (answer.baseline.kv_cache_tokens, answer.best.kv_cache_tokens) == (40_000, 90_000)
    assert answer.kv_line() == "KV cache: baseline 40,000 tokens, best 90,000 tokens (x2.25)"
    # 4.0 per GPU-hour over output tokens/s x 3600, per million tokens.
    expected = 4.0 / (answer.best.output_tps * 3600) * 1e6
    assert answer.cost_per_m_output_tokens["best"] == pytest.approx(expected)
    text = "\n".join(answer.lines())
    assert "capacity gain over the baseline: x" in text and "GPUs" in text
    metrics = answer.metrics()
    assert metrics["capacity_gain"] == pytest.approx(answer.gain)
    assert metrics["best_capacity_rps"] == pytest.approx(answer.best.rps)
    assert (metrics["baseline_kv_cache_tokens"], metrics["best_kv_cache_tokens"]) == (
        40_000,
        90_000,
    )
    # The baseline carried something, so no SLO-floor explanation is due.
    assert answer.unmet == ()


def test_slos_nobody_meets_are_explained_with_numbers(tmp_path: Path) -> None:
    _plan, study = _run(tmp_path, FakeCapacityRunner(zero_everywhere=True))
    answer = capacity_answer(study)
    assert answer is not None and answer.best is not None and answer.best.rps == 0
    assert answer.gain is None
    assert answer.unmet, "every trial carried nothing: each must be explained"
    first = answer.unmet[0]
    assert "p95_ttft_ms<=500 missed even at x0.125" in first
    assert "9,000 prompt tokens" in first and "6,000 tokens/s" in first
    assert "1,500 ms" in first and "spread_ticks" in first
    assert "No scheduling meets it" in first  # the floor (1.5 s) is above the 500 ms SLO
    # A floor below the threshold is not blamed for the miss.
    from optimizer.analysis.capacity import explain_unmet
    from optimizer.trial_view import TrialView

    view = TrialView(study.get_trials()[0])
    assert view.capacity is not None
    low_floor = view.capacity.__class__(
        **{
            **view.capacity.__dict__,
            "floors": {
                "burst_prompt_tokens": 900.0,
                "burst_requests": 1.0,
                "prefill_tokens_per_s": 9000.0,
                "ttft_floor_ms": 100.0,
            },
        }
    )
    text = explain_unmet(view, low_floor)[0]
    assert "within the SLO: the misses come from queueing" in text
    # No partial margins reach the sampler: the lowest step was stopped early.
    assert study.get_trials()[0].constraints[SLOS[0]] == FAILED_CONSTRAINT


def test_capacity_constraints_rules() -> None:
    steps = [
        {"scale": 1.0, "passed": True, "stopped_early": False, "margins": {"a": -0.2, "b": -0.5}},
        {"scale": 2.0, "passed": False, "stopped_early": True, "margins": {"a": 3.0, "b": 0.1}},
    ]
    assert capacity_constraints({"scale": 1.0, "steps": steps}, ["a", "b"]) == [-0.2, -0.5]
    zero_partial = [{**steps[1], "scale": 0.5}]
    assert capacity_constraints({"scale": 0.0, "steps": zero_partial}, ["a", "b"]) == [
        FAILED_CONSTRAINT,
        FAILED_CONSTRAINT,
    ]
    zero_full = [
        {"scale": 0.5, "passed": False, "stopped_early": False, "margins": {"a": 0.4, "b": -0.1}}
    ]
    assert capacity_constraints({"scale": 0.0, "steps": zero_full}, ["a", "b"]) == [0.4, -0.1]
    assert capacity_constraints({"scale": 0.0, "steps": []}, ["a"]) == [FAILED_CONSTRAINT]


def test_show_json_report_and_export_header_carry_the_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan, study = _run(tmp_path, FakeCapacityRunner())
    assert cli.main(["show", str(plan.out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity"]["best"]["number"] == 1
    # Tuned here on the CPU build: servers, not GPUs, are what a peak needs.
    assert doc["capacity"]["cpu_build"] is True
    assert doc["capacity"]["servers"]["best"] >= 1 and doc["capacity"]["gpus"] == {}
    by_number = {t["number"]: t for t in doc["trials"]}
    assert by_number[1]["capacity"]["rps"] == pytest.approx(study.get_trials()[1].values[0])
    assert by_number[1]["slos"] == {SLOS[0]: True, SLOS[1]: True}
    assert by_number[2]["slos"][SLOS[0]] is False
    assert doc["front"] == [1]
    assert doc["capacity"]["best"]["kv_cache_tokens"] == 90_000
    assert by_number[2]["memory"]["kv_cache_tokens"] == 10_000
    # The console form says it in words.
    assert cli.main(["show", str(plan.out), "--peak-rps", "100"]) == 0
    out = capsys.readouterr().out
    assert "Capacity at SLO" in out and "for a peak of 100 req/s" in out and "servers" in out
    assert "KV cache: baseline 40,000 tokens, best 90,000 tokens (x2.25)" in out
    # report.md and the export header.
    from optimizer.analysis.documents import capacity_section

    saved = json.loads((plan.out / "plan.json").read_text())
    section = "\n".join(capacity_section(study, saved))
    assert "## Capacity at SLO" in section and "| 1 |" in section
    row = next(ln for ln in section.splitlines() if ln.startswith("| 1 |"))
    assert row.endswith("| 90,000 |"), row
    answer = answer_for_plan(study, saved)
    assert answer is not None
    line = answer.export_line(1)
    assert "req/s" in line and "baseline" in line and "(x" in line
    assert line.endswith("; KV cache 90,000 tokens"), line


def test_export_picks_the_highest_capacity_by_default(tmp_path: Path) -> None:
    from optimizer import export as ex

    _plan, study = _run(tmp_path, FakeCapacityRunner())
    assert ex.default_policy(study) == "max-capacity"
    assert ex.select_trial(study, ex.default_policy(study)).number == 1
    assert ex.primary_metrics("max-capacity", ["capacity_rps"]) == ["capacity_rps"]
    with pytest.raises(Exception, match="no objective 'output_throughput'"):
        ex.select_trial(study, "max-throughput")


def test_racing_at_the_incumbent_tells_losers_cheaply_and_honestly(tmp_path: Path) -> None:
    """Baseline 0.8, then 32 (2.1), 16 (serves nothing), 64 (1.3): x the fake's 2 req/s."""
    runner = FakeCapacityRunner()
    capacity = {**_job(tmp_path)["capacity"], "racing": True}
    _plan, study = _run(tmp_path, runner, capacity=capacity)
    trials = study.get_trials()
    races = [s.capacity.race_at if s.capacity else None for s in runner.specs]
    # The baseline searches from start_scale; each tuned trial races at the best so far.
    assert races[0] is None
    assert races[1] == pytest.approx(0.8, rel=0.06)
    assert races[2] == pytest.approx(2.1, rel=0.06) and races[3] == races[2]
    # 32 beat the baseline: searched up from the race step, measured in full.
    assert trials[1].state.name == "COMPLETE" and trials[1].values[0] == pytest.approx(
        4.2, rel=0.06
    )
    # 16 serves nothing: its race step was stopped early; no capacity measured, so it is
    # pruned with the upper bound (the race step's rate) as its intermediate value (which
    # Optuna keeps as a pruned trial's value), never told as a measured capacity.
    assert trials[2].state.name == "PRUNED" and TrialView(trials[2]).status == "raced_out"
    assert trials[2].intermediate_values == {0: pytest.approx(2 * 2.1, rel=0.06)}
    assert trials[2].user_attrs["summary"]["capacity_rps"] is None  # NaN: stored as null
    assert len(trials[2].user_attrs["capacity"]["steps"]) == 1
    # 64 lost the race but passed one step below: a bounded capacity, told with its estimate.
    doc = trials[3].user_attrs["capacity"]
    assert trials[3].state.name == "COMPLETE" and doc["raced"] and not doc["raced_out"]
    assert len(doc["steps"]) == 2
    assert trials[3].values[0] == pytest.approx(2.6, rel=0.06)
    assert doc["rps_lo"] <= trials[3].values[0] <= doc["rps_hi"]
    # The best is still the one that won its race.
    assert [t.number for t in study.best_trials] == [1]
    # The reader's side: the answer names the raced-out trial's bound and the estimate's range.
    answer = capacity_answer(study, cpu_build=True)
    assert answer is not None
    texts = {c.number: c.answer for c in answer.trials}
    assert texts[2].startswith("below 4.2 req/s (raced out")
    assert "interpolated" in texts[3] and "raced out at the incumbent" in texts[3]
    # Its bounding step sat at 0.9 x the scale the race step's margin pointed to (1.3).
    assert "measured bracket 2.34-4.2" in texts[3]
    # MLflow: the trial's run carries the same words as a tag, its metrics the bracket.
    from optimizer.tracking import TrackingTarget
    from optimizer.tracking.sync import Syncer

    syncer = Syncer(
        TrackingTarget(
            study="cap",
            storage_url="sqlite:///unused.db",
            out=tmp_path,
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
            experiment="cap",
        )
    )
    assert syncer._trial_tags(trials[3], set())["capacity"] == texts[3]
    metrics = syncer._trial_metrics(trials[3])
    assert metrics["capacity_rps_lo"] < metrics["capacity_rps"] < metrics["capacity_rps_hi"]


def test_without_racing_no_trial_races(tmp_path: Path) -> None:
    runner = FakeCapacityRunner()
    job = _job(tmp_path)
    _run(tmp_path, runner, capacity={**job["capacity"], "racing": False})
    assert all(s.capacity is not None and s.capacity.race_at is None for s in runner.specs)


def test_racing_is_on_by_default(tmp_path: Path) -> None:
    job = _job(tmp_path)
    capacity = {k: v for k, v in job["capacity"].items() if k != "racing"}
    loaded, _ = load_job({**job, "capacity": capacity}, base=tmp_path)
    assert loaded.capacity.racing is True
