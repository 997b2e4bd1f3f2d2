"""Where a study's trial time went (issue 16): each trial's startup phases stored with its
result, read back through TrialView, and summed into the study's account (show, report.md,
MLflow). run_trial uses a FAKE engine (tests/fakes/trials.py); the Optuna storage is real."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import optuna
import pytest

from optimizer import trial as trial_mod
from optimizer.analysis.trial_cost import study_cost
from optimizer.trial_view import TrialView, record_result
from optimizer.types import TrialResult, TrialStatus
from tests.fakes.trials import FakeEngine
from tests.unit.test_trial_outcomes import _spec


def test_a_trial_keeps_its_startup_phases(tmp_path: Path) -> None:
    result = trial_mod.run_trial(_spec(tmp_path), engine=FakeEngine())
    assert result.startup == {"phases": {"health": 0.01}, "reported": {}}
    stored = json.loads((tmp_path / "trial" / "result.json").read_text())
    assert stored["startup"] == {"phases": {"health": 0.01}, "reported": {}}


def _stored_trial(
    study: optuna.Study,
    *,
    wall_s: float,
    startup_s: float | None,
    replay_s: float | None,
    phases: dict[str, float] | None,
) -> None:
    trial = study.ask()
    record_result(
        trial,
        TrialResult(
            number=trial.number,
            status=TrialStatus.COMPLETE if replay_s else TrialStatus.FAILED,
            startup_s=startup_s,
            replay_s=replay_s,
            startup={"phases": phases, "reported": {}} if phases else {},
        ),
        attempt=0,
    )
    study.tell(trial, 1.0)
    # Optuna stamps start and end itself; set the wall time the test wants.
    frozen = study.get_trials(deepcopy=False)[-1]
    start = dt.datetime(2026, 12, 1, 12, 0, 0)
    frozen.datetime_start = start
    frozen.datetime_complete = start + dt.timedelta(seconds=wall_s)


def test_the_study_account_medians_phases_and_shares_time() -> None:
    study = optuna.create_study()
    _stored_trial(
        study,
        wall_s=100,
        startup_s=60,
        replay_s=30,
        phases={"imports": 10, "torch_compile": 30, "health": 20},
    )
    _stored_trial(
        study, wall_s=80, startup_s=40, replay_s=30, phases={"imports": 14, "health": 26}
    )  # eager: no compile
    _stored_trial(study, wall_s=20, startup_s=None, replay_s=None, phases=None)  # never started
    trials = study.get_trials(deepcopy=False)
    cost = study_cost(trials)
    assert cost.trials == 3 and cost.started == 2
    assert cost.replay_share == pytest.approx(60 / 200)
    assert cost.startup_share == pytest.approx(100 / 200)
    assert cost.median_startup_s == 50
    # A phase one trial did not have counts as 0 s for it.
    assert cost.median_phases == {"imports": 12.0, "torch_compile": 15.0, "health": 23.0}
    assert TrialView(trials[0]).startup_phases["torch_compile"] == 30
    text = "\n".join(cost.lines())
    assert "30% replaying" in text and "50% starting servers" in text
    assert "| torch.compile | 15.0 |" in cost.markdown()
    assert cost.to_dict()["replay_share"] == pytest.approx(0.3)


def test_no_finished_trial_no_account() -> None:
    cost = study_cost([])
    assert cost.trials == 0 and cost.replay_share is None
    assert cost.lines() == [] and cost.markdown() == []
