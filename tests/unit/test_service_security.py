"""The service as a hostile-but-fair token holder would try it (issues 13 and 24), over the HTTP
API with a real JobService and a FAKE driver launcher: code-loading engine flags and
environment, paths outside the operator's roots, YAML alias bombs, deep nesting, unreadable
traces, flags `tune` refuses, other teams' studies, exports of what the service would refuse;
then (section 6) names and paths with control characters, search-space files by any name,
relative model paths, long upload names, traces over the row limit and large uploads.

Each test here failed on the service before the fix (a 201, a 500, a file written, another
team's study listed) and passes after it."""

from __future__ import annotations

import base64
import json
import logging
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from optimizer.service.api import create_app, settings_from_args
from optimizer.service.facade import JobService
from optimizer.service.scheduler import Scheduler
from optimizer.service.store import JobStore
from optimizer.service.submissions import Submission
from tests.unit.test_api import AUTH, fake_study
from tests.unit.test_jobs import TRACE, FakeLauncher, job_doc, make_service


@pytest.fixture
def service(tmp_path: Path) -> JobService:
    return make_service(tmp_path, FakeLauncher(), max_upload_bytes=1024**2)


@pytest.fixture
def client(service: JobService) -> TestClient:
    return TestClient(create_app(service), raise_server_exceptions=False)


def _post(client: TestClient, doc: dict[str, Any], headers: dict[str, str] = AUTH) -> Any:
    return client.post("/v1/studies", json=doc, headers=headers)


def _upload(name: str, data: bytes) -> dict[str, str]:
    return {"filename": name, "content_b64": base64.b64encode(data).decode()}


# --- 1. engine flags and environment: performance only, never code ------------------------------


@pytest.mark.parametrize(
    ("where", "flag", "value"),
    [
        ("args", "tool-parser-plugin", "/data/uploads/x/trace.csv"),
        ("args", "tool_parser_plugin", "plugin.py"),
        ("args", "reasoning-parser-plugin", "plugin.py"),
        ("args", "io-processor-plugin", "x"),
        ("args", "chat-template", "/etc/passwd"),
        ("args", "tokenizer", "/somewhere/tok"),
        ("args", "download-dir", "/tmp/anywhere"),
        ("args", "served-model-name", "/x"),
        ("args", "config", "/tmp/cfg.yaml"),
        ("args", "trust-remote-code", True),
        ("args", "logging-config", "/tmp/log.json"),
        ("args", "compilation-config", {"inductor_passes": {"x": "mod.fn"}}),
        ("args", "speculative-config", {"method": "draft_model", "model": "/tmp/m"}),
        ("args", "distributed-executor-backend", "my.module.Executor"),
        ("baseline_args", "tool-parser-plugin", "plugin.py"),
    ],
)
def test_code_loading_engine_flags_are_refused_naming_the_flag(
    client: TestClient, where: str, flag: str, value: Any
) -> None:
    r = _post(client, job_doc("flags", engine={where: {flag: value}}))
    assert r.status_code == 422, r.text
    assert flag.split(".")[0] in r.json()["detail"]


def test_code_loading_flags_in_the_search_space_are_refused(client: TestClient) -> None:
    space = {
        "name": "evil",
        "params": {
            "max-num-seqs": {"type": "int", "low": 4, "high": 64},
            "tool-parser-plugin": {"type": "categorical", "choices": ["a.py", "b.py"]},
        },
    }
    r = _post(client, job_doc("space", search_space=space))
    assert r.status_code == 422, r.text
    assert "tool-parser-plugin" in r.json()["detail"]
    fixed = {"name": "evil", "fixed": {"chat-template": "/etc/shadow"}, "params": {}}
    r = _post(client, job_doc("space", search_space=fixed))
    assert r.status_code == 422 and "chat-template" in r.json()["detail"], r.text


def test_tuning_flags_of_the_presets_are_accepted(client: TestClient) -> None:
    args = {
        "max-num-seqs": 64,
        "enable-prefix-caching": True,
        "no-enable-chunked-prefill": True,
        "kv_cache_dtype": "fp8",
        "speculative-config": {"method": "ngram", "num_speculative_tokens": 3},
    }
    r = _post(client, job_doc("ok-flags", engine={"args": args}, search_space="latency"))
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    "env",
    [
        {"VLLM_PLUGINS": "evil"},
        {"OPENSSL_CONF": "/data/uploads/x/trace.csv"},
        {"HF_HOME": "/tmp/anywhere"},
        {"LD_PRELOAD": "/tmp/x.so"},
        {"PYTHONPATH": "/tmp"},
        {"VLLM_LOGGING_LEVEL": "INFO; rm -rf /"},
    ],
)
def test_environment_is_an_allow_list(client: TestClient, env: dict[str, str]) -> None:
    r = _post(client, job_doc("env", engine={"env": env}))
    assert r.status_code == 422, r.text
    assert next(iter(env)) in r.json()["detail"]


def test_flags_tune_refuses_are_refused_at_submit(client: TestClient) -> None:
    r = _post(client, job_doc("typo", engine={"args": {"max-num-seqz": 8}}))
    assert r.status_code == 422, r.text
    assert "max-num-seqz" in r.json()["detail"] and "max-num-seqs" in r.json()["detail"]
    r = _post(client, job_doc("badval", engine={"args": {"enable-prefix-caching": "maybe"}}))
    assert r.status_code == 422, r.text


# --- 2. paths: confined to the operator's roots; storage and MLflow are the operator's ----------


def test_make_model_cannot_write_outside_the_data_folder(tmp_path: Path) -> None:
    svc = make_service(tmp_path, FakeLauncher(), real_check=True)
    client = TestClient(create_app(svc), raise_server_exceptions=False)
    target = tmp_path / "elsewhere" / "planted-model"
    r = _post(client, job_doc("mk", model={"path": str(target), "make": "tiny"}))
    assert r.status_code == 403, r.text
    assert not target.exists() and not target.parent.exists()
    # a relative make target lands in the service's own model folder
    r = _post(client, job_doc("mk2", model={"path": "mine/tiny", "make": "tiny"}))
    assert r.status_code == 201, r.text
    rec = svc.get(r.json()["id"])
    assert Path(rec.job["model"]["path"]).is_relative_to(svc.data_dir / "models")


def test_a_local_model_outside_the_model_roots_is_refused(
    client: TestClient, tmp_path: Path
) -> None:
    folder = tmp_path / "private-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    r = _post(client, job_doc("local", model={"path": str(folder)}))
    assert r.status_code == 403, r.text


@pytest.mark.parametrize(
    "over",
    [
        {"storage": "sqlite:///{tmp}/elsewhere/evil.db"},
        {"storage": "journal:///{tmp}/elsewhere/evil.log"},
        {"mlflow": {"enabled": True, "tracking_uri": "sqlite:///{tmp}/elsewhere/mlflow.db"}},
        {"mlflow": {"enabled": True, "tracking_uri": "file:///{tmp}/elsewhere/mlruns"}},
    ],
)
def test_storage_and_mlflow_urls_are_the_operators(
    client: TestClient, service: JobService, tmp_path: Path, over: dict[str, Any]
) -> None:
    doc = json.loads(json.dumps(over).replace("{tmp}", str(tmp_path).lstrip("/")))
    r = _post(client, job_doc("urls", **doc))
    assert r.status_code == 201, r.text
    rec = service.get(r.json()["id"])
    assert "elsewhere" not in rec.storage_url
    assert "elsewhere" not in json.dumps(rec.job)
    assert rec.storage_url == f"sqlite:///{rec.out}/study.db"
    assert any("ignored" in n for n in r.json()["notes"])


def test_the_stability_stage_is_not_run_by_the_service_and_it_says_so(
    client: TestClient, service: JobService
) -> None:
    r = _post(client, job_doc("stab", stability={"after_study": True, "minutes": 5}))
    assert r.status_code == 201, r.text
    assert any(n.startswith("stability.after_study: ignored") for n in r.json()["notes"])
    stability = service.get(r.json()["id"]).job["stability"]
    assert stability["after_study"] is False and stability["minutes"] == 5


def test_a_warm_start_from_study_folders_is_refused(client: TestClient, tmp_path: Path) -> None:
    """Earlier study folders are paths of the service's machine (another team's studies too):
    the service reads none, whether or not the folder exists, and says what to do instead."""
    for folder in (str(tmp_path), "/nowhere/at/all"):
        r = _post(client, job_doc("warm", warm_start={"studies": [folder]}))
        assert r.status_code == 422, r.text
        assert "warm_start" in r.text and "enqueue" in r.text and folder not in r.text


# --- 3. parsing with limits; malformed input is a 4xx that quotes nothing -----------------------


def _alias_bomb(levels: int) -> str:
    lines = ['a0: &a0 ["xxxxxxxxxxxxxxxx"]']
    for i in range(1, levels + 1):
        refs = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    job = yaml.safe_dump(job_doc("bomb"))
    return job + "\n".join(lines) + f"\nextra: *a{levels}\n"


def test_yaml_aliases_are_refused_before_anything_is_expanded(client: TestClient) -> None:
    body = _alias_bomb(5)  # 9**5 = 59,049 copies if expanded
    assert len(body) < 1500
    tracemalloc.start()
    try:
        r = client.post(
            "/v1/studies", content=body, headers={**AUTH, "Content-Type": "application/yaml"}
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status_code == 422, r.text
    assert "alias" in r.json()["detail"]
    assert peak < 8 * 1024**2, peak  # nothing was expanded
    ok = yaml.safe_dump(job_doc("anchor-free"))
    r = client.post("/v1/studies", content=ok, headers={**AUTH, "Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        ('{"job": ' + "[" * 50_000 + "]" * 50_000 + "}", "application/json"),
        ("[" * 50_000 + "]" * 50_000, "application/json"),
        ("job: " + "[" * 50_000 + "]" * 50_000, "application/yaml"),
        ("a:\n" + "".join(" " * i + "- \n" for i in range(1, 2000)), "application/yaml"),
        ('{"name": ' + "9" * 6000 + "}", "application/json"),
        ("name: 2023-99-99\n", "application/yaml"),
        ("name: " + "9" * 6000 + "\n", "application/yaml"),
        ("? [a, b]\n: c\n", "application/yaml"),
        ("\xff\xfe not utf-8", "application/yaml"),
    ],
)
def test_malformed_and_deep_documents_are_4xx_not_500(
    client: TestClient, body: str, ctype: str
) -> None:
    data = body.encode("latin-1") if body.startswith("\xff") else body.encode()
    r = client.post("/v1/studies", content=data, headers={**AUTH, "Content-Type": ctype})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])


def test_a_huge_string_in_a_job_is_refused(client: TestClient) -> None:
    r = _post(client, job_doc("big", engine={"env": {"HF_TOKEN": "a" * 200_000}}))
    assert r.status_code == 422, r.text[:300]
    assert "aaaa" not in r.text


SECRET = "sekrit-column-7f3a"


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("unknown-header.csv", f"{SECRET},b\n1,2\n".encode()),
        ("header.jsonl", f'{{"format": "{SECRET}", "version": 1}}\n{{"arrival_s": 0}}\n'.encode()),
        ("bad-row.csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n{SECRET},1,1\n".encode()),
        (
            "huge-field.csv",
            b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + b"x" * 300_000 + b",1,1\n",
        ),
        ("binary.csv", bytes(range(256)) * 400),
        ("many-rows.jsonl", b'{"a": 1}\n' * 100_000),
    ],
)
def test_unreadable_traces_are_422_and_their_content_is_never_quoted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, data: bytes
) -> None:
    svc = make_service(tmp_path, FakeLauncher(), real_check=True, max_upload_bytes=4 * 1024**2)
    client = TestClient(create_app(svc), raise_server_exceptions=False)
    caplog.set_level(logging.DEBUG)
    doc = {"job": job_doc("tr", trace={"path": "x.csv"}), "trace_upload": _upload(name, data)}
    r = _post(client, doc)
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert SECRET not in r.text and "xxxx" not in r.text
    assert SECRET not in caplog.text


# --- 4. ownership: a team sees, cancels and exports its own studies -----------------------------


@pytest.fixture
def teams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, JobService]:
    from optimizer.service.auth import hash_token

    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    tokens = tmp_path / "tokens"
    tokens.write_text(
        "# team token role\n"
        "alpha  tok-alpha\n"
        f"beta   sha256:{hash_token('tok-beta')}\n"
        f"ops    sha256:{hash_token('tok-admin')}  admin\n"
    )
    settings = settings_from_args(
        {
            "data_dir": str(tmp_path / "data"),
            "token_file": str(tokens),
            "trace_roots": [str(TRACE.parent)],
            "allow_hub_models": True,  # job_doc's model is a hub name
        }
    )
    store = JobStore(settings.database_url)
    svc = JobService(
        settings, store, Scheduler(store, FakeLauncher()), check_plan=lambda _j, _b: None
    )
    svc.validator = lambda _rec, _study, _choice, runs, _force: ("fake", [])
    return TestClient(create_app(svc), raise_server_exceptions=False), svc


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_team_sees_cancels_and_exports_only_its_own_studies(
    teams: tuple[TestClient, JobService],
) -> None:
    client, svc = teams
    alpha, beta, admin = _bearer("tok-alpha"), _bearer("tok-beta"), _bearer("tok-admin")
    r = _post(client, job_doc("alpha-study"), headers=alpha)
    assert r.status_code == 201, r.text
    a_id = r.json()["id"]
    b_id = _post(client, job_doc("beta-study"), headers=beta).json()["id"]
    fake_study(svc, a_id)
    svc.store.update(a_id, progress={"storage_ready": True})

    assert [s["id"] for s in client.get("/v1/studies", headers=alpha).json()] == [a_id]
    assert [s["id"] for s in client.get("/v1/studies", headers=beta).json()] == [b_id]
    assert {s["id"] for s in client.get("/v1/studies", headers=admin).json()} == {a_id, b_id}
    for url, method in (
        (f"/v1/studies/{a_id}", "get"),
        (f"/v1/studies/{a_id}/trials/0", "get"),
        (f"/v1/studies/{a_id}/export?format=vllm-config", "post"),
        (f"/v1/studies/{a_id}/cancel", "post"),
    ):
        r = client.request(method, url, headers=beta)
        assert r.status_code == 404, (url, r.status_code, r.text)
        assert client.request(method, url, headers=admin).status_code == 200, url
    assert client.get(f"/v1/studies/{a_id}", headers=alpha).json()["owner"] == "alpha"
    assert svc.get(b_id).state == "queued"  # beta's own study was never touched by alpha


def test_tokens_are_kept_as_digests_with_their_team(tmp_path: Path) -> None:
    from optimizer.service.auth import hash_token

    tokens = tmp_path / "tokens"
    tokens.write_text(f"alpha sha256:{hash_token('tok-alpha')}\n")
    settings = settings_from_args({"data_dir": str(tmp_path / "d"), "token_file": str(tokens)})
    assert "tok-alpha" not in repr(settings)
    assert [(e.team, e.admin) for e in settings.tokens] == [("alpha", False)]


# --- export refuses what the service would refuse ---------------------------------------------


def test_export_refuses_a_study_whose_trials_load_code(
    client: TestClient, service: JobService
) -> None:
    """A study stored before the allow-list (or a trial whose args were altered) is not exported:
    its plugin flag would run the code wherever the export is deployed."""
    sid = _post(client, job_doc("old")).json()["id"]
    study = fake_study(service, sid)
    service.store.update(sid, progress={"storage_ready": True})
    import optuna

    study.add_trial(
        optuna.trial.create_trial(
            values=[10.0, 1.0, 900.0],
            user_attrs={
                "engine_args": json.dumps({"max-num-seqs": 8, "tool-parser-plugin": "/x/p.py"}),
                "status": "complete",
            },
            constraints={"p95_ttft_ms<=60000": -1.0},
        )
    )
    for fmt in ("vllm-config", "vllm-cli", "kubernetes", "helm", "ray-serve"):
        r = client.post(f"/v1/studies/{sid}/export?format={fmt}&trial=2", headers=AUTH)
        assert r.status_code == 422, (fmt, r.status_code, r.text[:300])
        assert "tool-parser-plugin" in r.json()["detail"]
        r = client.post(
            f"/v1/studies/{sid}/export?format={fmt}&trial=2&validate=true", headers=AUTH
        )
        assert r.status_code == 422, (fmt, r.status_code)
    # a stored env the allow-list refuses is refused too
    rec = service.get(sid)
    job = {**rec.job, "engine": {**rec.job["engine"], "env": {"VLLM_PLUGINS": "evil"}}}
    service.store.update(sid, job=json.dumps(job))
    r = client.post(f"/v1/studies/{sid}/export?format=vllm-cli&trial=1", headers=AUTH)
    assert r.status_code == 422 and "VLLM_PLUGINS" in r.json()["detail"], r.text[:300]


@pytest.mark.parametrize(
    "over",
    [
        {"engine": {"args": {"tool-parser-plugin": "/x/parser.py"}}},
        {"engine": {"env": {"VLLM_PLUGINS": "parser"}}},
        {
            "search_space": {
                "name": "old",
                "params": {"chat-template": {"type": "categorical", "choices": ["/x/t.j2"]}},
            }
        },
    ],
)
def test_a_job_stored_before_the_policy_fails_at_its_driver_before_any_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, over: dict[str, Any]
) -> None:
    """A job queued (or running, then resumed) before an upgrade is held to the policy when its
    driver starts: it fails naming the flag, and no plan or server is ever made for it."""
    from optimizer import study
    from optimizer.service.study_host import StudyHost

    def started(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a plan was made for a refused job")

    monkeypatch.setattr(study, "prepare", started)
    host = StudyHost("0123456789ab", job_doc("old", **over), str(tmp_path), mlflow=False)
    host._thread.join(60)
    status = host.status()
    named = (
        next(iter(over["engine"].get("args") or over["engine"]["env"]))
        if "engine" in over
        else "chat-template"
    )
    assert status["state"] == "failed" and named in status["message"], status


# --- the command-line export of a folder the service wrote ------------------------------------


def test_the_service_marks_each_study_folder_it_creates(service: JobService) -> None:
    from optimizer.service import security

    rec, _ = service.submit(Submission(job=job_doc("marked")))
    marker = json.loads((Path(rec.out) / security.STUDY_MARKER).read_text())
    assert marker["job"] == rec.id
    assert security.is_service_study(Path(rec.out))


def _service_folder(
    service: JobService, engine: dict[str, Any], trial_args: dict[str, Any]
) -> Path:
    """A study folder as the service's driver leaves it, its job and a trial stored as given
    (as a study stored before the allow-list was)."""
    import optuna

    rec, _ = service.submit(Submission(job=job_doc("old")))
    study = fake_study(service, rec.id)
    study.add_trial(
        optuna.trial.create_trial(
            values=[10.0, 1.0, 900.0],
            user_attrs={"engine_args": json.dumps(trial_args), "status": "complete"},
        )
    )
    job = {**rec.job, "engine": {**rec.job["engine"], **engine}}
    plan = {"study": rec.study_name, "storage": rec.storage_url, "trace": "t.csv", "job": job}
    (Path(rec.out) / "plan.json").write_text(json.dumps(plan))
    return Path(rec.out)


@pytest.mark.parametrize(
    ("engine", "trial_args", "named"),
    [
        ({"args": {"tool-parser-plugin": "/x/t.csv"}}, {"max-num-seqs": 8}, "tool-parser-plugin"),
        ({}, {"max-num-seqs": 8, "tool_parser_plugin": "/x/t.csv"}, "tool-parser-plugin"),
        ({"baseline_args": {"chat-template": "/x/t.j2"}}, {"max-num-seqs": 8}, "chat-template"),
        ({"env": {"VLLM_PLUGINS": "evil"}}, {"max-num-seqs": 8}, "VLLM_PLUGINS"),
        ({"python": "/x/python"}, {"max-num-seqs": 8}, "engine.python"),
        ({"cpus": [0]}, {"max-num-seqs": 8}, "engine.cpus"),
    ],
)
def test_cli_export_of_a_service_folder_refuses_what_the_service_would(
    service: JobService,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    engine: dict[str, Any],
    trial_args: dict[str, Any],
    named: str,
) -> None:
    """Re-validating such a study would start a server with its plugin flag: the command-line
    export refuses it (the CLI's exit for bad input, naming the flag) before anything starts
    or is written, as the service's export does."""
    from optimizer import cli, cli_support, study

    folder = _service_folder(service, engine, trial_args)

    def started(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a runner or a plan was made for a refused study")

    monkeypatch.setattr(cli_support, "make_runner", started)
    monkeypatch.setattr(study, "prepare", started)
    out = tmp_path / "export.yaml"
    for extra in ([], ["--no-validate"]):
        argv = ["export", str(folder), "--format", "vllm-config", "--trial", "2"]
        rc = cli.main([*argv, "--out", str(out), *extra])
        err = " ".join(capsys.readouterr().err.split())
        assert rc == 2, (extra, err)
        assert named in err and "service" in err, err
        assert not out.exists()


def test_cli_export_of_an_unmarked_service_folder_still_applies_the_policy(
    service: JobService, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder the service wrote before it marked them is recognised by its place."""
    from optimizer import cli
    from optimizer.service import security

    folder = _service_folder(service, {}, {"tool-parser-plugin": "/x/t.csv"})
    (folder / security.STUDY_MARKER).unlink()
    assert folder.parent.name == "studies"
    rc = cli.main(["export", str(folder), "--format", "vllm-cli", "--trial", "2", "--no-validate"])
    assert rc == 2 and "tool-parser-plugin" in " ".join(capsys.readouterr().err.split())
    # the same folder elsewhere is a local `tune` folder: its user's own, exported as it is
    local = folder.parent.parent / "runs" / "mine"
    local.parent.mkdir(parents=True)
    folder.rename(local)
    plan = json.loads((local / "plan.json").read_text())
    plan["storage"] = f"sqlite:///{local / 'study.db'}"
    (local / "plan.json").write_text(json.dumps(plan))
    assert not security.is_service_study(local)
    assert (
        cli.main(["export", str(local), "--format", "vllm-cli", "--trial", "1", "--no-validate"])
        == 0
    )


# --- 5. Ray bound to the operator's address ---------------------------------------------------


def test_a_local_ray_is_started_on_the_address_the_operator_chose(
    monkeypatch: pytest.MonkeyPatch, service: JobService
) -> None:
    import ray
    from ray import serve
    from ray._private import ray_constants

    from optimizer.service import api

    seen: dict[str, Any] = {}
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")  # restored after the test
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(serve, "start", lambda **kw: seen.update(serve=kw))
    monkeypatch.setattr(serve, "run", lambda *a, **kw: None)
    monkeypatch.setattr(api, "build_app", lambda _s: None)
    api.run_service(service.settings, host="127.0.0.1", port=8123)
    assert seen["_node_ip_address"] == "127.0.0.1"
    assert seen["dashboard_host"] == "127.0.0.1"
    assert seen["serve"]["http_options"]["host"] == "127.0.0.1"
    # Ray's single-node mode: it keeps the loopback address (else it replaces it by the
    # machine's) and its servers listen on it only (tests/integration/test_service.py)
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    # every interface, as the operator asked: Ray's defaults
    seen.clear()
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    api.run_service(service.settings, host="0.0.0.0", port=8123)
    assert "_node_ip_address" not in seen and ray_constants.ENABLE_RAY_CLUSTER is True


# --- 6. issue 24: names and paths are data; every path confined; uploads bounded --------------

# A model path meant to end its export's header line and add a privileged Pod.
INJECTED = (
    "m\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: pwn}\nspec: {hostPID: true}\n---\nx: "
)


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"model": {"path": INJECTED, "make": "tiny"}}, "model.path"),
        ({"model": {"path": "org/m\u2028kind: Pod"}}, "model.path"),
        ({"mlflow": {"enabled": False, "experiment": "e\rx"}}, "mlflow.experiment"),
        ({"trace": {"path": str(TRACE) + "\x85.csv"}}, "trace.path"),
        ({"search_space": {"name": "s\x1b[2J", "params": {}}}, "search_space"),
        ({"engine": {"args": {"kv-cache-dtype": "auto\n"}}}, "engine.args.kv-cache-dtype"),
        ({"model": {"path": "org/" + "m" * 5000}}, "model.path"),
    ],
)
def test_control_characters_in_names_and_paths_are_refused_naming_the_key(
    client: TestClient, over: dict[str, Any], key: str
) -> None:
    r = _post(client, job_doc("ctl", **over))
    assert r.status_code == 422, r.text[:300]
    assert key in r.json()["detail"], r.text[:300]
    assert "Pod" not in r.text and "mmmmm" not in r.text  # the value is never quoted


def test_a_study_stored_with_a_hostile_model_path_is_not_exported(
    client: TestClient, service: JobService
) -> None:
    """A study stored before the rule (its model path a line break and a Pod): every export,
    validated or not, is refused naming the key, as for a flag stored before the allow-list."""
    sid = _post(client, job_doc("old-model")).json()["id"]
    fake_study(service, sid)
    service.store.update(sid, progress={"storage_ready": True})
    rec = service.get(sid)
    job = {**rec.job, "model": {"path": str(service.models_dir / INJECTED), "make": "tiny"}}
    service.store.update(sid, job=json.dumps(job))
    for fmt in ("vllm-config", "vllm-cli", "kubernetes", "helm", "ray-serve"):
        for validate in ("false", "true"):
            r = client.post(
                f"/v1/studies/{sid}/export?format={fmt}&trial=1&validate={validate}", headers=AUTH
            )
            assert r.status_code == 422, (fmt, r.status_code, r.text[:300])
            assert "model.path" in r.json()["detail"] and "Pod" not in r.text


CREDENTIALS = "aws_access_key_id: AKIA-SEKRIT\naws_secret_access_key: hunter2-sekrit\n"


def test_a_search_space_file_outside_the_roots_is_refused_whatever_its_name(
    client: TestClient, tmp_path: Path
) -> None:
    """Outside the roots: 403 before anything is read, the same answer whether a file is there,
    missing, or a folder; never its content."""
    creds = tmp_path / "credentials"
    creds.write_text(CREDENTIALS)
    (tmp_path / "folder").mkdir()
    answers = set()
    for name in ("credentials", "missing", "folder"):
        for space in (str(tmp_path / name), f"../../../../../../..{tmp_path}/{name}"):
            r = _post(client, job_doc("space-file", search_space=space))
            assert r.status_code == 403, (space, r.text[:300])
            assert "sekrit" not in r.text and "aws" not in r.text
            answers.add(r.json()["detail"].replace(name, "NAME"))
    assert len(answers) == 1, answers


def test_a_search_space_file_under_the_roots_is_read_but_never_quoted(
    client: TestClient, service: JobService, tmp_path: Path
) -> None:
    root = tmp_path / "traces"
    root.mkdir()
    service.roots.append(root)
    (root / "credentials").write_text(CREDENTIALS)
    (root / "space").write_text(
        "name: mine\nparams:\n  max-num-seqs: {type: int, low: 4, high: 64}\n"
    )
    (root / "plugin").write_text(
        "name: p\nparams:\n  sekrit-plugin: {type: categorical, choices: [a.py]}\n"
    )
    for name in ("credentials", "plugin", "missing"):
        r = _post(client, job_doc("space-file", search_space=str(root / name)))
        assert r.status_code == 422, (name, r.text[:300])
        assert "search_space" in r.json()["detail"] and "sekrit" not in r.text, r.text[:300]
        assert "aws" not in r.text
    r = _post(client, job_doc("space-file", search_space=str(root / "space")))
    assert r.status_code == 201, r.text[:300]


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model folder outside every root, reachable from the service's working directory as
    `examples/../../outside/model` (the working directory is two levels below its parent)."""
    outside = tmp_path / "a" / "outside" / "model"
    outside.mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    cwd = tmp_path / "a" / "b"
    (cwd / "examples").mkdir(parents=True)
    monkeypatch.chdir(cwd)
    assert Path("examples/../../outside/model").resolve() == outside.resolve()
    return outside


@pytest.mark.parametrize("hub", [False, True])
def test_a_relative_model_path_is_looked_for_under_the_model_roots_only(
    tmp_path: Path, elsewhere: Path, hub: bool
) -> None:
    models = tmp_path / "models"
    (models / "team" / "m").mkdir(parents=True)
    svc = make_service(tmp_path, FakeLauncher(), model_roots=(str(models),), allow_hub_models=hub)
    client = TestClient(create_app(svc), raise_server_exceptions=False)
    answers = set()
    for path in ("examples/../../outside/model", "examples/../../outside/missing"):
        r = _post(client, job_doc("rel", model={"path": path}))
        assert r.status_code == (422 if hub else 403), (path, r.text[:300])
        answers.add(r.json()["detail"].replace(path, "PATH"))
    assert len(answers) == 1, answers  # the same whether or not the folder exists
    beside_base = []  # a name beside the job's base folder (the first trace root) or not
    for path in (TRACE.name, "missing.csv"):
        r = _post(client, job_doc("rel", model={"path": path}))
        beside_base.append((r.status_code, r.json().get("detail", "").replace(path, "PATH")))
    assert beside_base[0] == beside_base[1] and beside_base[0][0] == (201 if hub else 403)
    r = _post(client, job_doc("rel", model={"path": "team/m"}))  # found under a model root
    assert r.status_code == 201, r.text[:300]
    assert svc.get(r.json()["id"]).job["model"]["path"] == str(models / "team" / "m")
    r = _post(client, job_doc("hub", model={"path": "org/some-model"}))
    assert r.status_code == (201 if hub else 403), r.text[:300]
    if not hub:
        assert "--allow-hub-models" in r.json()["detail"]
    assert all("outside" not in rec.job["model"]["path"] for rec in svc.store.records())


def _multipart(name: str, data: bytes, job: dict[str, Any]) -> dict[str, Any]:
    return {"job": (None, json.dumps(job)), "trace": (name, data, "text/csv")}


@pytest.mark.parametrize("name", ["t" * 300 + ".csv", "\u00e9" * 200 + ".csv", "x" * 400])
def test_an_upload_with_a_long_file_name_is_stored_under_a_short_one(
    client: TestClient, service: JobService, name: str
) -> None:
    r = client.post(
        "/v1/studies", files=_multipart(name, TRACE.read_bytes(), job_doc("long")), headers=AUTH
    )
    assert r.status_code == 201, r.text[:300]
    stored = Path(service.get(r.json()["id"]).job["trace"]["path"])
    assert len(stored.name.encode()) <= 100 and stored.is_file()
    assert stored.suffix == Path(name).suffix


def _rows(n: int) -> bytes:
    lines = [
        f"2023-11-16 18:17:{i // 100000:02d}.{i % 100000:05d}00,{100 + i % 4000},{1 + i % 50}"
        for i in range(n)
    ]
    return ("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n").encode()


def test_a_trace_over_the_row_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """Uploaded (multipart or base64) or under a trace root: counted, never parsed, when it has
    more rows than the operator's --max-trace-rows; an upload's .gz by its decompressed size."""
    import gzip

    def parsed(*_a: Any) -> None:
        raise AssertionError("the trace was parsed")

    svc = make_service(tmp_path, FakeLauncher(), max_trace_rows=500, max_upload_bytes=1024**2)
    svc.check_plan = parsed
    client = TestClient(create_app(svc), raise_server_exceptions=False)
    job = job_doc("rows")
    for r in (
        client.post("/v1/studies", files=_multipart("t.csv", _rows(501), job), headers=AUTH),
        _post(client, {"job": job, "trace_upload": _upload("t.csv", _rows(501))}),
        _post(client, job),  # TRACE, under the trace root: 600 rows
    ):
        assert r.status_code == 422, r.text[:300]
        assert "more than 500 rows" in r.json()["detail"] and "--max-trace-rows" in r.text
    bomb = gzip.compress(b"0" * (2 * 1024**2))
    r = client.post("/v1/studies", files=_multipart("t.csv.gz", bomb, job), headers=AUTH)
    assert r.status_code == 413, r.text[:300]
    assert not any((svc.data_dir / "uploads").iterdir())
    svc.check_plan = lambda _j, _b: None
    r = client.post("/v1/studies", files=_multipart("t.csv", _rows(500), job), headers=AUTH)
    assert r.status_code == 201, r.text[:300]


async def _stream_post(app: Any, path: str, ctype: str, chunks: Any) -> tuple[int, bytes]:
    """POST ``chunks`` (made as they are sent, never all in memory) to an ASGI app, the way a
    server hands a body over: one message a chunk."""
    import anyio

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"authorization", AUTH["Authorization"].encode()),
            (b"content-type", ctype.encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    pending = iter(chunks)
    status, body = 0, []

    async def receive() -> dict[str, Any]:
        await anyio.sleep(0)
        chunk = next(pending, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(body)


def test_a_large_multipart_trace_streams_to_disk_not_into_memory(tmp_path: Path) -> None:
    """A 24 MiB trace part: parsed as it arrives, spooled to disk and copied in chunks; the
    replica's memory never holds the body (before: the whole body, then the whole part)."""
    import anyio

    size = 24 * 1024**2
    svc = make_service(tmp_path, FakeLauncher(), max_upload_bytes=32 * 1024**2)
    app = create_app(svc)
    boundary = "b0undary"
    line = b"2023-11-16 18:17:03.9799600,4808,10" + b"0" * 90 + b"\n"  # 126 bytes, < 200k rows

    def chunks() -> Any:
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="job"\r\n\r\n'
            f"{json.dumps(job_doc('stream'))}\r\n--{boundary}\r\n"
            'Content-Disposition: form-data; name="trace"; filename="t.csv"\r\n'
            "Content-Type: text/csv\r\n\r\nTIMESTAMP,ContextTokens,GeneratedTokens\n"
        ).encode()
        for _ in range(size // (512 * len(line))):
            yield line * 512  # 64 KiB, made as sent
        yield f"\r\n--{boundary}--\r\n".encode()

    tracemalloc.start()
    try:
        status, body = anyio.run(
            _stream_post, app, "/v1/studies", f"multipart/form-data; boundary={boundary}", chunks()
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 201, body[:300]
    stored = Path(svc.get(json.loads(body)["id"]).job["trace"]["path"])
    assert stored.stat().st_size > 23 * 1024**2
    assert peak < 8 * 1024**2, f"{peak / 1024**2:.1f} MiB"  # 2 MiB here; 72 MiB before


def test_hub_names_and_the_row_limit_are_the_operators_serve_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from optimizer import cli
    from optimizer.errors import ConfigError
    from optimizer.service import api

    seen: list[Any] = []

    def run_service(settings: Any, **_kw: Any) -> str:
        seen.append(settings)
        return "http://127.0.0.1:8000"

    monkeypatch.setattr(api, "run_service", run_service)
    monkeypatch.setenv("VLLM_AUTOTUNE_TOKENS", "t")
    argv = ["serve", "--data-dir", str(tmp_path), "--detach"]
    assert cli.main(argv) == 0
    assert cli.main([*argv, "--allow-hub-models", "--max-trace-rows", "1000"]) == 0
    default, chosen = seen
    assert (default.allow_hub_models, default.max_trace_rows) == (False, 200_000)
    assert (chosen.allow_hub_models, chosen.max_trace_rows) == (True, 1000)
    with pytest.raises(ConfigError, match="allow_hub_models"):
        settings_from_args({"data_dir": str(tmp_path), "allow_hub_models": "false"})
    with pytest.raises(ConfigError, match="max_trace_rows"):
        settings_from_args({"data_dir": str(tmp_path), "max_trace_rows": -1})


@pytest.mark.parametrize(
    "over",
    [
        {"model": {"path": "~no-such-user-x/m"}},
        {"model": {"path": "~no-such-user-x/m", "make": "tiny"}},
        {"trace": {"path": "~no-such-user-x/t.csv"}},
        {"search_space": "~no-such-user-x/space"},
    ],
)
def test_the_home_folder_of_an_unknown_user_is_a_4xx(
    client: TestClient, over: dict[str, Any]
) -> None:
    r = _post(client, job_doc("home", **over))
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])  # was a 500


# --- 7. issue 42: the operator's URLs redacted; lone surrogates refused -------------------------

#: The operator's storage and MLflow URLs, with a secret in every place a URL can hold one.
OPERATOR_STORAGE = (
    "postgresql://autotune:pw-in-userinfo@db.internal:5432/optuna?sslmode=verify-full"
    "&password=pw-in-query&sslpassword=key-passphrase&application_name=vllm-autotune"
)
SHOWN_STORAGE = (
    "postgresql://autotune:***@db.internal:5432/optuna?sslmode=verify-full"
    "&password=***&sslpassword=***&application_name=vllm-autotune"
)
OPERATOR_MLFLOW = "https://mlflow.internal/?workspace=perf&access_token=mlflow-token"
SECRETS = ("pw-in-userinfo", "pw-in-query", "key-passphrase", "mlflow-token", "hf_secret")


def _operator_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, storage: str, mlflow_uri: str
) -> tuple[TestClient, JobService]:
    """Team alpha and an admin on a service with the operator's storage and MLflow URLs."""
    from optimizer.service.auth import hash_token

    monkeypatch.delenv("VLLM_AUTOTUNE_TOKENS", raising=False)
    tokens = tmp_path / "tokens"
    tokens.write_text(
        f"alpha sha256:{hash_token('tok-alpha')}\nops sha256:{hash_token('tok-admin')} admin\n"
    )
    settings = settings_from_args(
        {
            "data_dir": str(tmp_path / "data"),
            "token_file": str(tokens),
            "trace_roots": [str(TRACE.parent)],
            "allow_hub_models": True,
            "study_storage": storage,
            "mlflow_uri": mlflow_uri,
        }
    )
    store = JobStore(settings.database_url)
    svc = JobService(
        settings, store, Scheduler(store, FakeLauncher()), check_plan=lambda _j, _b: None
    )
    return TestClient(create_app(svc), raise_server_exceptions=False), svc


def test_a_team_sees_the_operators_urls_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The study detail shows the storage and MLflow URLs with the userinfo password and every
    secret query value masked (before: `?password=` and the token were shown as given), to
    the team and to the admin; the rest of each URL is kept, and the job runs with the real
    one."""
    client, svc = _operator_service(tmp_path, monkeypatch, OPERATOR_STORAGE, OPERATOR_MLFLOW)
    r = _post(client, job_doc("urls", mlflow={"enabled": True}), headers=_bearer("tok-alpha"))
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert svc.get(sid).storage_url == OPERATOR_STORAGE  # the driver's own is unchanged
    for who in ("tok-alpha", "tok-admin"):
        detail = client.get(f"/v1/studies/{sid}", headers=_bearer(who))
        assert detail.status_code == 200, detail.text
        shown = detail.json()["job"]
        assert shown["storage"] == SHOWN_STORAGE
        assert shown["mlflow"]["tracking_uri"] == (
            "https://mlflow.internal/?workspace=perf&access_token=***"
        )
        listed = client.get("/v1/studies", headers=_bearer(who)).text
        for text in (r.text, detail.text, listed):
            assert not any(s in text for s in SECRETS), text


def _drive_with_mlflow(monkeypatch: pytest.MonkeyPatch, svc: JobService, job_id: str) -> Any:
    """Run the job's driver as its Ray actor would (the real StudyHost, StudyDriver and
    tracker) with a FAKE trial runner in place of Ray's; its last status."""
    import functools

    from optimizer import runners, study
    from optimizer.service.study_host import StudyHost
    from tests.unit.test_study_loop import FakeRunner

    monkeypatch.setattr(runners, "RayRunner", lambda **_k: FakeRunner())
    monkeypatch.setattr(study, "prepare", functools.partial(study.prepare, check_flags=False))
    rec = svc.get(job_id)
    host = StudyHost(
        rec.id, rec.job, rec.base, mlflow=True, study_name=rec.study_name, owner=rec.owner
    )
    host._thread.join(120)
    return host.status()


def test_the_review_files_and_mlflow_runs_show_the_operators_urls_redacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service study driven to its end with a storage URL whose query holds secrets: its
    review/job.yaml, and what its MLflow parent run holds once logged (the storage tag,
    inputs/job.yaml, plan.json: what a team downloads), show them masked (before:
    review/job.yaml and the tag kept `?password=`; plan.json's job kept the storage and
    HF_TOKEN as given)."""
    from mlflow.tracking import MlflowClient

    from optimizer import tracking

    storage = f"sqlite:///{tmp_path / 'st.db'}?password=pw-in-query&sslpassword=key-passphrase"
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client, svc = _operator_service(tmp_path, monkeypatch, storage, mlflow_uri)
    r = _post(  # a tiny made model, so the real driver runs it with a fake runner
        client,
        job_doc(
            "urls",
            model={"path": "tiny-urls", "make": "tiny"},
            engine={"args": {"max-model-len": 2048}, "env": {"HF_TOKEN": "hf_secret"}},
            trace={
                "path": str(TRACE),
                "shaping": {"window_s": [0, 40], "max_model_len": 2048, "max_output_tokens": 32},
            },
            sampler={"name": "random", "seed": 1},
            mlflow={"enabled": True},
        ),
        headers=_bearer("tok-alpha"),
    )
    assert r.status_code == 201, r.text
    status = _drive_with_mlflow(monkeypatch, svc, r.json()["id"])
    assert status["state"] == "done", status
    out = Path(svc.get(r.json()["id"]).out)
    review = (out / "review" / "job.yaml").read_text()
    assert "password=***" in review and not any(s in review for s in SECRETS), review

    tracking.sync_study(out)  # what the driver logged, or mlflow-sync's rebuild of it
    mlflow = MlflowClient(mlflow_uri)
    runs = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()])
    parent = next(r for r in runs if r.data.tags.get("vllm_autotune.role") == "study")
    assert parent.data.tags["storage"].endswith("?password=***&sslpassword=***")
    for name in ("inputs/job.yaml", "plan.json"):
        path = Path(mlflow.download_artifacts(parent.info.run_id, name, str(tmp_path)))
        assert not any(s in path.read_text() for s in SECRETS), (name, path.read_text())


#: A lone surrogate: what JSON's "\ud800" decodes to; no UTF-8 text can hold it.
LONE = "\ud800"


def _raw(client: TestClient, body: Any, headers: dict[str, str] = AUTH) -> Any:
    """POST ``body`` as JSON written as an attacker would: ``\\ud800`` escapes as they are."""
    return client.post(
        "/v1/studies",
        content=json.dumps(body),
        headers={**headers, "Content-Type": "application/json"},
    )


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ({"job": job_doc("s", out=f"x{LONE}")}, "out"),
        ({"job": job_doc("s", engine={"args": {f"max-num-seqs{LONE}": 8}})}, "engine.args"),
        (
            {"job": job_doc("s", mlflow={"enabled": False, "experiment": f"e{LONE}"})},
            "mlflow.experiment",
        ),
        ({"job": job_doc("s", model={"path": "m", "make": f"tiny{LONE}"})}, "model.make"),
        ({"job": job_doc("s", engine={"env": {"HF_TOKEN": f"t{LONE}"}})}, "engine.env.HF_TOKEN"),
        ({"job": job_doc("s", description=f"free prose{LONE}")}, "description"),
        ({"job": job_doc(f"s{LONE}")}, "name"),
        ({"job": {**job_doc("s"), f"k{LONE}": "x" * 70_000}}, "job"),
        ({"job": job_doc("s"), f"not_before{LONE}": 1}, "(top level)"),
        (
            {"job": job_doc("s"), "trace_upload": {"filename": f"t{LONE}.csv", "content_b64": ""}},
            "trace_upload.filename",
        ),
    ],
    ids=[
        "out",
        "args-key",
        "mlflow-experiment",
        "model-make",
        "env-value",
        "description",
        "name",
        "key-of-a-long-string",
        "envelope-key",
        "upload-name",
    ],
)
def test_a_lone_surrogate_anywhere_is_a_422_naming_the_key(
    client: TestClient, service: JobService, body: Any, key: str
) -> None:
    """Before: a 500 (`out` after the job was stored and queued; an engine.args key; a key
    over a long string), or a 201 whose detail then answered 500 for good."""
    r = _raw(client, body)
    assert r.status_code == 422, r.text[:300]
    detail = r.json()["detail"]
    assert "lone surrogate (U+D800)" in detail and f"{key}:" in detail, detail
    assert service.store.records() == []


def test_a_study_stored_with_a_lone_surrogate_is_shown_and_not_exported(
    client: TestClient, service: JobService
) -> None:
    """A job stored before the rule (its mlflow.experiment and model.make a lone surrogate):
    its detail answers, the surrogate escaped (before: 500 for good, to its team and the
    admin), and it is not exported, naming the key."""
    sid = _post(client, job_doc("old")).json()["id"]
    fake_study(service, sid)
    service.store.update(sid, progress={"storage_ready": True})
    rec = service.get(sid)
    job = {
        **rec.job,
        "mlflow": {**rec.job["mlflow"], "experiment": f"e{LONE}"},
        "model": {"path": str(service.models_dir / "m"), "make": f"tiny{LONE}"},
    }
    service.store.update(sid, job=json.dumps(job))
    r = client.get(f"/v1/studies/{sid}", headers=AUTH)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["job"]["mlflow"]["experiment"] == "e\\ud800"
    assert client.get("/v1/studies", headers=AUTH).status_code == 200
    r = client.post(f"/v1/studies/{sid}/export?format=vllm-config&trial=1", headers=AUTH)
    assert r.status_code == 422 and "lone surrogate" in r.json()["detail"], r.text[:300]
