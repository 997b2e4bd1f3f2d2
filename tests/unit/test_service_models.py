"""Issue 42, item 4: models made by ``model.make`` are their team's. Against the real FastAPI
app and JobService with real tokens (two teams and an admin, as
tests/unit/test_service_isolation.py), the real plan check making the model folders (vLLM's
flags not checked), a FAKE driver launcher.

Before the fix a made model landed in the shared DATA_DIR/models, which was also searched for
every relative model name before hub names: team beta's ``{path: acme/prod-model, make: tiny}``
made every later job naming ``acme/prod-model``, any team's, a hub name included, serve beta's
dummy model, after beta's job was cancelled too. Each test here failed then."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from optimizer import study
from optimizer.config import JobConfig
from optimizer.engine.models import make_model
from tests.unit.test_jobs import TRACE, job_doc
from tests.unit.test_service_isolation import ADMIN, ALPHA, BETA, Teams

HUB_NAME = "acme/prod-model"


def _teams(tmp_path: Path, **settings: Any) -> Teams:
    teams = Teams(tmp_path, **settings)

    def check_plan(job: JobConfig, base: Path) -> None:
        # the service's plan check, which makes the model folder, without vLLM's flag check
        study.prepare(job, base, check_flags=False)

    teams.service.check_plan = check_plan
    return teams


@pytest.fixture
def teams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Teams:
    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    monkeypatch.delenv("VLLM_AUTOTUNE_STORAGE", raising=False)
    return _teams(tmp_path)


def _post(teams: Teams, headers: dict[str, str], model: dict[str, Any]) -> Any:
    return teams.client.post(
        "/v1/studies",
        json=job_doc(
            "m",
            model=model,
            engine={"args": {"max-model-len": 2048}},
            trace={"path": str(TRACE), "shaping": {"window_s": [0, 10], "max_model_len": 2048}},
        ),
        headers=headers,
    )


def _model_of(teams: Teams, response: Any) -> str:
    assert response.status_code == 201, response.text[:300]
    return str(teams.service.get(response.json()["id"]).job["model"]["path"])


def _plant(teams: Teams, headers: dict[str, str]) -> Path:
    """Beta makes a dummy model under a hub name; returns where it landed."""
    r = _post(teams, headers, {"path": HUB_NAME, "make": "tiny"})
    folder = Path(_model_of(teams, r))
    assert (folder / "config.json").is_file()
    return folder


def test_a_made_model_is_made_in_its_teams_folder(teams: Teams) -> None:
    folder = _plant(teams, BETA)
    models = teams.service.data_dir / "models"
    assert folder == models / "beta" / HUB_NAME
    assert not (models / HUB_NAME).exists()
    assert _model_of(teams, _post(teams, ALPHA, {"path": "x/tiny", "make": "tiny"})) == str(
        models / "alpha" / "x" / "tiny"
    )


def test_another_teams_name_never_resolves_to_a_made_model(teams: Teams) -> None:
    """Beta plants ``acme/prod-model`` and cancels its job: alpha's and the admin's jobs
    naming it get the hub model, never beta's folder."""
    _plant(teams, BETA)
    for job in teams.client.get("/v1/studies", headers=BETA).json():
        teams.client.post(f"/v1/studies/{job['id']}/cancel", headers=BETA)
    for who in (ALPHA, ADMIN):
        assert _model_of(teams, _post(teams, who, {"path": HUB_NAME})) == HUB_NAME
    assert _model_of(teams, _post(teams, BETA, {"path": HUB_NAME})) == HUB_NAME  # a hub name


def test_another_teams_made_model_is_refused_by_path(teams: Teams) -> None:
    """Alpha naming beta's made folder outright, or making into it through ``..``: 403, and
    beta's folder is not written."""
    folder = _plant(teams, BETA)
    stamp = (folder / "config.json").stat().st_mtime_ns
    for model in (
        {"path": str(folder)},
        {"path": str(folder), "make": "tiny"},
        {"path": f"../beta/{HUB_NAME}", "make": "small"},
        {"path": f"../beta/{HUB_NAME}"},
    ):
        r = _post(teams, ALPHA, model)
        assert r.status_code in (403, 422), (model, r.status_code, r.text[:300])
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    # beta reaches its own made model again: by making it (the folder is reused) or by path
    assert _model_of(teams, _post(teams, BETA, {"path": str(folder)})) == str(folder)
    assert _model_of(teams, _post(teams, BETA, {"path": HUB_NAME, "make": "tiny"})) == str(folder)


@pytest.mark.parametrize("hub", [True, False])
def test_a_model_made_before_team_folders_is_never_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub: bool
) -> None:
    """A folder an earlier version made in the shared DATA_DIR/models (any team's) is no model
    root: a job naming it gets the hub model, or a 403 where the operator allows no hub names."""
    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    monkeypatch.delenv("VLLM_AUTOTUNE_STORAGE", raising=False)
    teams = _teams(tmp_path, allow_hub_models=hub)
    legacy = make_model(teams.service.data_dir / "models" / HUB_NAME, "tiny")
    r = _post(teams, ALPHA, {"path": HUB_NAME})
    if hub:
        assert _model_of(teams, r) == HUB_NAME
    else:
        assert r.status_code == 403, r.text[:300]
    assert _post(teams, ALPHA, {"path": str(legacy)}).status_code == 403
