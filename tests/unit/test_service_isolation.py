"""Issue 33, against the real FastAPI app with real tokens (a FAKE driver launcher, a FAKE
trial runner and a FAKE validator: no Ray, no vLLM): one team never sees or writes another's
study in a shared Optuna storage (1), every string and key of a job is plain text at
submission (2), a budget out of range is a 422 (3), what parsing a body may cost is bounded
(4), and a re-validated export is a job of its own, polled, that holds no API thread (5).

Each test here failed on the service before the fix (another team's trials read and written, a
201 or a raw key in an answer, a 500, a parse of a minute and a gigabyte, /healthz unanswered
while validations ran)."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from fastapi.testclient import TestClient

from optimizer.service.api import create_app, settings_from_args
from optimizer.service.auth import hash_token
from optimizer.service.facade import JobService
from optimizer.service.scheduler import Scheduler
from optimizer.service.security import MAX_BODY_BYTES, MAX_NODES
from optimizer.service.store import OWNER_ATTR, JobStore, owner_mark
from optimizer.text import text_problem
from tests.unit.test_api import AUTH, fake_study, poll_validation
from tests.unit.test_jobs import TRACE, FakeLauncher, job_doc, make_service

ALPHA = {"Authorization": "Bearer tok-alpha"}
BETA = {"Authorization": "Bearer tok-beta"}
ADMIN = {"Authorization": "Bearer tok-admin"}


class Teams:
    """Two teams and an admin on one service whose studies share one SQLite storage."""

    def __init__(self, tmp_path: Path, validator: Any = None, **extra: Any) -> None:
        tokens = tmp_path / "tokens"
        tokens.write_text(
            f"alpha sha256:{hash_token('tok-alpha')}\n"
            f"beta  sha256:{hash_token('tok-beta')}\n"
            f"ops   sha256:{hash_token('tok-admin')} admin\n"
        )
        self.shared = f"sqlite:///{tmp_path / 'shared-studies.db'}"
        settings = settings_from_args(
            {
                "data_dir": str(tmp_path / "data"),
                "token_file": str(tokens),
                "trace_roots": [str(TRACE.parent)],
                "allow_hub_models": True,
                "study_storage": self.shared,  # as deploy/kuberay-rayservice.yaml sets it
                **extra,  # more of the operator's settings
            }
        )
        store = JobStore(settings.database_url)
        self.service = JobService(
            settings,
            store,
            Scheduler(store, FakeLauncher()),
            check_plan=lambda _j, _b: None,
            validator=validator or (lambda _rec, _study, _choice, runs, _force: ("fake", [])),
        )
        self.client = TestClient(create_app(self.service), raise_server_exceptions=False)

    def submit(self, headers: dict[str, str], name: str = "same-name", **over: Any) -> str:
        r = self.client.post("/v1/studies", json=job_doc(name, **over), headers=headers)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def driven(self, job_id: str) -> None:
        """What the scheduler records once a driver runs: readers may open the storage."""
        self.service.store.update(job_id, progress={"storage_ready": True})


@pytest.fixture
def teams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Teams:
    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    monkeypatch.delenv("VLLM_AUTOTUNE_STORAGE", raising=False)
    return Teams(tmp_path)


def _shared_names(teams: Teams) -> set[str]:
    return {s.study_name for s in optuna.get_all_study_summaries(teams.shared)}


# --- 1. one shared storage, two teams, one job name ---------------------------------------------


def _drive(
    monkeypatch: pytest.MonkeyPatch,
    teams: Teams,
    job_id: str,
    timeout_s: float = 120,
    *,
    mlflow: bool = False,
) -> dict[str, Any]:
    """Run job ``job_id``'s driver as its Ray actor would (the real StudyHost and StudyDriver)
    with a FAKE trial runner in place of Ray's, vLLM's flags not checked; its last status.
    ``mlflow``: the driver logs to MLflow where the job says so (its real tracker)."""
    from optimizer import runners, study
    from optimizer.service.study_host import StudyHost
    from tests.unit.test_study_loop import FakeRunner

    monkeypatch.setattr(runners, "RayRunner", lambda **_k: FakeRunner())
    monkeypatch.setattr(study, "prepare", functools.partial(study.prepare, check_flags=False))
    rec = teams.service.get(job_id)
    host = StudyHost(
        rec.id,
        rec.job,
        rec.base,
        mlflow=mlflow,
        study_name=rec.study_name,
        owner=rec.owner,
    )
    host._thread.join(timeout_s)
    return host.status()


def _tiny(teams: Teams, headers: dict[str, str], name: str = "same-name", **over: Any) -> str:
    """A two-trial job on a tiny made model (made under the service's folder), so a real
    driver can run it with a fake runner."""
    return teams.submit(
        headers,
        name,
        model={"path": f"tiny-{name}", "make": "tiny"},
        engine={"args": {"max-model-len": 2048}},
        trace={
            "path": str(TRACE),
            "shaping": {"window_s": [0, 40], "max_model_len": 2048, "max_output_tokens": 32},
        },
        sampler={"name": "random", "seed": 1},
        **over,
    )


def test_two_teams_with_one_shared_storage_never_share_a_study(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alpha and beta submit a job of the same name into one shared storage: each driver
    writes its own study (named by team and job id), each team reads and exports only its own
    trials, and alpha's study is untouched by beta's driver."""
    a_id, b_id = _tiny(teams, ALPHA), _tiny(teams, BETA)
    a_rec, b_rec = teams.service.get(a_id), teams.service.get(b_id)
    assert a_rec.storage_url == b_rec.storage_url == teams.shared
    assert (a_rec.study_name, b_rec.study_name) == (f"alpha/{a_id}", f"beta/{b_id}")

    assert _drive(monkeypatch, teams, a_id)["state"] == "done"
    teams.driven(a_id)
    teams.driven(b_id)  # beta's driver "running" before it created anything: nothing to read
    alpha_view = teams.client.get(f"/v1/studies/{a_id}", headers=ALPHA).json()
    assert alpha_view["progress"]["done"] == 2 and len(alpha_view["trials_detail"]) == 2
    beta_view = teams.client.get(f"/v1/studies/{b_id}", headers=BETA).json()
    assert beta_view["trials_detail"] == [] and beta_view["front"] == []
    assert teams.client.get(f"/v1/studies/{b_id}/trials/0", headers=BETA).status_code == 404
    r = teams.client.post(f"/v1/studies/{b_id}/export?format=vllm-config", headers=BETA)
    assert r.status_code == 409, r.text  # nothing of beta's to export, never alpha's

    # Beta's driver creates its own study; alpha's keeps its two trials, none of beta's.
    assert _drive(monkeypatch, teams, b_id)["state"] == "done"
    assert _shared_names(teams) == {f"alpha/{a_id}", f"beta/{b_id}"}
    a_study = optuna.load_study(study_name=f"alpha/{a_id}", storage=teams.shared)
    b_study = optuna.load_study(study_name=f"beta/{b_id}", storage=teams.shared)
    assert len(a_study.trials) == 2 and len(b_study.trials) == 2
    assert a_study.user_attrs[OWNER_ATTR] == owner_mark("alpha", a_id)
    assert b_study.user_attrs[OWNER_ATTR] == owner_mark("beta", b_id)
    a_numbers = [t._trial_id for t in a_study.trials]
    assert not set(a_numbers) & {t._trial_id for t in b_study.trials}
    r = teams.client.post(f"/v1/studies/{b_id}/export?format=vllm-config", headers=BETA)
    assert r.status_code == 200, r.text
    assert f"beta/{b_id}" in r.text and f"alpha/{a_id}" not in r.text
    a_export = teams.client.post(f"/v1/studies/{a_id}/export?format=vllm-config", headers=ALPHA)
    assert a_export.status_code == 200 and f"alpha/{a_id}" in a_export.text
    # The study folder's plan.json records the storage name: `show` / `export` of it load it.
    from optimizer.cli_support import load_study_dir

    plan, study = load_study_dir(Path(b_rec.out))
    assert plan["study"] == f"beta/{b_id}" and len(study.trials) == 2


def test_a_driver_never_writes_into_a_study_of_its_name_that_is_not_its_own(
    teams: Teams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared storage already holding a study under a job's storage name (another service's
    job, another team's) is never resumed: the driver fails saying so and writes nothing."""
    b_id = _tiny(teams, BETA)
    b_name = teams.service.get(b_id).study_name
    squatter = optuna.create_study(study_name=b_name, storage=teams.shared)
    squatter.set_user_attr(OWNER_ATTR, owner_mark("alpha", "0123456789ab"))
    squatter.add_trial(optuna.trial.create_trial(value=1.0))
    status = _drive(monkeypatch, teams, b_id)
    assert status["state"] == "failed" and "not this job's" in status["message"], status
    assert len(optuna.load_study(study_name=b_name, storage=teams.shared).trials) == 1
    # and the API does not show it as beta's either
    teams.driven(b_id)
    view = teams.client.get(f"/v1/studies/{b_id}", headers=BETA).json()
    assert view["trials_detail"] == []


def test_a_job_stored_before_storage_names_never_reads_a_shared_study_of_its_name(
    teams: Teams,
) -> None:
    """A record written before jobs had storage names, in a shared storage: a study there
    named like its job may be another team's, so it is not read (an own-folder one still is)."""
    a_id = teams.submit(ALPHA, "legacy-name")
    optuna.create_study(study_name="legacy-name", storage=teams.shared).add_trial(
        optuna.trial.create_trial(value=1.0)
    )
    teams.service.store.update(a_id, study_name=None)  # as a store of the earlier version
    teams.driven(a_id)
    rec = teams.service.get(a_id)
    assert rec.study_name == f"alpha/{a_id}"
    assert teams.client.get(f"/v1/studies/{a_id}", headers=ALPHA).json()["trials_detail"] == []


def test_a_legacy_job_in_its_own_folder_still_reads_its_study(tmp_path: Path) -> None:
    """Without a shared storage a job's study is its folder's own file: an earlier record
    (its study named by the job) keeps reading it, unmarked."""
    svc = make_service(tmp_path, FakeLauncher())
    client = TestClient(create_app(svc))
    sid = client.post("/v1/studies", json=job_doc("own"), headers=AUTH).json()["id"]
    svc.store.update(sid, study_name=None, progress={"storage_ready": True})
    rec = svc.get(sid)
    assert rec.study_name == "own"
    study = optuna.create_study(study_name="own", storage=rec.storage_url)
    study.add_trial(optuna.trial.create_trial(value=1.0))
    assert len(client.get(f"/v1/studies/{sid}", headers=AUTH).json()["trials_detail"]) == 1


# --- 2. every string and key of a job is plain text, at submission -------------------------------

_CONTROLS = ["\t", "\n", "\r", "\x0b", "\x1f", "\x85", "\u2028", "\u2029", "\x00", "\x7f"]


def _set(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@pytest.mark.parametrize("ctrl", _CONTROLS, ids=[f"U+{ord(c):04X}" for c in _CONTROLS])
@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("budget",), "1h{}"),
        (("until",), "07:00{}"),
        (("objectives",), {"preset": None, "objectives": ["min:p95_ttft_ms{}"]}),
        (("objectives",), {"slos": ["p95_ttft_ms<=500{}"]}),
        (("storage",), "sqlite:////tmp/x{}.db"),
        (("out",), "somewhere{}else"),
        (("ray_address",), "ray://head{}:10001"),
        (("mlflow",), {"enabled": False, "tracking_uri": "http://m{}"}),
    ],
    ids=["budget", "until", "objectives", "slos", "storage", "out", "ray_address", "mlflow"],
)
def test_a_control_character_in_any_field_is_refused_at_submission(
    teams: Teams, path: tuple[str, ...], value: Any, ctrl: str
) -> None:
    doc = job_doc("ctl")
    filled = json.loads(json.dumps(value).replace("{}", json.dumps(ctrl)[1:-1]))
    _set(doc, path, filled)
    r = teams.client.post("/v1/studies", json=doc, headers=ALPHA)
    assert r.status_code == 422, r.text[:300]
    detail = r.json()["detail"]
    named = {
        "objectives": "objectives.objectives.0",
        "mlflow": "mlflow.tracking_uri",
    }.get(path[0], path[0])
    if "slos" in json.dumps(value):
        named = "objectives.slos.0"
    assert named in detail, detail
    assert all(text_problem(line) is None for line in detail.split("\n")), detail
    assert "notes" not in r.json()
    assert teams.client.get("/v1/studies", headers=ALPHA).json() == []


@pytest.mark.parametrize("ctrl", _CONTROLS, ids=[f"U+{ord(c):04X}" for c in _CONTROLS])
def test_an_unknown_key_is_never_echoed_raw(teams: Teams, ctrl: str) -> None:
    """A control character in an unknown key (top level or nested, job or envelope): refused,
    the answer one error a line and none of them holding the character."""
    for body in (
        {"job": {**job_doc("k"), f"bad{ctrl}key": 1}},
        {"job": job_doc("k", sampler={f"na{ctrl}me": "tpe"})},
        {"job": job_doc("k"), f"not{ctrl}before": "2031-01-01T00:00:00"},
    ):
        r = teams.client.post("/v1/studies", json=body, headers=ALPHA)
        assert r.status_code == 422, r.text[:300]
        detail, errors = r.json()["detail"], r.json()["errors"]
        assert all(text_problem(line) is None for line in detail.split("\n")), detail
        assert len(errors) == 1 and text_problem(errors[0]) is None, errors
    # without a control character an unknown key is still named, as before
    r = teams.client.post("/v1/studies", json=job_doc("k", sampler={"nmae": "tpe"}), headers=ALPHA)
    assert r.json()["errors"] == ["sampler.nmae: unknown key; did you mean 'name'?"]


def test_a_replaced_out_is_noted_as_one_plain_line(teams: Teams) -> None:
    r = teams.client.post("/v1/studies", json=job_doc("o", out="mine/" + "x" * 500), headers=ALPHA)
    assert r.status_code == 201, r.text
    (note,) = [n for n in r.json()["notes"] if n.startswith("out:")]
    assert text_problem(note) is None and "x" * 201 not in note


# --- 3. a budget out of range -------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["9999999999999h", "1" * 400 + "h", "8761h", "525601m"])
def test_a_budget_out_of_range_is_a_422_with_the_range(teams: Teams, budget: str) -> None:
    r = teams.client.post(
        "/v1/studies", json=job_doc("b", budget=budget, trials=None), headers=ALPHA
    )
    assert r.status_code == 422, r.text[:300]
    assert "budget" in r.json()["detail"] and "at most 8760h" in r.json()["detail"]
    assert (
        teams.client.post(
            "/v1/studies", json=job_doc("b", budget="8760h"), headers=ALPHA
        ).status_code
        == 201
    )


# --- 4. what parsing a body may cost -------------------------------------------------------------


def _cost(send: Any) -> tuple[Any, int]:
    """(response, peak Python allocation in bytes while ``send`` ran)."""
    tracemalloc.start()
    try:
        response = send()
        return response, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _under_cap(item: bytes, head: bytes = b"", tail: bytes = b"") -> bytes:
    n = (MAX_BODY_BYTES - len(head) - len(tail) - 16) // len(item)
    return head + item * n + tail


@pytest.mark.parametrize(
    ("ctype", "body"),
    [
        ("application/yaml", _under_cap(b"- {}\n")),
        ("application/yaml", _under_cap(b"a: 1\n", b"job:\n  x:\n", b"")),
        ("application/yaml", _under_cap(b"[", b"", b"")),
        ("application/json", _under_cap(b"{},", b"[", b"{}]")),
        ("application/json", _under_cap(b"1,", b'{"job": [', b"1]}")),
        ("application/json", _under_cap(b'"",', b"[", b'""]')),
    ],
    ids=["yaml-list-of-maps", "yaml-many-keys", "yaml-deep", "json-maps", "json-ints", "json-strs"],
)
def test_a_body_under_the_cap_is_refused_cheaply(teams: Teams, ctype: str, body: bytes) -> None:
    """Bodies just under the cap that parse into millions of values: refused while (YAML) or
    before (JSON) they are parsed, far under 100 MiB (before: 74 s and +996 MiB for the first)."""
    assert len(body) <= MAX_BODY_BYTES
    r, peak = _cost(
        lambda: teams.client.post(
            "/v1/studies", content=body, headers={**ALPHA, "Content-Type": ctype}
        )
    )
    assert r.status_code == 422, r.text[:300]
    # (libyaml itself refuses flow nesting past 1000 levels: "not valid YAML")
    said = (f"more than {MAX_NODES} values", "deeper than", "not valid YAML")
    assert any(s in r.json()["detail"] for s in said), r.text[:300]
    assert peak < 100 * 1024**2, f"{peak / 1024**2:.0f} MiB"


def test_a_body_over_the_cap_is_413_before_it_is_parsed(teams: Teams) -> None:
    big = b"- {}\n" * (MAX_BODY_BYTES // 5 + 1)
    for ctype in ("application/yaml", "application/json"):
        r = teams.client.post("/v1/studies", content=big, headers={**ALPHA, "Content-Type": ctype})
        assert r.status_code == 413, r.text[:300]
        assert "multipart `trace` part" in r.json()["detail"]
    r = teams.client.post(
        "/v1/studies",
        files={"job": ("job.yaml", big, "application/yaml")},
        headers=ALPHA,
    )
    assert r.status_code == 413 and "`job` part" in r.json()["detail"], r.text[:300]


def test_a_large_trace_still_goes_as_a_multipart_part(tmp_path: Path) -> None:
    """The cap is the job's: a trace larger than it streams in as a multipart part."""
    svc = make_service(
        tmp_path, FakeLauncher(), max_upload_bytes=64 * 1024**2, max_trace_rows=10**6
    )
    client = TestClient(create_app(svc))
    header, row = TRACE.read_bytes().split(b"\n", 2)[:2]
    data = header + b"\n" + (row + b"\n") * (MAX_BODY_BYTES // len(row) + 10)
    r = client.post(
        "/v1/studies",
        files={"job": ("job.yaml", yaml.safe_dump(job_doc("big"))), "trace": ("big.csv", data)},
        headers=AUTH,
    )
    assert r.status_code == 201, r.text[:300]


# --- 5. a re-validated export is a job, polled, off the request path ----------------------------


class BlockingValidator:
    """A FAKE validator: each re-validation waits until :attr:`release` is set (a slow
    re-measurement), then reports a gain."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def __call__(self, rec: Any, _study: Any, _choice: Any, runs: int, _force: bool) -> Any:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.release.wait(120)
            return f"fake gain of {rec.owner}, {runs} runs", []
        finally:
            with self._lock:
                self.running -= 1


def test_validations_are_queued_per_team_and_the_api_keeps_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    monkeypatch.delenv("VLLM_AUTOTUNE_STORAGE", raising=False)
    validator = BlockingValidator()
    teams = Teams(tmp_path, validator)
    a_id, b_id = teams.submit(ALPHA, "a-study"), teams.submit(BETA, "b-study")
    for sid in (a_id, b_id):
        fake_study(teams.service, sid)
        teams.driven(sid)

    def validate(sid: str, headers: dict[str, str]) -> Any:
        return teams.client.post(
            f"/v1/studies/{sid}/export",
            params={"format": "vllm-config", "validate": "true", "runs": 2},
            headers=headers,
        )

    # 41 at once, as in the issue: each answers at once (202, or 429 past a team's queue).
    asks = [(a_id, ALPHA)] * 21 + [(b_id, BETA)] * 20
    with concurrent.futures.ThreadPoolExecutor(41) as pool:
        answers = list(pool.map(lambda a: validate(*a), asks))
    assert {r.status_code for r in answers} == {202, 429}, {r.status_code for r in answers}
    queued = [r.json() for r in answers if r.status_code == 202]
    assert len(queued) == 10  # per team: one running and four waiting
    refused = next(r for r in answers if r.status_code == 429)
    assert "one of a team runs at a time" in refused.json()["detail"]
    # While they hold every validation worker: the API answers. The bound is wide (a busy CI);
    # validation on the request path would hold these until the validator's release, never.
    for _ in range(5):
        t0 = time.monotonic()
        assert teams.client.get("/healthz").status_code == 200
        assert teams.client.get(f"/v1/studies/{a_id}", headers=ALPHA).status_code == 200
        assert time.monotonic() - t0 < 10.0
    states = {
        d["id"]: teams.client.get(d["poll"], headers=ALPHA if d["study"] == a_id else BETA).json()
        for d in queued
    }
    running = [d for d in states.values() if d["state"] == "running"]
    assert sorted(d["study"] for d in running) == sorted([a_id, b_id])  # one per team
    deadline = time.monotonic() + 60  # both threads reach the validator (a busy CI: generous)
    while validator.running < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert validator.running == 2
    first_a = next(d for d in running if d["study"] == a_id)
    r = teams.client.get(f"{first_a['poll']}/export", headers=ALPHA)
    assert r.status_code == 409 and "poll" in r.json()["detail"]
    # another team never sees one: 404, as for its study
    assert teams.client.get(first_a["poll"], headers=BETA).status_code == 404
    assert teams.client.get(f"{first_a['poll']}/export", headers=BETA).status_code == 404

    validator.release.set()
    for d in queued:
        headers = ALPHA if d["study"] == a_id else BETA
        done = poll_validation(teams.client, d["poll"], headers)
        assert done["state"] == "done", done
        r = teams.client.get(done["download"], headers=headers)
        assert r.status_code == 200 and r.headers["x-autotune-trial"] == "1"
        owner = "alpha" if d["study"] == a_id else "beta"
        assert f"fake gain of {owner}, 2 runs" in r.text
    assert validator.most == 2  # never more than one per team


def test_a_validation_that_would_be_refused_is_refused_at_once(teams: Teams) -> None:
    """No study yet, or a study without a baseline: 409 now, not a queued job that fails."""
    sid = teams.submit(ALPHA, "early")
    r = teams.client.post(
        f"/v1/studies/{sid}/export?format=vllm-config&validate=true", headers=ALPHA
    )
    assert r.status_code == 409 and "has not started" in r.json()["detail"]
    assert teams.client.get(f"/v1/studies/{sid}/validations/nope", headers=ALPHA).status_code == 404
