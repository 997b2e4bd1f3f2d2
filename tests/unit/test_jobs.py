"""The service's job store, scheduler and submission checks, with a FAKE driver launcher and a
fake clock: FIFO order, concurrency, time windows, cancel, restart (queued jobs stay queued,
running studies get a new driver that resumes), tokens and redaction."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from optimizer.errors import ConfigError, SubmissionRefused
from optimizer.service.auth import hash_token
from optimizer.service.facade import JobService
from optimizer.service.scheduler import Scheduler
from optimizer.service.security import redact_job, redact_url
from optimizer.service.settings import ServiceSettings, load_tokens, token_matches
from optimizer.service.store import JobRecord, JobStore
from optimizer.service.study_host import DriverStatus
from optimizer.service.submissions import Submission, parse_body, parse_submission

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "examples" / "traces"
TRACE = TRACES / "azure2023_code_600.csv"


def job_doc(name: str = "svc", **over: Any) -> dict[str, Any]:
    """A small valid job whose trace lies under TRACES (the model is a hub name: not read)."""
    doc: dict[str, Any] = {
        "name": name,
        "model": {"path": "org/some-model"},
        "engine": {"env": {"HF_TOKEN": "hf_secret", "VLLM_LOGGING_LEVEL": "INFO"}},
        "trace": {"path": str(TRACE), "shaping": {"window_s": [0, 10]}},
        "search_space": {
            "name": "t",
            "params": {"max-num-seqs": {"type": "int", "low": 4, "high": 64}},
        },
        "trials": 2,
        "mlflow": {"enabled": False},
    }
    doc.update(over)
    return doc


class FakeLauncher:
    """Drivers as entries of a dict: tests move them through their states."""

    def __init__(self) -> None:
        self.drivers: dict[str, DriverStatus] = {}
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.stopped: list[str] = []
        self.released: list[str] = []

    def start(self, rec: JobRecord) -> None:
        self.started.append(rec.id)
        self.drivers[rec.id] = DriverStatus("cancelled" if rec.cancel_requested else "running")

    def poll(self, job_id: str) -> DriverStatus | None:
        return self.drivers.get(job_id)

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)
        if job_id in self.drivers:
            self.drivers[job_id] = DriverStatus("cancelled")

    def request_stop(self, job_id: str) -> None:
        self.stopped.append(job_id)

    def release(self, job_id: str) -> None:
        self.released.append(job_id)
        self.drivers.pop(job_id, None)

    def finish(self, job_id: str, state: str = "done", message: str = "") -> None:
        self.drivers[job_id] = DriverStatus(state, message=message, remaining=0)


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_service(
    tmp_path: Path,
    launcher: FakeLauncher | None = None,
    *,
    max_concurrent: int = 1,
    clock: Clock | None = None,
    real_check: bool = False,
    **settings: Any,
) -> JobService:
    clock = clock or Clock()
    settings.setdefault("allow_hub_models", True)  # job_doc's model is a hub name
    cfg = ServiceSettings(
        database_url=f"sqlite:///{tmp_path / 'service.db'}",
        data_dir=str(tmp_path / "data"),
        trace_roots=(str(TRACES),),
        token_sha256=(hash_token("good-token"),),
        **settings,
    )
    store = JobStore(cfg.database_url)
    sched = Scheduler(store, launcher or FakeLauncher(), max_concurrent=max_concurrent, clock=clock)
    return JobService(
        cfg,
        store,
        sched,
        check_plan=None if real_check else (lambda _j, _b: None),
        clock=clock,
    )


def submit(svc: JobService, name: str, **envelope: Any) -> str:
    rec, _notes = svc.submit(Submission(job=job_doc(name), **envelope))
    return rec.id


def states(svc: JobService) -> list[str]:
    return [r.state for r in svc.store.records()]


def test_fifo_one_at_a_time_then_the_next(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    svc = make_service(tmp_path, launcher)
    ids = [submit(svc, f"s{i}") for i in range(3)]
    svc.scheduler.tick()
    assert states(svc) == ["running", "queued", "queued"]
    assert launcher.started == [ids[0]]
    svc.scheduler.tick()  # nothing changes while the first runs
    assert launcher.started == [ids[0]]
    launcher.finish(ids[0])
    svc.scheduler.tick()
    assert states(svc) == ["done", "running", "queued"]
    assert launcher.started == ids[:2] and launcher.released == [ids[0]]
    launcher.finish(ids[1], "failed", "boom")
    svc.scheduler.tick()
    rec = svc.get(ids[1])
    assert rec.state == "failed" and rec.message == "boom"
    assert states(svc)[2] == "running"


def test_concurrency_limit(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    svc = make_service(tmp_path, launcher, max_concurrent=2)
    for i in range(3):
        submit(svc, f"s{i}")
    svc.scheduler.tick()
    assert states(svc) == ["running", "running", "queued"]


def test_time_window_not_before_and_until(tmp_path: Path) -> None:
    from datetime import datetime

    clock = Clock()
    launcher = FakeLauncher()
    svc = make_service(tmp_path, launcher, clock=clock, max_concurrent=2)
    later = submit(svc, "later", not_before=datetime.fromtimestamp(clock.t + 3600))
    now_id = submit(svc, "now", until=datetime.fromtimestamp(clock.t + 600))
    brief = submit(svc, "brief", until=datetime.fromtimestamp(clock.t + 60))
    svc.scheduler.max_concurrent = 1
    svc.scheduler.tick()
    # `later` waits for its window without blocking the queue behind it.
    assert [svc.get(i).state for i in (later, now_id, brief)] == ["queued", "running", "queued"]
    clock.t += 120  # brief's window closes while it waits
    svc.scheduler.tick()
    assert svc.get(brief).state == "expired"
    clock.t += 600  # now's `until`: stop launching, once
    svc.scheduler.tick()
    svc.scheduler.tick()
    assert launcher.stopped == [now_id]
    launcher.finish(now_id)
    clock.t += 3600
    svc.scheduler.tick()
    assert svc.get(later).state == "running"
    with pytest.raises(ConfigError, match="already closed"):
        submit(svc, "past", until=datetime.fromtimestamp(clock.t - 1))


def test_cancel_queued_and_running(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    svc = make_service(tmp_path, launcher)
    first, second = submit(svc, "a"), submit(svc, "b")
    svc.scheduler.tick()
    assert svc.cancel(second)["state"] == "cancelled"
    assert svc.cancel(first)["state"] in ("cancelling", "running")
    assert launcher.cancelled == [first]
    svc.scheduler.tick()
    assert svc.get(first).state == "cancelled" and launcher.released == [first]
    # Cancelling a finished job changes nothing.
    assert svc.cancel(first)["state"] == "cancelled"


def test_restart_keeps_the_queue_and_resumes_running_studies(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    svc = make_service(tmp_path, launcher)
    first, second = submit(svc, "a"), submit(svc, "b")
    svc.scheduler.tick()
    assert svc.get(first).driver_starts == 1
    # The service (and its cluster) goes away: a new store on the same database, no drivers.
    fresh = FakeLauncher()
    svc2 = make_service(tmp_path, fresh)
    assert states(svc2) == ["running", "queued"]
    svc2.scheduler.tick()
    rec = svc2.get(first)
    assert fresh.started == [first]  # a new driver, which resumes the study from storage
    assert rec.state == "running" and rec.driver_starts == 2 and "resumed" in rec.message
    assert svc2.get(second).state == "queued"
    fresh.finish(first)
    svc2.scheduler.tick()
    assert states(svc2) == ["done", "running"]


def test_a_driver_that_keeps_dying_fails_the_job(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    svc = make_service(tmp_path, launcher)
    svc.scheduler.max_driver_starts = 2
    job = submit(svc, "a")
    svc.scheduler.tick()
    launcher.drivers.clear()
    svc.scheduler.tick()  # second start
    launcher.drivers.clear()
    svc.scheduler.tick()
    rec = svc.get(job)
    assert rec.state == "failed" and "died 2 times" in rec.message


def test_submission_checks_roots_overrides_and_uploads(tmp_path: Path) -> None:
    svc = make_service(tmp_path, max_upload_bytes=4096)
    rec, notes = svc.submit(Submission(job=job_doc(out="/elsewhere", ray_address="ray://x:10001")))
    assert rec.out == str((tmp_path / "data" / "studies" / rec.id).resolve())
    assert rec.job["ray_address"] is None
    assert any("out: ignored" in n for n in notes) and any("ray_address" in n for n in notes)
    assert rec.storage_url == f"sqlite:///{rec.out}/study.db"

    outside = tmp_path / "secret.csv"
    outside.write_text("x\n")
    with pytest.raises(SubmissionRefused, match="outside the service's trace roots") as err:
        svc.submit(Submission(job=job_doc(trace={"path": str(outside)})))
    assert err.value.status == 403
    # `..` does not climb out of a root.
    with pytest.raises(SubmissionRefused):
        svc.submit(Submission(job=job_doc(trace={"path": str(TRACES / ".." / "cpu-demo.yaml")})))

    data = TRACE.read_bytes()[:3000]
    up = {"filename": "../../evil name.csv", "content_b64": base64.b64encode(data).decode()}
    rec, _ = svc.submit(
        Submission(job=job_doc(trace={"path": str(outside)}), trace_upload=up)  # type: ignore[arg-type]
    )
    saved = Path(rec.job["trace"]["path"])
    assert saved.read_bytes() == data
    assert saved.parent == (tmp_path / "data" / "uploads" / rec.id).resolve()
    assert saved.name == "evil_name.csv"
    with pytest.raises(SubmissionRefused) as big:
        svc.submit(Submission(job=job_doc()), upload=("t.csv", b"x" * 5000))
    assert big.value.status == 413

    with pytest.raises(ConfigError, match=r"engine\.python"):
        svc.submit(Submission(job=job_doc(engine={"python": "/bin/sh"})))
    with pytest.raises(ConfigError, match=r"engine\.cpus"):
        svc.submit(Submission(job=job_doc(engine={"cpus": [0]})))
    with pytest.raises(ConfigError, match=r"quality\.eval_set"):
        svc.submit(Submission(job=job_doc(quality={"eval_set": "/etc/passwd"})))
    with pytest.raises(ConfigError, match="LD_PRELOAD"):
        svc.submit(Submission(job=job_doc(engine={"env": {"LD_PRELOAD": "/tmp/x.so"}})))


def test_invalid_jobs_carry_the_loaders_message(tmp_path: Path) -> None:
    svc = make_service(tmp_path, real_check=True)
    with pytest.raises(ConfigError, match="sampler") as err:
        svc.submit(Submission(job=job_doc(sampler={"nmae": "tpe"})))
    assert "sampler.nmae: unknown key; did you mean 'name'?" in str(err.value)
    with pytest.raises(ConfigError, match="model: required key is missing"):
        doc = job_doc()
        del doc["model"]
        svc.submit(Submission(job=doc))
    # The plan check (prepare without the flag check) refuses a bad SLO before queueing.
    with pytest.raises(ConfigError):
        svc.submit(Submission(job=job_doc(objectives={"slos": ["p95_ttft_ms<<5"]})))
    assert svc.store.records() == []
    rec, _ = svc.submit(Submission(job=job_doc()))
    assert rec.state == "queued"


def test_bodies_and_envelopes() -> None:
    bare = parse_submission(parse_body(b"name: x\ntrials: 1\n", "application/yaml"))
    assert bare.job == {"name": "x", "trials": 1} and bare.until is None
    env = parse_submission(
        parse_body(b'{"job": {"name": "x"}, "until": "2030-01-01T07:00:00"}', "application/json")
    )
    assert env.job == {"name": "x"} and env.until is not None
    with pytest.raises(ConfigError, match="valid keys: job, not_before, until, trace_upload"):
        parse_submission({"job": {"name": "x"}, "untill": "07:00"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_body(b"{", "application/json")
    with pytest.raises(ConfigError, match="a mapping"):
        parse_submission([1, 2])


def test_tokens_and_redaction(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("# ops\nalpha\n\nbeta\n")
    assert load_tokens(f, "gamma, delta") == ["alpha", "beta", "gamma", "delta"]
    digests = [hash_token(t) for t in ("alpha", "beta")]
    assert token_matches("beta", digests)
    assert not token_matches("bet", digests) and not token_matches(None, digests)
    assert not token_matches("", digests)
    doc = redact_job(
        {
            "engine": {"env": {"HF_TOKEN": "x", "API_KEY": "y", "DB_PASSWORD": "z", "A": "b"}},
            "storage": "postgresql+psycopg2://u:pw@db:5432/autotune",
        }
    )
    assert doc["engine"]["env"] == {
        "HF_TOKEN": "***",
        "API_KEY": "***",
        "DB_PASSWORD": "***",
        "A": "b",
    }
    assert doc["storage"] == "postgresql+psycopg2://u:***@db:5432/autotune"
    assert redact_url("sqlite:///x.db") == "sqlite:///x.db"


def test_a_refused_upload_leaves_no_file(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    up = {"filename": "t.csv", "content_b64": base64.b64encode(b"x,y\n").decode()}
    with pytest.raises(ConfigError):
        svc.submit(Submission(job=job_doc(sampler={"nmae": 1}), trace_upload=up))  # type: ignore[arg-type]
    assert not any((tmp_path / "data" / "uploads").glob("*/*"))


def test_driver_creation_retries_a_storage_initialized_concurrently() -> None:
    import sqlalchemy as sa

    from optimizer.service.study_host import _create_driver

    calls = []

    def make() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise sa.exc.IntegrityError("INSERT INTO alembic_version", {}, Exception("unique"))
        return "driver"

    assert _create_driver(make) == "driver" and len(calls) == 2
