"""Issue 42, item 2: MLflow in service studies, end to end. Studies submitted to the real
JobService (the real FastAPI app, real tokens, one shared Optuna storage), driven by the real
StudyHost and StudyDriver with a FAKE trial runner (no Ray, no vLLM), logged by the real
tracker into one shared MLflow store (the operator's ``--mlflow-uri``, a local SQLite file),
which is then read back.

Each test failed before the fix: the tracker looked the study up by the job's name (a service
study is ``TEAM/ID`` in its storage), so it raised ``KeyError: 'Record does not exist.'``,
logged no trial and left the parent run RUNNING; or it found another team's study of that
name and logged its trials; two teams' jobs of one name shared one experiment; and a job
without an ``mlflow:`` mapping ignored the operator's store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient

from optimizer import tracking
from tests.unit.test_jobs import job_doc
from tests.unit.test_service_isolation import ALPHA, BETA, Teams, _drive, _tiny

STUDY_TAG = "vllm_autotune.study"
ROLE_TAG = "vllm_autotune.role"


@pytest.fixture
def teams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Teams:
    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    monkeypatch.delenv("VLLM_AUTOTUNE_STORAGE", raising=False)
    return Teams(tmp_path, mlflow_uri=f"sqlite:///{tmp_path / 'shared-mlflow.db'}")


def _uri(teams: Teams) -> str:
    uri = teams.service.settings.mlflow_uri
    assert uri is not None
    return uri


def _runs(teams: Teams, experiment: str) -> tuple[Any, list[Any]]:
    """(the one parent run, the child runs) of ``experiment`` in the shared store, deleted
    runs included (so a deletion shows as a run not ACTIVE)."""
    client = MlflowClient(_uri(teams))
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r}"
    runs = client.search_runs([exp.experiment_id], max_results=1000, run_view_type=3)
    parents = [r for r in runs if r.data.tags.get(ROLE_TAG) == "study"]
    children = [r for r in runs if r.data.tags.get(ROLE_TAG) == "trial"]
    assert len(parents) == 1, [p.data.tags for p in parents]
    return parents[0], children


def _experiments(teams: Teams) -> set[str]:
    return {e.name for e in MlflowClient(_uri(teams)).search_experiments()}


def _logged(monkeypatch: pytest.MonkeyPatch, teams: Teams, job_id: str) -> None:
    status = _drive(monkeypatch, teams, job_id, mlflow=True)
    assert status["state"] == "done", status
    assert "MLflow" not in status["message"], status


def test_a_service_study_is_logged_to_the_operators_mlflow(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every trial a child run, the parent FINISHED, all keyed by the stored study
    (``TEAM/ID``) in the team's own experiment; review/mlflow.json says so, and mlflow-sync
    of the folder finds the same runs."""
    a_id = _tiny(teams, ALPHA, mlflow={"enabled": True})
    _logged(monkeypatch, teams, a_id)
    rec = teams.service.get(a_id)
    study = optuna.load_study(study_name=rec.study_name, storage=teams.shared)
    parent, children = _runs(teams, "alpha/same-name")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags[STUDY_TAG] == f"alpha/{a_id}"
    assert parent.info.run_name == f"alpha/{a_id}"
    assert sorted(int(c.data.tags["vllm_autotune.trial"]) for c in children) == [
        t.number for t in study.trials
    ]
    assert all(c.data.tags[STUDY_TAG] == f"alpha/{a_id}" for c in children)
    assert all(c.info.lifecycle_stage == "active" for c in children)
    meta = json.loads((Path(rec.out) / "review" / "mlflow.json").read_text())
    assert (meta["study"], meta["experiment"]) == (f"alpha/{a_id}", "alpha/same-name")
    assert json.loads((Path(rec.out) / "plan.json").read_text())["study"] == f"alpha/{a_id}"
    summary = tracking.sync_study(rec.out)
    assert summary.created == 0 and summary.duplicates_deleted == 0
    assert summary.parent_run_id == parent.info.run_id and summary.trials == 2


def test_two_teams_jobs_of_one_name_are_two_experiments_and_never_touch_each_other(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alpha and beta submit ``same-name`` to one MLflow: two experiments, each team's
    prefix before the name; beta naming alpha's experiment in ``mlflow.experiment`` still
    writes under beta's prefix; no run of alpha's is deleted or changed by beta's drivers."""
    a_id = _tiny(teams, ALPHA, mlflow={"enabled": True})
    _logged(monkeypatch, teams, a_id)
    a_parent, a_children = _runs(teams, "alpha/same-name")
    before = {r.info.run_id: (r.info.status, r.data.tags) for r in [a_parent, *a_children]}

    b_id = _tiny(teams, BETA, mlflow={"enabled": True})
    _logged(monkeypatch, teams, b_id)
    squat = _tiny(teams, BETA, mlflow={"enabled": True, "experiment": "alpha/same-name"})
    _logged(monkeypatch, teams, squat)
    assert _experiments(teams) >= {"alpha/same-name", "beta/same-name", "beta/alpha/same-name"}
    b_parent, b_children = _runs(teams, "beta/same-name")
    assert b_parent.data.tags[STUDY_TAG] == f"beta/{b_id}" and len(b_children) == 2
    assert b_parent.info.status == "FINISHED"
    s_parent, _ = _runs(teams, "beta/alpha/same-name")
    assert s_parent.data.tags[STUDY_TAG] == f"beta/{squat}"

    a_parent, a_children = _runs(teams, "alpha/same-name")  # still exactly one parent
    after = {r.info.run_id: (r.info.status, r.data.tags) for r in [a_parent, *a_children]}
    assert after == before
    assert all(r.info.lifecycle_stage == "active" for r in [a_parent, *a_children])


def test_a_study_of_the_jobs_name_in_the_shared_storage_is_never_logged(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A study named like the job in the shared storage (left by `tune`, or another team's
    from before studies were named by team and id): the tracker logs the job's own trials,
    never that study's engine arguments or metrics."""
    other = optuna.create_study(study_name="same-name", storage=teams.shared)
    for _ in range(5):
        other.add_trial(
            optuna.trial.create_trial(
                value=1.0,
                user_attrs={"engine_args": json.dumps({"max-num-seqs": 7777}), "status": "x"},
            )
        )
    a_id = _tiny(teams, ALPHA, mlflow={"enabled": True})
    _logged(monkeypatch, teams, a_id)
    parent, children = _runs(teams, "alpha/same-name")
    assert len(children) == 2 and parent.info.status == "FINISHED"
    assert all(c.data.params.get("max-num-seqs") != "7777" for c in children)
    assert "same-name" not in _experiments(teams)


def test_the_operators_mlflow_uri_is_used_without_an_mlflow_mapping(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that says nothing of MLflow logs to the operator's store, not to a store in its
    study folder."""
    doc = job_doc(
        "plain",
        model={"path": "tiny-plain", "make": "tiny"},
        engine={"args": {"max-model-len": 2048}},
        trace={
            "path": job_doc()["trace"]["path"],
            "shaping": {"window_s": [0, 40], "max_model_len": 2048, "max_output_tokens": 32},
        },
        sampler={"name": "random", "seed": 1},
    )
    del doc["mlflow"]
    r = teams.client.post("/v1/studies", json=doc, headers=ALPHA)
    assert r.status_code == 201, r.text
    a_id = r.json()["id"]
    _logged(monkeypatch, teams, a_id)
    parent, children = _runs(teams, "alpha/plain")
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert not (Path(teams.service.get(a_id).out) / "mlflow.db").exists()
