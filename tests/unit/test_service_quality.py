"""Issue 44 in the service: a service study runs the quality gate before it ends, as ``tune``
does, through its runner (each check in an actor pinned to the GPUs its servers need), so the
export picks the best configuration that passes. The real JobService, StudyHost and
StudyDriver on a real SQLite storage; the trial runner is a FAKE (no Ray, no vLLM) and so is
the check (its servers are tested in tests/integration/test_quality_vllm.py)."""

from __future__ import annotations

import functools
import re
from typing import Any

import optuna
import pytest

from optimizer.quality import stage
from optimizer.quality.check import Verdict
from optimizer.trial_view import TrialView, quality_verdicts
from tests.unit.test_service_isolation import ALPHA, Teams, _tiny
from tests.unit.test_study_loop import FakeRunner

FP8 = {"max-num-seqs": 64, "kv-cache-dtype": "fp8"}


@pytest.fixture
def teams(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Teams:
    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    monkeypatch.delenv("VLLM_AUTOTUNE_STORAGE", raising=False)
    return Teams(tmp_path)


class PlacingRunner(FakeRunner):
    """A FAKE runner whose ``call`` records the GPUs asked and runs the check here."""

    def __init__(self) -> None:
        super().__init__()
        self.placed: list[int] = []

    def call(self, fn: Any, gpus: int = 0) -> Any:
        self.placed.append(gpus)
        return fn()


def _drive(monkeypatch: pytest.MonkeyPatch, teams: Teams, job_id: str) -> dict[str, Any]:
    from optimizer import runners, study
    from optimizer.service.study_host import StudyHost

    made: list[PlacingRunner] = []

    def ray_runner(**_k: Any) -> PlacingRunner:
        made.append(PlacingRunner())
        return made[-1]

    monkeypatch.setattr(runners, "RayRunner", ray_runner)
    monkeypatch.setattr(study, "prepare", functools.partial(study.prepare, check_flags=False))
    rec = teams.service.get(job_id)
    host = StudyHost(
        rec.id, rec.job, rec.base, mlflow=False, study_name=rec.study_name, owner=rec.owner
    )
    host._thread.join(120)
    status = host.status()
    status["placed"] = made[0].placed if made else None
    return status


def _job(teams: Teams, quality: dict[str, Any]) -> str:
    return _tiny(
        teams,
        ALPHA,
        search_space={
            "name": "t",
            "params": {
                "max-num-seqs": {"type": "int", "low": 4, "high": 64},
                "kv-cache-dtype": {"type": "categorical", "choices": ["auto", "fp8"]},
            },
        },
        enqueue=[FP8],
        trials=3,
        quality=quality,
    )


def test_a_service_study_gates_its_front_and_exports_the_best_that_passes(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[dict[str, Any]] = []

    def fake_check(model: str, args: dict[str, Any], *_a: Any, **_k: Any) -> Verdict:
        checked.append(args)
        if args.get("kv-cache-dtype") == "fp8":
            return Verdict("fail", "fake: drift 0.2 over the floor", {"kv-cache-dtype": "fp8"})
        return Verdict("unchanged", "fake: unchanged")

    monkeypatch.setattr(stage, "check_configuration", fake_check)
    job_id = _job(teams, {"enabled": True})
    status = _drive(monkeypatch, teams, job_id)
    assert status["state"] == "done", status
    rec = teams.service.get(job_id)
    study = optuna.load_study(study_name=rec.study_name, storage=rec.storage_url)
    fp8 = [
        t.number for t in study.trials if TrialView(t).engine_args.get("kv-cache-dtype") == "fp8"
    ]
    verdicts = quality_verdicts(study)
    assert fp8 and all(verdicts[n]["status"] == "fail" for n in fp8 if n in verdicts)
    refused = [n for n in fp8 if n in verdicts]
    assert refused, "the front's fp8 member was never checked"
    # each numeric-changing check went through the runner's call, on no GPU (the CPU build)
    assert status["placed"] == [0] * len(refused)
    teams.driven(job_id)
    r = teams.client.post(
        f"/v1/studies/{job_id}/export?format=vllm-config&policy=max-throughput", headers=ALPHA
    )
    assert r.status_code == 200, r.text
    chosen = int(r.headers["X-Autotune-Trial"])
    assert chosen not in refused
    assert re.search(rf"Refused by the quality gate: trial {refused[0]}\b", r.text)


def test_a_service_study_with_the_gate_off_checks_nothing(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stage, "check_configuration", lambda *a, **k: pytest.fail("checked"))
    job_id = _job(teams, {"enabled": False})
    status = _drive(monkeypatch, teams, job_id)
    assert status["state"] == "done", status
    rec = teams.service.get(job_id)
    study = optuna.load_study(study_name=rec.study_name, storage=rec.storage_url)
    assert quality_verdicts(study) == {} and status["placed"] == []


def test_a_cancel_while_the_gate_checks_ends_the_check(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling a study whose trials are done and whose gate is checking a configuration
    ends the check (the runner's close ends the call's actor and its servers): the study is
    cancelled, not left to finish the check."""
    import threading
    import time

    from optimizer import runners, study
    from optimizer.service.study_host import StudyHost

    checking, closed = threading.Event(), threading.Event()

    class HeldRunner(FakeRunner):
        def call(self, fn: Any, gpus: int = 0) -> Any:
            checking.set()
            if closed.wait(60):
                raise RuntimeError("the call's actor was killed")
            return fn()

        def close(self) -> None:
            closed.set()

    def fake_check(model: str, args: dict[str, Any], *_a: Any, **_k: Any) -> Verdict:
        return Verdict("pass", "fake: pass", {"kv-cache-dtype": "fp8"})

    monkeypatch.setattr(stage, "check_configuration", fake_check)
    monkeypatch.setattr(runners, "RayRunner", lambda **_k: HeldRunner())
    monkeypatch.setattr(study, "prepare", functools.partial(study.prepare, check_flags=False))
    job_id = _job(teams, {"enabled": True})
    rec = teams.service.get(job_id)
    host = StudyHost(
        rec.id, rec.job, rec.base, mlflow=False, study_name=rec.study_name, owner=rec.owner
    )
    assert checking.wait(60), f"the gate never checked the fp8 member: {host.status()}"
    t0 = time.monotonic()
    host.cancel()
    host._thread.join(30)
    status = host.status()
    assert status["state"] == "cancelled", status
    assert "quality gate not run to its end" in status["message"]
    assert time.monotonic() - t0 < 10
