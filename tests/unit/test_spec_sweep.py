"""The break-even sweep of speculative decoding: its arithmetic, what it runs, what it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from optimizer.errors import ConfigError
from optimizer.speculation.sweep import SWEEP_FILE, break_even, run_sweep, sweep_points
from optimizer.types import TrialResult, TrialSpec, TrialStatus
from tests.fakes.trials import ScriptedRunner
from tests.unit.test_study_loop import _SPEC_SPACE, FakeRunner, _driver

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_break_even_interpolates_between_the_last_loss_and_the_first_win() -> None:
    # Capacity (higher is better): off carries 10; 1.5 carries 8, 2.5 carries 12 -> 2.0.
    answer = break_even(10.0, [(2.5, 12.0), (1.5, 8.0), (1.0, 6.0)])
    assert answer.length == pytest.approx(2.0)
    assert "between 1.5, which lost, and 2.5, which won" in answer.text
    # P95 TPOT (lower is better).
    tpot = break_even(24.0, [(1.5, 40 / 1.5), (2.0, 20.0)], higher_is_better=False)
    assert tpot.length == pytest.approx(1.7)


def test_break_even_outside_the_lengths_measured_is_said_not_extrapolated() -> None:
    always = break_even(10.0, [(1.5, 11.0), (2.0, 13.0)])
    assert always.length is None and "wins at every length measured" in always.text
    never = break_even(10.0, [(1.5, 5.0), (3.0, 9.0)])
    assert never.length is None and "break-even > 3" in never.text
    unmeasured = break_even(float("nan"), [(1.5, 5.0)])
    assert unmeasured.length is None and "not measured" in unmeasured.text


def test_sweep_points_turn_speculation_off_once_and_skip_unreachable_lengths() -> None:
    args = {
        "max-num-seqs": 8,
        "speculative-config": {
            **NGRAM,
            "synthetic_acceptance_length": 2.5,
            "rejection_sample_method": "synthetic",
        },
    }
    runs = sweep_points(args, [1.0, 2.0, 4.0, 5.0])
    assert [label for label, _ in runs] == ["off", "1", "2", "4"]  # 5 > 3 tokens + 1
    assert runs[0][1] == {"max-num-seqs": 8}
    assert runs[2][1]["speculative-config"]["synthetic_acceptance_length"] == 2.0
    with pytest.raises(ConfigError, match="no speculative decoding"):
        sweep_points({"max-num-seqs": 8}, [2.0])
    with pytest.raises(ConfigError, match="can happen with num_speculative_tokens 3"):
        sweep_points(args, [4.5, 6.0])


def _speculating(study: Any, tokens: int) -> Any:
    """The study's trial that speculated ``tokens`` tokens."""
    return next(
        t
        for t in study.get_trials()
        if json.loads(t.user_attrs["engine_args"])
        .get("speculative-config", {})
        .get("num_speculative_tokens")
        == tokens
    )


class FakeSpeculationRunner(ScriptedRunner):
    """FAKE server: P95 TPOT 24 ms without speculation, 40 / L ms at acceptance length L."""

    def result(self, spec: TrialSpec) -> TrialResult:
        sc = spec.engine.args.get("speculative-config")
        tpot = 24.0 if sc is None else 40.0 / sc["synthetic_acceptance_length"]
        return TrialResult(
            number=spec.number,
            status=TrialStatus.COMPLETE,
            summary={"p95_tpot_ms": tpot, "p95_ttft_ms": 100.0, "output_throughput": 50.0},
        )


def test_the_sweep_runs_the_chosen_trial_off_and_at_each_length_and_writes_the_answer(
    tmp_path: Path,
) -> None:
    engine = {"args": {"max-model-len": 2048}, "speculation": {"acceptance_length": 2.5}}
    study = _driver(
        tmp_path,
        FakeRunner(),
        engine=engine,
        search_space=_SPEC_SPACE,
        sampler={"name": "grid", "seed": 0},
        trials=5,
    ).run()
    chosen = _speculating(study, tokens=3)
    folder = tmp_path / "out"
    saved = json.loads((folder / "plan.json").read_text())
    runner = FakeSpeculationRunner()
    lines: list[str] = []
    doc = run_sweep(
        folder,
        saved,
        study,
        [1.5, 2.0, 3.0],
        lambda plan: runner,
        trial=chosen.number,
        progress=lines.append,
    )
    started: list[Any] = [s.engine.args.get("speculative-config") for s in runner.specs]
    assert started[0] is None  # speculation off
    assert [s["synthetic_acceptance_length"] for s in started[1:]] == [1.5, 2.0, 3.0]
    assert doc["figure"] == "p95_tpot_ms" and doc["break_even_length"] == pytest.approx(1.7)
    assert [r["acceptance_length"] for r in doc["rows"]] == [None, 1.5, 2.0, 3.0]
    assert json.loads((folder / SWEEP_FILE).read_text())["answer"] == doc["answer"]
    assert len(lines) == 4


class FakeCapacitySpeculationRunner(ScriptedRunner):
    """FAKE server whose capacity (rate scale) is 1.0 without speculation and 0.5 x L at
    acceptance length L, through the real capacity search and summary."""

    def result(self, spec: TrialSpec) -> TrialResult:
        from tests.unit.capacity.test_capacity_study import fake_capacity_result

        sc = spec.engine.args.get("speculative-config")
        scale = 1.0 if sc is None else 0.5 * sc.get("synthetic_acceptance_length", 2.0)
        result = fake_capacity_result(spec, scale)
        # The step at capacity reports another TPOT than the nominal load (the first step).
        result.summary["p95_tpot_ms"] = 99.0
        return result


def _capacity_study(job: dict[str, Any], tmp_path: Path) -> tuple[Any, Any, Path, Any]:
    """Run a capacity job on the FAKE capacity server: the study, its 3-token speculating
    trial, the study folder and its plan.json."""
    from optimizer.config import load_job
    from optimizer.study import prepare
    from optimizer.study_driver import StudyDriver

    loaded, base = load_job(job, base=tmp_path)
    plan = prepare(loaded, base, check_flags=False)
    study = StudyDriver(
        plan, FakeCapacitySpeculationRunner(), heartbeat_interval_s=1, grace_period_s=2
    ).run()
    folder = Path(job["out"])
    return (
        study,
        _speculating(study, tokens=3),
        folder,
        json.loads((folder / "plan.json").read_text()),
    )


def test_a_capacity_sweep_compares_capacities_and_tpot_at_one_load(tmp_path: Path) -> None:
    from tests.unit.capacity.test_capacity_study import _job

    job = _job(
        tmp_path,
        engine={"args": {"max-model-len": 2048}, "speculation": {"acceptance_length": 2.5}},
        search_space=_SPEC_SPACE,
        sampler={"name": "grid", "seed": 0},
        enqueue=[],
        trials=5,
    )
    study, chosen, folder, saved = _capacity_study(job, tmp_path)
    runner = FakeCapacitySpeculationRunner()
    doc = run_sweep(folder, saved, study, [1.5, 2.5, 3.5], lambda plan: runner, trial=chosen.number)
    assert doc["figure"] == "capacity_rps"
    rows = {r["acceptance_length"]: r for r in doc["rows"]}
    per_scale = rows[None]["capacity_rps"]  # capacity scale 1.0 without speculation
    assert rows[1.5]["capacity_rps"] == pytest.approx(0.75 * per_scale, rel=0.05)
    assert rows[3.5]["capacity_rps"] == pytest.approx(1.75 * per_scale, rel=0.05)
    # Capacity x0.5L reaches x1.0 at L = 2: read off the points measured at 1.5 and 2.5.
    assert doc["break_even_length"] == pytest.approx(2.0, abs=0.1)
    # P95 TPOT of every row from the search's first step (one load), not its capacity step.
    assert [r["p95_tpot_ms"] for r in doc["rows"]] == [pytest.approx(20.0)] * 4


def test_rows_the_study_measured_are_its_trials_not_new_server_starts(tmp_path: Path) -> None:
    # As on the H200 (issue 32): the baseline runs exactly the chosen trial's arguments without
    # speculation, and the chosen trial is the stated length: only the other lengths start servers.
    from tests.unit.capacity.test_capacity_study import _job

    space = {
        "name": "spec-lever",
        "params": {
            "speculative-config.method": {"type": "categorical", "choices": [None, "ngram"]},
            "speculative-config.num_speculative_tokens": {
                "type": "int",
                "low": 1,
                "high": 4,
                "when": {"speculative-config.method": "ngram"},
            },
        },
    }
    job = _job(
        tmp_path,
        engine={
            "args": {"max-model-len": 2048},
            "baseline_args": {},
            "speculation": {"acceptance_length": 2.5},
        },
        search_space=space,
        sampler={"name": "tpe", "seed": 0},
        enqueue=[{"speculative-config": NGRAM}],
        trials=2,
    )
    study, chosen, folder, saved = _capacity_study(job, tmp_path)

    runner = FakeCapacitySpeculationRunner()
    doc = run_sweep(folder, saved, study, [1.5, 2.5, 3.5], lambda plan: runner, trial=chosen.number)
    lengths = [
        s.engine.args["speculative-config"]["synthetic_acceptance_length"] for s in runner.specs
    ]
    assert lengths == [1.5, 3.5]  # off and 2.5 were measured by the study
    rows = {r["acceptance_length"]: r for r in doc["rows"]}
    assert rows[None]["reused_trial"] == 0 and rows[2.5]["reused_trial"] == chosen.number
    assert rows[1.5]["reused_trial"] is None and rows[3.5]["reused_trial"] is None
    per_scale = rows[None]["capacity_rps"]
    assert rows[2.5]["capacity_rps"] == pytest.approx(1.25 * per_scale, rel=0.05)
    assert doc["break_even_length"] == pytest.approx(2.0, abs=0.1)

    again = FakeCapacitySpeculationRunner()
    doc = run_sweep(
        folder, saved, study, [1.5, 2.5, 3.5], lambda plan: again, trial=chosen.number, reuse=False
    )
    assert len(again.specs) == 4 and all(r["reused_trial"] is None for r in doc["rows"])
