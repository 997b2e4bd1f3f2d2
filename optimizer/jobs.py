"""The tuner as a service: submitted jobs, their store, the scheduler, and the study drivers.

A submission is a job file (the same schema as ``tune`` reads) inside an optional envelope
that adds a time window (``not_before``, ``until``) and an uploaded trace. :class:`JobService`
checks it (the job's own validation, trace and search-space files only under the configured
roots, the service's output folder and cluster), records it in the :class:`JobStore` (SQLAlchemy
Core: SQLite by default, PostgreSQL by URL) and answers every read from the store and the
study's Optuna storage. The :class:`Scheduler` starts queued jobs first-in first-out, a
configurable number at once, each through a :class:`DriverLauncher`: in the service a detached,
named Ray actor (:class:`StudyHost`) that holds a :class:`~optimizer.study.StudyDriver` with a
:class:`~optimizer.runners.RayRunner` on the same cluster, so concurrent studies' trials ask Ray
for their GPUs and never share one. The store is the source of truth: after a restart, queued
jobs are still queued and a running job whose driver is gone gets a new one, which resumes the
study from its Optuna storage (failing and re-queuing the trials the dead driver left RUNNING).
Ray is imported only inside :class:`RayDriverLauncher` and :class:`StudyHost`'s methods.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hmac
import importlib
import json
import logging
import math
import re
import shutil
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import optuna
import sqlalchemy as sa
from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optimizer.config import JobConfig, load_job
from optimizer.errors import AutotuneError, ConfigError, TraceError
from optimizer.service import security
from optimizer.service.auth import DEFAULT_TEAM, Principal, TokenEntry, authenticate, hash_token
from optimizer.service.security import is_secret, redact_job, redact_url
from optimizer.trial_view import TrialView, metric_names

__all__ = [
    "ACTIVE_STATES",
    "FINAL_STATES",
    "DriverLauncher",
    "DriverStatus",
    "ExportResult",
    "JobRecord",
    "JobService",
    "JobStore",
    "NotFound",
    "RayDriverLauncher",
    "Scheduler",
    "ServiceSettings",
    "StudyHost",
    "Submission",
    "SubmissionRefused",
    "TraceUpload",
    "hash_token",
    "load_tokens",
    "redact_job",
    "redact_url",
    "token_matches",
]
_ = (Principal, TokenEntry, authenticate)  # re-exported for the API

log = logging.getLogger(__name__)

#: Job states. ``queued`` and ``running`` are active; the others are final.
ACTIVE_STATES = ("queued", "running")
FINAL_STATES = ("done", "failed", "cancelled", "expired")
_NAMESPACE = "vllm-autotune"


# --- errors -----------------------------------------------------------------------------------


class NotFound(AutotuneError):
    """No such job (or trial)."""


class SubmissionRefused(AutotuneError):
    """A submission the service will not run for a reason of policy, not validity.

    Attributes:
        status: The HTTP status that says why (403: a file outside the allowed roots, 413: an
            upload over the size limit, 409: the request conflicts with the job's state).
    """

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


# --- settings and tokens ----------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceSettings:
    """How the service runs (picklable: it travels to the Serve replica).

    Attributes:
        database_url: The job store (SQLAlchemy URL; SQLite file or PostgreSQL).
        data_dir: Study folders (``studies/<id>``) and uploaded traces (``uploads/<id>``).
        trace_roots: Folders a job's trace (and search-space) files must lie under.
        token_sha256: SHA-256 hex digests of accepted bearer tokens of the ``default`` team.
        tokens: Accepted tokens with their team and role (digests, never the tokens).
        model_roots: Folders a job's local model must lie under (besides ``DATA_DIR/models``,
            where ``model.make`` creates models); hub names are not paths and pass.
        mlflow_uri: MLflow tracking URI of every job (None: a store in each study's folder).
        max_concurrent: Studies running at once (None: 1 on a cluster without GPUs, else the
            number of GPUs).
        max_upload_bytes: Largest request body accepted (413 above).
        study_storage: Optuna storage URL for jobs that set none (None: SQLite per study).
        poll_interval_s: Scheduler period.
        mlflow: Let jobs log to MLflow (each job's ``mlflow.enabled`` still decides).
        cpus_per_trial: CPU resources each trial actor asks Ray for.
        max_driver_starts: A job whose driver died this many times is failed.
    """

    database_url: str
    data_dir: str
    trace_roots: tuple[str, ...] = ()
    token_sha256: tuple[str, ...] = ()
    tokens: tuple[TokenEntry, ...] = ()
    model_roots: tuple[str, ...] = ()
    mlflow_uri: str | None = None
    max_concurrent: int | None = None
    max_upload_bytes: int = 32 * 1024**2
    study_storage: str | None = None
    poll_interval_s: float = 2.0
    mlflow: bool = True
    cpus_per_trial: float = 1.0
    max_driver_starts: int = 5

    def token_entries(self) -> tuple[TokenEntry, ...]:
        """Every accepted token: :attr:`tokens`, then :attr:`token_sha256` (team default)."""
        return self.tokens + tuple(TokenEntry(digest=d) for d in self.token_sha256)


def load_tokens(token_file: str | Path | None = None, env_value: str | None = None) -> list[str]:
    """Tokens from a file (one per line, ``#`` comments) and/or a comma/space separated string.

    Raises:
        ConfigError: The file cannot be read.
    """
    tokens: list[str] = []
    if token_file:
        try:
            text = Path(token_file).read_text()
        except OSError as exc:
            raise ConfigError(f"{token_file}: cannot read the token file ({exc.strerror})") from exc
        tokens += [ln.strip() for ln in text.splitlines() if ln.strip() and ln[0] != "#"]
    if env_value:
        tokens += [t for t in re.split(r"[\s,]+", env_value) if t]
    return tokens


def token_matches(presented: str | None, digests: Iterable[str]) -> bool:
    """True when ``presented`` hashes to one of ``digests`` (constant-time comparisons)."""
    if not presented:
        return False
    mine = hash_token(presented)
    ok = False
    for d in digests:
        # Compare against every digest so the time does not say which one matched.
        ok |= hmac.compare_digest(mine, d)
    return ok


# --- submissions ------------------------------------------------------------------------------


class TraceUpload(BaseModel):
    """A trace sent inside a JSON/YAML submission.

    Attributes:
        filename: File name (its extension picks the format when the job says ``auto``).
        content_b64: The file, base64-encoded.
    """

    model_config = ConfigDict(extra="forbid")

    filename: str = Field(min_length=1, max_length=200)
    content_b64: str


class Submission(BaseModel):
    """The envelope of ``POST /v1/studies``: a job plus what only the service needs.

    Attributes:
        job: The job, with the job file's schema.
        not_before: Do not start before this time (ISO 8601; naive means the server's local
            time).
        until: Stop launching trials at this time; a job still queued then expires.
        trace_upload: The trace itself, replacing the job's ``trace.path``.
    """

    model_config = ConfigDict(extra="forbid")

    job: dict[str, Any]
    not_before: datetime | None = None
    until: datetime | None = None
    trace_upload: TraceUpload | None = None


def parse_submission(doc: Any) -> Submission:
    """An envelope (a mapping with ``job``) or a bare job mapping -> :class:`Submission`.

    Raises:
        ConfigError: Neither shape, or an invalid envelope.
    """
    if not isinstance(doc, dict):
        raise ConfigError("the body must be a job (a mapping: name, model, trace, ...)")
    if isinstance(doc.get("job"), dict):
        try:
            return Submission.model_validate(doc)
        except ValidationError as exc:
            lines = ["invalid submission"]
            for err in exc.errors():
                path = ".".join(str(p) for p in err["loc"]) or "(top level)"
                msg = err["msg"]
                if err["type"] == "extra_forbidden":
                    msg = "unknown key; valid keys: job, not_before, until, trace_upload"
                lines.append(f"  {path}: {msg}")
            raise ConfigError("\n".join(lines)) from exc
    return Submission(job=doc)


def parse_body(body: bytes, content_type: str = "") -> Any:
    """A JSON or YAML request body -> its document, within the service's limits (no YAML
    aliases, bounded depth and sizes: :func:`optimizer.service.security.parse_document`).

    Raises:
        ConfigError: Not parseable, or over a limit (the message quotes none of the body).
    """
    return security.parse_document(
        body, json_body="json" in content_type, exempt=[("trace_upload", "content_b64")]
    )


def _safe_filename(name: str) -> str:
    base = Path(name.replace("\\", "/")).name
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".")
    return clean or "trace"


# --- the store --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRecord:
    """One job as stored.

    Attributes:
        id: Job (and study) id.
        seq: Submission order (FIFO key).
        name: Study name.
        state: One of :data:`ACTIVE_STATES` or :data:`FINAL_STATES`.
        job: The job document (paths resolved, service overrides applied).
        base: Folder relative paths resolve against.
        storage_url: The study's Optuna storage.
        out: The study folder.
        submitted_at: Epoch seconds.
        not_before: Epoch seconds or None.
        until: Epoch seconds or None.
        started_at: When the first driver started (epoch) or None.
        finished_at: When the job reached a final state (epoch) or None.
        driver_starts: How many drivers were started (more than one: resumed).
        cancel_requested: Cancel was asked for.
        message: Last news (error, resume, reason of a final state).
        progress: The driver's last status report.
        owner: The team that submitted it.
    """

    id: str
    seq: int
    name: str
    state: str
    job: dict[str, Any]
    base: str
    storage_url: str
    out: str
    submitted_at: float
    not_before: float | None = None
    until: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    driver_starts: int = 0
    cancel_requested: bool = False
    message: str = ""
    progress: dict[str, Any] = field(default_factory=dict)
    owner: str = DEFAULT_TEAM


_meta = sa.MetaData()
_jobs = sa.Table(
    "autotune_jobs",
    _meta,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(32), nullable=False, unique=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("job", sa.Text, nullable=False),
    sa.Column("base", sa.Text, nullable=False),
    sa.Column("storage_url", sa.Text, nullable=False),
    sa.Column("out", sa.Text, nullable=False),
    sa.Column("submitted_at", sa.Float, nullable=False),
    sa.Column("not_before", sa.Float),
    sa.Column("until", sa.Float),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
    sa.Column("driver_starts", sa.Integer, nullable=False, default=0),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, default=False),
    sa.Column("message", sa.Text, nullable=False, default=""),
    sa.Column("progress", sa.Text, nullable=False, default="{}"),
    sa.Column("owner", sa.String(64), nullable=False, default=DEFAULT_TEAM, index=True),
)


class JobStore:
    """Jobs in a relational database (SQLAlchemy Core), shared by the API and the scheduler.

    Args:
        url: SQLAlchemy URL (``sqlite:///service.db``, ``postgresql+psycopg2://...``).
    """

    def __init__(self, url: str) -> None:
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            path = url.split("///", 1)[-1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"timeout": 60, "check_same_thread": False}
        else:
            kwargs["pool_pre_ping"] = True
        self.engine = sa.create_engine(url, **kwargs)
        _meta.create_all(self.engine)
        self._add_owner_column()

    def _add_owner_column(self) -> None:
        """A store written before studies had owners: its jobs belong to the default team."""
        columns = {c["name"] for c in sa.inspect(self.engine).get_columns(_jobs.name)}
        if "owner" in columns:
            return
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"ALTER TABLE {_jobs.name} ADD COLUMN owner VARCHAR(64) NOT NULL "
                    f"DEFAULT '{DEFAULT_TEAM}'"
                )
            )

    @staticmethod
    def _record(row: Any) -> JobRecord:
        m = row._mapping
        return JobRecord(
            id=m["id"],
            seq=int(m["seq"]),
            name=m["name"],
            state=m["state"],
            job=json.loads(m["job"]),
            base=m["base"],
            storage_url=m["storage_url"],
            out=m["out"],
            submitted_at=float(m["submitted_at"]),
            not_before=m["not_before"],
            until=m["until"],
            started_at=m["started_at"],
            finished_at=m["finished_at"],
            driver_starts=int(m["driver_starts"] or 0),
            cancel_requested=bool(m["cancel_requested"]),
            message=m["message"] or "",
            progress=json.loads(m["progress"] or "{}"),
            owner=m["owner"] or DEFAULT_TEAM,
        )

    def add(self, rec: JobRecord) -> JobRecord:
        """Insert a new job; returns it with its submission order."""
        with self.engine.begin() as conn:
            result = conn.execute(
                _jobs.insert().values(
                    id=rec.id,
                    name=rec.name,
                    state=rec.state,
                    job=json.dumps(rec.job, default=str),
                    base=rec.base,
                    storage_url=rec.storage_url,
                    out=rec.out,
                    submitted_at=rec.submitted_at,
                    not_before=rec.not_before,
                    until=rec.until,
                    driver_starts=0,
                    cancel_requested=False,
                    message=rec.message,
                    progress="{}",
                    owner=rec.owner,
                )
            )
            pk = result.inserted_primary_key
            assert pk is not None
            seq = int(pk[0])
        return replace(rec, seq=seq)

    def get(self, job_id: str) -> JobRecord:
        """One job.

        Raises:
            NotFound: No such id.
        """
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(_jobs).where(_jobs.c.id == job_id)).first()
        if row is None:
            raise NotFound(f"no study {job_id!r}")
        return self._record(row)

    def records(
        self, states: Iterable[str] | None = None, owner: str | None = None
    ) -> list[JobRecord]:
        """Jobs in submission order, optionally only those in ``states`` / of ``owner``."""
        q = sa.select(_jobs).order_by(_jobs.c.seq)
        if states is not None:
            q = q.where(_jobs.c.state.in_(list(states)))
        if owner is not None:
            q = q.where(_jobs.c.owner == owner)
        with self.engine.connect() as conn:
            return [self._record(r) for r in conn.execute(q)]

    def update(self, job_id: str, *, expect: Iterable[str] | None = None, **values: Any) -> bool:
        """Change fields of a job; with ``expect``, only while it is in one of those states.

        Returns:
            Whether a row changed (False: the state moved on in between).
        """
        if "progress" in values:
            values["progress"] = json.dumps(values["progress"], default=str)
        q = _jobs.update().where(_jobs.c.id == job_id).values(**values)
        if expect is not None:
            q = q.where(_jobs.c.state.in_(list(expect)))
        with self.engine.begin() as conn:
            return bool(conn.execute(q).rowcount)

    def finish(self, job_id: str, state: str, message: str, now: float) -> bool:
        """Move an active job to a final state."""
        assert state in FINAL_STATES, state
        return self.update(
            job_id, expect=ACTIVE_STATES, state=state, message=message[:4000], finished_at=now
        )


# --- drivers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverStatus:
    """What a study driver says about itself.

    Attributes:
        state: ``starting``, ``running``, or final: ``done``, ``failed``, ``cancelled``.
        message: Error or news.
        remaining: Trials still to launch (None: no count limit).
        budget_left_s: Seconds before launching stops (None: no budget).
        last_event: The latest study event, in words.
    """

    state: str
    message: str = ""
    remaining: int | None = None
    budget_left_s: float | None = None
    last_event: str = ""

    @property
    def final(self) -> bool:
        """The driver has ended."""
        return self.state in ("done", "failed", "cancelled")


class DriverLauncher(Protocol):
    """Starts and controls one study driver per job (a Ray actor in the service)."""

    def start(self, rec: JobRecord) -> None:
        """Start (or resume) the job's study."""
        ...

    def poll(self, job_id: str) -> DriverStatus | None:
        """The driver's status; None when it does not exist (never started, or died)."""
        ...

    def cancel(self, job_id: str) -> None:
        """Stop launching and stop the running trials (their actors and servers)."""
        ...

    def request_stop(self, job_id: str) -> None:
        """Stop launching; running trials finish."""
        ...

    def release(self, job_id: str) -> None:
        """Forget a driver that has ended (free its actor)."""
        ...


class StudyHost:
    """The body of a study's driver actor: prepares the plan and runs a StudyDriver in a thread.

    Args:
        job_id: Job id (for messages).
        job: The job document.
        base: Folder relative paths resolve against.
        until: Epoch seconds at which launching stops, or None.
        mlflow: Log to MLflow when the job enables it.
        cpus_per_trial: CPU resources each trial actor asks for.
        cancel_requested: Start cancelled (a cancel that arrived while no driver existed).
    """

    def __init__(
        self,
        job_id: str,
        job: dict[str, Any],
        base: str,
        until: float | None = None,
        mlflow: bool = True,
        cpus_per_trial: float = 1.0,
        cancel_requested: bool = False,
    ) -> None:
        self.job_id = job_id
        self._job = job
        self._base = base
        self._until = until
        self._mlflow = mlflow
        self._cpus = cpus_per_trial
        self._lock = threading.Lock()
        self._state = "starting"
        self._message = ""
        self._last_event = ""
        self._driver: Any = None
        self._cancel = cancel_requested
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"study-{job_id}", daemon=True)
        self._thread.start()

    def _on_event(self, ev: Any) -> None:
        text = f"trial {ev.number} {ev.kind}"
        if ev.result is not None:
            text += f": {ev.result.status.value}"
            if ev.result.failure_class is not None:
                text += f" ({ev.result.failure_class.value})"
        self._last_event = text

    def _tracker(self, plan: Any) -> Any:
        if not (self._mlflow and plan.job.mlflow.enabled):
            return None
        try:
            tracking = importlib.import_module("optimizer.tracking")
            make = getattr(tracking, "tracker_for_plan", None)
            return make(plan) if make is not None else None
        except Exception as exc:  # MLflow is a review aid: its failure never stops a study
            self._message = f"MLflow off: {type(exc).__name__}: {exc}"
            return None

    def _run(self) -> None:
        from datetime import timedelta

        from optimizer.runners import RayRunner
        from optimizer.study import StudyDriver, prepare

        runner: Any = None
        try:
            # A job stored before the service's policy (queued, or resumed after an upgrade)
            # is held to it too: its flags would otherwise reach a server here.
            security.check_stored_study(self._job)
            job, base = load_job(self._job, base=Path(self._base))
            JobService._check_space(job)
            plan = prepare(job, base)
            security.mark_service_study(plan.out, self.job_id)  # a job queued before markers
            capacity = 1 if plan.context.cpu_build else job.parallel
            runner = _ClusterLossGuard(
                RayRunner(capacity=capacity, cpus_per_trial=self._cpus), lambda: self._cancel
            )
            tracker = self._tracker(plan)

            def on_event(ev: Any) -> None:
                self._on_event(ev)
                if tracker is not None:
                    with contextlib.suppress(Exception):
                        tracker.on_event(ev)

            driver = _create_driver(lambda: StudyDriver(plan, runner, on_event=on_event))
            if self._until is not None:
                until = datetime.fromtimestamp(self._until)
                driver.deadline = min(driver.deadline, until) if driver.deadline else until
                if driver.deadline <= driver.now():
                    driver.deadline = driver.now() - timedelta(seconds=1)
            with self._lock:
                self._driver = driver
                self._state = "running"
                if self._cancel:
                    driver.cancel()
                elif self._stop:
                    driver.request_stop()
            study = driver.run()
            if tracker is not None:
                with contextlib.suppress(Exception):
                    tracker.finish(study)
            self._state = "cancelled" if self._cancel else "done"
        except AutotuneError as exc:
            self._message = str(exc)
            self._state = "cancelled" if self._cancel else "failed"
        except Exception as exc:
            self._message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            self._state = "cancelled" if self._cancel else "failed"
        finally:
            if runner is not None:
                with contextlib.suppress(Exception):
                    runner.close()

    def status(self) -> dict[str, Any]:
        """The driver's :class:`DriverStatus` as a dict."""
        driver = self._driver
        remaining: int | None = None
        left: float | None = None
        if driver is not None:
            with contextlib.suppress(Exception):
                remaining = driver.remaining()
            budget = driver.budget_left()
            left = budget.total_seconds() if budget is not None else None
        return {
            "state": self._state,
            "message": self._message,
            "remaining": remaining,
            "budget_left_s": left,
            "last_event": self._last_event,
        }

    def cancel(self) -> None:
        """Stop launching and stop the running trials."""
        with self._lock:
            self._cancel = True
            if self._driver is not None:
                self._driver.cancel()

    def request_stop(self) -> None:
        """Stop launching; running trials finish."""
        with self._lock:
            self._stop = True
            if self._driver is not None:
                self._driver.request_stop()

    def pid(self) -> int:
        """The actor's process id (tests)."""
        import os

        return os.getpid()


def _create_driver(make: Callable[[], Any], attempts: int = 3) -> Any:
    """Create a StudyDriver, retrying when another process initializes the storage at once."""
    for attempt in range(attempts):
        try:
            return make()
        except sa.exc.SQLAlchemyError:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


class _ClusterLossGuard:
    """A runner wrapper: a trial lost because the cluster went away is not a result.

    When a trial's actor dies and the driver did not cancel it, the driver asks the cluster
    whether its own node is still alive. If it is not (or the cluster does not answer), the
    driver exits at once without telling the trial, exactly as a killed driver would: the
    trial stays RUNNING and the next driver fails and re-queues it. A trial actor that died on
    a healthy cluster (e.g. killed for memory) is a trial failure, passed on as such.
    """

    def __init__(self, inner: Any, cancelling: Callable[[], bool]) -> None:
        self.inner = inner
        self.capacity = inner.capacity
        self._cancelling = cancelling

    def submit(self, spec: Any, gpus: int) -> Any:
        import concurrent.futures

        handle = self.inner.submit(spec, gpus)
        relayed: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def relay(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            if exc is None:
                relayed.set_result(fut.result())
                return
            # Decide off Ray's callback thread: the health check may block.
            threading.Thread(target=self._judge, args=(exc, relayed), daemon=True).start()

        handle.future.add_done_callback(relay)
        handle.future = relayed
        return handle

    def _judge(self, exc: BaseException, out: Any) -> None:
        import os

        import ray

        if (
            isinstance(exc, ray.exceptions.RayActorError)
            and not self._cancelling()
            and not _own_node_alive(timeout_s=15.0)
        ):
            os._exit(1)
        out.set_exception(exc)

    def cancel(self, handle: Any) -> None:
        self.inner.cancel(handle)

    def release(self, handle: Any) -> None:
        release = getattr(self.inner, "release", None)
        if release is not None:
            release(handle)

    def close(self) -> None:
        self.inner.close()


def _own_node_alive(timeout_s: float) -> bool:
    """Whether the cluster answers, within ``timeout_s``, that this process's node is alive."""
    import ray

    answer: list[bool] = []

    def ask() -> None:
        with contextlib.suppress(Exception):
            me = ray.get_runtime_context().get_node_id()
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
            answer.append(any(n["NodeID"] == me and n["Alive"] for n in nodes))

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(answer and answer[0])


class RayDriverLauncher:
    """Each job's driver is a detached, named Ray actor on the current cluster.

    Detached, so a restart of the API replica (or of Serve) finds the driver by name and keeps
    it; when the cluster itself went away the scheduler starts a new driver, which resumes.

    Args:
        mlflow: Let drivers log to MLflow.
        cpus_per_trial: CPU resources of each trial actor.
    """

    def __init__(self, *, mlflow: bool = True, cpus_per_trial: float = 1.0) -> None:
        import ray

        self._ray = ray
        self._mlflow = mlflow
        self._cpus = cpus_per_trial
        # num_cpus 0: a driver waits on its trials; it must not hold the CPU a trial needs.
        # max_concurrency: status and cancel answer while the driver's thread runs.
        self._cls = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(StudyHost)  # type: ignore[call-overload]

    @staticmethod
    def actor_name(job_id: str) -> str:
        """The driver actor's name."""
        return f"vllm-autotune-study-{job_id}"

    def _actor(self, job_id: str) -> Any:
        try:
            return self._ray.get_actor(self.actor_name(job_id), namespace=_NAMESPACE)
        except ValueError:
            return None

    def start(self, rec: JobRecord) -> None:
        self._cls.options(
            name=self.actor_name(rec.id),
            namespace=_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
        ).remote(
            rec.id,
            rec.job,
            rec.base,
            rec.until,
            self._mlflow,
            self._cpus,
            rec.cancel_requested,
        )

    def poll(self, job_id: str) -> DriverStatus | None:
        actor = self._actor(job_id)
        if actor is None:
            return None
        try:
            doc = self._ray.get(actor.status.remote(), timeout=60)
        except self._ray.exceptions.GetTimeoutError:
            return DriverStatus(state="running", message="the driver did not answer in time")
        except self._ray.exceptions.RayActorError:
            return None
        return DriverStatus(**doc)

    def cancel(self, job_id: str) -> None:
        actor = self._actor(job_id)
        if actor is not None:
            with contextlib.suppress(self._ray.exceptions.RayActorError):
                self._ray.get(actor.cancel.remote(), timeout=60)

    def request_stop(self, job_id: str) -> None:
        actor = self._actor(job_id)
        if actor is not None:
            with contextlib.suppress(self._ray.exceptions.RayActorError):
                self._ray.get(actor.request_stop.remote(), timeout=60)

    def release(self, job_id: str) -> None:
        actor = self._actor(job_id)
        if actor is not None:
            self._ray.kill(actor, no_restart=True)

    def cluster_gpus(self) -> int:
        """GPUs of the cluster."""
        resources: dict[str, float] = self._ray.cluster_resources()  # type: ignore[no-untyped-call]
        return int(resources.get("GPU", 0))


# --- the scheduler ----------------------------------------------------------------------------


class Scheduler:
    """First in, first out, ``max_concurrent`` studies at once; the store is the truth.

    Each :meth:`tick` reconciles running jobs with their drivers (progress, final states, a
    lost driver restarted so its study resumes, cancels and ``until`` delivered), expires queued
    jobs whose ``until`` passed, and starts queued jobs whose ``not_before`` has come while
    slots are free. :meth:`start` runs ticks in a background thread.

    Args:
        store: The job store.
        launcher: Where drivers run.
        max_concurrent: Studies at once.
        max_driver_starts: A job whose driver died this often is failed.
        clock: Epoch seconds (a seam for tests).
    """

    def __init__(
        self,
        store: JobStore,
        launcher: DriverLauncher,
        *,
        max_concurrent: int = 1,
        max_driver_starts: int = 5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.launcher = launcher
        self.max_concurrent = max(1, max_concurrent)
        self.max_driver_starts = max_driver_starts
        self.clock = clock
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self._stopped: set[str] = set()
        self.last_tick: float | None = None
        self.last_error = ""

    # --- one pass ------------------------------------------------------------------------------

    def tick(self) -> None:
        """One reconciliation pass."""
        with self._tick_lock:
            self._tick()
            self.last_tick = self.clock()

    def _tick(self) -> None:
        now = self.clock()
        running = 0
        for rec in self.store.records(states=("running",)):
            if self._reconcile(rec, now):
                running += 1
        for rec in self.store.records(states=("queued",)):
            if rec.cancel_requested:
                self.store.finish(rec.id, "cancelled", "cancelled before it started", now)
                continue
            if rec.until is not None and now >= rec.until:
                self.store.finish(rec.id, "expired", "its time window closed while queued", now)
                continue
            if running >= self.max_concurrent:
                continue
            if rec.not_before is not None and now < rec.not_before:
                continue
            if self.store.update(
                rec.id,
                expect=("queued",),
                state="running",
                started_at=now,
                driver_starts=1,
                message="",
            ):
                self.launcher.start(replace(rec, state="running", driver_starts=1))
                running += 1

    def _reconcile(self, rec: JobRecord, now: float) -> bool:
        """Bring one running job up to date; True while it still occupies a slot."""
        status = self.launcher.poll(rec.id)
        if status is None:
            if rec.cancel_requested:
                self.store.finish(rec.id, "cancelled", "cancelled", now)
                return False
            if rec.driver_starts >= self.max_driver_starts:
                self.store.finish(
                    rec.id,
                    "failed",
                    f"the study driver died {rec.driver_starts} times; see the Ray logs",
                    now,
                )
                return False
            # No driver: the service or the cluster restarted (or the driver died). A new one
            # resumes the study from its storage.
            self.store.update(
                rec.id,
                driver_starts=rec.driver_starts + 1,
                message=f"driver (re)started {rec.driver_starts + 1} times: study resumed",
            )
            self.launcher.start(replace(rec, driver_starts=rec.driver_starts + 1))
            return True
        progress = {
            "driver": status.state,
            "remaining": status.remaining,
            "budget_left_s": status.budget_left_s,
            "last_event": status.last_event,
            "updated_at": now,
            # A running driver has created the study's storage: from now on readers are safe.
            "storage_ready": bool(rec.progress.get("storage_ready"))
            or status.state in ("running", "done", "cancelled"),
        }
        if status.final:
            state = status.state if status.state in FINAL_STATES else "failed"
            if rec.cancel_requested and state == "done":
                state = "cancelled"
            self.store.update(rec.id, progress=progress)
            self.store.finish(rec.id, state, status.message or rec.message, now)
            self.launcher.release(rec.id)
            self._stopped.discard(rec.id)
            return False
        self.store.update(rec.id, progress=progress)
        if rec.cancel_requested:
            self.launcher.cancel(rec.id)
        elif rec.until is not None and now >= rec.until and rec.id not in self._stopped:
            self.launcher.request_stop(rec.id)
            self._stopped.add(rec.id)
        return True

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel a job: a queued one ends now; a running one's driver stops its trials.

        Raises:
            NotFound: No such job.
        """
        rec = self.store.get(job_id)
        if rec.state not in ACTIVE_STATES:
            return rec
        self.store.update(job_id, cancel_requested=True)
        now = self.clock()
        if rec.state == "queued":
            self.store.finish(job_id, "cancelled", "cancelled before it started", now)
        else:
            self.launcher.cancel(job_id)
        self.wake()
        return self.store.get(job_id)

    # --- the thread ----------------------------------------------------------------------------

    def wake(self) -> None:
        """Run the next tick now."""
        self._wake.set()

    def start(self, interval_s: float = 2.0) -> None:
        """Tick every ``interval_s`` (and on :meth:`wake`) in a daemon thread."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._halt.is_set():
                try:
                    self.tick()
                    self.last_error = ""
                except Exception as exc:  # keep scheduling; the next tick retries
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.exception("scheduler tick failed")
                self._wake.wait(interval_s)
                self._wake.clear()

        self._thread = threading.Thread(target=loop, name="autotune-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (drivers keep running)."""
        self._halt.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        """The background thread runs."""
        return self._thread is not None and self._thread.is_alive()


# --- the service ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportResult:
    """An export as a download.

    Attributes:
        text: The file.
        filename: Suggested file name.
        trial: The trial exported.
        gain: What the header says about the measured gain.
    """

    text: str
    filename: str
    trial: int
    gain: str


#: (record, study, choice, runs, force) -> (gain text, reasons to refuse); a forced gain text
#: says what it overrode. The service default re-runs both on the cluster; tests pass a fake.
Validator = Callable[[JobRecord, optuna.Study, Any, int, bool], tuple[str, list[str]]]


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def _timestamp(key: str, when: datetime | None) -> float | None:
    """A submission's time as a timestamp that :func:`_iso` can show again.

    Raises:
        ConfigError: A time the platform cannot represent (year 1 or 9999 near the edges of
            the local time zone): stored, it would break every later listing.
    """
    if when is None:
        return None
    try:
        ts = when.timestamp()
        _iso(ts)
    except (ValueError, OverflowError, OSError) as exc:
        raise ConfigError(f"{key}: {when.isoformat()} is out of range ({exc})") from exc
    return ts


def _num(v: Any) -> Any:
    """JSON-safe numbers: NaN and infinities become None."""
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


class JobService:
    """Everything the HTTP API does, without HTTP: submit, list, show, cancel, export.

    Args:
        settings: Service settings.
        store: The job store.
        scheduler: The scheduler (its launcher runs the drivers).
        check_plan: Called with a submitted job and its base folder before it is queued
            (default: :func:`~optimizer.study.prepare` without the flag check, so a bad trace,
            space or SLO is refused at once); raise ConfigError to refuse.
        validator: Re-validation for exports with ``validate=true``.
        clock: Epoch seconds.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        store: JobStore,
        scheduler: Scheduler,
        *,
        check_plan: Callable[[JobConfig, Path], None] | None = None,
        validator: Validator | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.store = store
        self.scheduler = scheduler
        self.check_plan = check_plan if check_plan is not None else _prepare_check
        self.validator = validator if validator is not None else _cluster_validator
        self.clock = clock
        self.data_dir = Path(settings.data_dir).resolve()
        self.roots = [Path(r).expanduser().resolve() for r in settings.trace_roots]
        self.models_dir = self.data_dir / "models"
        self.model_roots = [
            *(Path(r).expanduser().resolve() for r in settings.model_roots),
            self.models_dir,
        ]
        self._storages: dict[str, optuna.storages.BaseStorage] = {}
        self._storage_lock = threading.Lock()

    # --- submit --------------------------------------------------------------------------------

    def _under_roots(self, path: Path, extra: Iterable[Path] = ()) -> bool:
        return security.under(path, [*self.roots, *extra])

    def submit(
        self,
        sub: Submission,
        *,
        upload: tuple[str, bytes] | None = None,
        owner: Principal | None = None,
    ) -> tuple[JobRecord, list[str]]:
        """Check a submission and queue it.

        Args:
            sub: The submission.
            upload: A trace uploaded as a file part: (file name, bytes).
            owner: Who submits (its team owns the study; None: the default team).

        Returns:
            The queued job and notes on what the service changed in it.

        Raises:
            ConfigError: An invalid job (the message names the key and the fix).
            SubmissionRefused: A file outside the allowed roots, or an oversize upload.
        """
        job_id = uuid.uuid4().hex[:12]
        upload_dir = self.data_dir / "uploads" / job_id
        team = owner.team if owner is not None else DEFAULT_TEAM
        try:
            return self._submit(job_id, upload_dir, sub, upload, team)
        except BaseException:
            shutil.rmtree(upload_dir, ignore_errors=True)  # a refused job leaves nothing
            raise

    def _submit(
        self,
        job_id: str,
        upload_dir: Path,
        sub: Submission,
        upload: tuple[str, bytes] | None,
        team: str,
    ) -> tuple[JobRecord, list[str]]:
        security.check_limits(sub.job)  # a Submission built in code, not only parsed bodies
        doc = json.loads(json.dumps(sub.job, default=str))
        notes: list[str] = []
        if sub.trace_upload is not None:
            try:
                data = base64.b64decode(sub.trace_upload.content_b64, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ConfigError(f"trace_upload.content_b64: not valid base64 ({exc})") from exc
            upload = (sub.trace_upload.filename, data)
        if upload is not None:
            name, data = upload
            if len(data) > self.settings.max_upload_bytes:
                raise SubmissionRefused(
                    f"the trace is {len(data)} bytes; the limit is "
                    f"{self.settings.max_upload_bytes} bytes",
                    status=413,
                )
            trace = doc.get("trace")
            if not isinstance(trace, dict):
                trace = {}
                doc["trace"] = trace
            upload_dir.mkdir(parents=True, exist_ok=True)
            path = upload_dir / _safe_filename(name)
            path.write_bytes(data)
            trace["path"] = str(path)
            notes.append(f"trace: the uploaded file ({len(data)} bytes)")
        out = self.data_dir / "studies" / job_id
        if isinstance(doc.get("out"), str):
            notes.append(f"out: ignored ({doc['out']}); the service keeps studies in {out}")
        doc["out"] = str(out)
        if doc.get("ray_address"):
            notes.append("ray_address: ignored; studies run on the service's cluster")
        doc["ray_address"] = None
        notes += self._operator_urls(doc)
        engine = doc.get("engine")
        if isinstance(engine, dict):
            if engine.get("python"):
                raise ConfigError(
                    "engine.python: the service runs servers with its own vLLM; remove the key"
                )
            # Not mappings: the job loader below says so (iterating them here would be a 500).
            if isinstance(engine.get("env"), dict):
                security.check_env(engine["env"])
            for key in ("args", "baseline_args"):
                if isinstance(engine.get(key), dict):
                    security.check_engine_args(engine[key], f"engine.{key}")
        model = doc.get("model")
        made = isinstance(model, dict) and model.get("make") and isinstance(model.get("path"), str)
        if made and not model["path"].startswith(("/", "~")):  # a relative target: ours
            model["path"] = str(self.models_dir / model["path"])
        base = self.roots[0] if self.roots else self.data_dir
        job, base = load_job(doc, base=base)
        self._check_model(job)
        trace_path = Path(job.trace.path)
        if not self._under_roots(trace_path, [upload_dir]):
            raise SubmissionRefused(
                f"trace.path {job.trace.path}: outside the service's trace roots ("
                + (", ".join(str(r) for r in self.roots) or "none configured")
                + "): upload the trace with the request (trace_upload, or a multipart `trace` "
                "part) or ask the operator to add a --trace-root",
                status=403,
            )
        space = job.search_space
        if (
            isinstance(space, str)
            and space.endswith((".yaml", ".yml"))
            and not self._under_roots(Path(space))
        ):
            raise SubmissionRefused(
                f"search_space {space}: outside the service's trace roots; inline the "
                "space in the job or use a preset name",
                status=403,
            )
        self._check_space(job)
        self._prepare(job, base)
        now = self.clock()
        rec = JobRecord(
            id=job_id,
            seq=0,
            name=job.name,
            state="queued",
            job=job.model_dump(mode="json"),
            base=str(base),
            storage_url=job.storage_url(base),
            out=str(job.output_dir(base)),
            submitted_at=now,
            not_before=_timestamp("not_before", sub.not_before),
            until=_timestamp("until", sub.until),
            owner=team,
        )
        if rec.until is not None and rec.until <= now:
            raise ConfigError("until: the time window has already closed; give a later time")
        # `vllm-autotune export` on this folder applies the service's policy too
        security.mark_service_study(Path(rec.out), job_id)
        rec = self.store.add(rec)
        self.scheduler.wake()
        return rec, notes

    def _operator_urls(self, doc: dict[str, Any]) -> list[str]:
        """Storage and MLflow are the operator's: a job's own URLs are replaced (with a note)."""
        notes: list[str] = []
        if doc.get("storage"):
            notes.append("storage: ignored; the service keeps every study in its own storage")
        doc.pop("storage", None)
        if self.settings.study_storage:
            doc["storage"] = self.settings.study_storage
        ml = doc.get("mlflow")
        if isinstance(ml, dict):
            if ml.get("tracking_uri"):
                notes.append("mlflow.tracking_uri: ignored; the service's MLflow store is used")
            ml.pop("tracking_uri", None)
            if self.settings.mlflow_uri:
                ml["tracking_uri"] = self.settings.mlflow_uri
        return notes

    def _check_model(self, job: JobConfig) -> None:
        """A model folder is read under the model roots, and made only under DATA_DIR/models."""
        path = job.model.path
        if job.model.make:
            if not security.under(path, [self.models_dir]):
                raise SubmissionRefused(
                    f"model.path: with `make` the service creates models only in its own "
                    f"folder; give a relative path (it lands in {self.models_dir})",
                    status=403,
                )
        elif Path(path).is_absolute() and not security.under(path, self.model_roots):
            raise SubmissionRefused(
                "model.path: outside the service's model roots ("
                + ", ".join(str(r) for r in self.model_roots)
                + "): ask the operator to add a --model-root, or give a hub name",
                status=403,
            )

    @staticmethod
    def _check_space(job: JobConfig) -> None:
        """Every flag the search space can set is one the service accepts."""
        from search_spaces.schema import load_space

        security.check_space(load_space(job.search_space))

    def _prepare(self, job: JobConfig, base: Path) -> None:
        """The plan check, with every failure a 4xx that quotes none of the trace."""
        try:
            self.check_plan(job, base)
        except TraceError as exc:
            where = ", ".join(
                f"{k} {v}" for k, v in (("line", exc.line), ("field", exc.field)) if v is not None
            )
            raise ConfigError(
                f"trace: {Path(job.trace.path).name} cannot be read"
                + (f" ({where})" if where else "")
                + "; the service does not quote the file: `vllm-autotune trace inspect` on it "
                "says what is wrong"
            ) from None
        except (ConfigError, SubmissionRefused):
            raise
        except Exception as exc:
            log.warning("submission refused: its plan failed with %s", type(exc).__name__)
            raise ConfigError(
                f"the job could not be prepared ({type(exc).__name__}): the trace or the "
                "model folder is unreadable; `vllm-autotune tune` on it locally says more"
            ) from None

    # --- reads ---------------------------------------------------------------------------------

    def get(self, job_id: str, who: Principal | None = None) -> JobRecord:
        """One job, if ``who`` may see it (None: anyone, the service itself).

        Raises:
            NotFound: No such job, or another team's (the same answer: no id is confirmed).
        """
        rec = self.store.get(job_id)
        if who is not None and not who.may_see(rec.owner):
            raise NotFound(f"no study {job_id!r}")
        return rec

    def summary(self, rec: JobRecord) -> dict[str, Any]:
        """The short form of a job (lists)."""
        state = rec.state
        if state == "running" and rec.cancel_requested:
            state = "cancelling"
        return {
            "id": rec.id,
            "name": rec.name,
            "owner": rec.owner,
            "state": state,
            "submitted_at": _iso(rec.submitted_at),
            "not_before": _iso(rec.not_before),
            "until": _iso(rec.until),
            "started_at": _iso(rec.started_at),
            "finished_at": _iso(rec.finished_at),
            "driver_starts": rec.driver_starts,
            "message": rec.message,
            "trials": rec.job.get("trials"),
            "progress": rec.progress,
        }

    def list_summaries(self, who: Principal | None = None) -> list[dict[str, Any]]:
        """Every job ``who`` may see (None or an admin: all), in submission order, short form."""
        owner = None if who is None or who.admin else who.team
        return [self.summary(r) for r in self.store.records(owner=owner)]

    def _storage(self, url: str) -> optuna.storages.BaseStorage:
        from optimizer.study import create_storage

        with self._storage_lock:
            if url not in self._storages:
                self._storages[url] = create_storage(url)
            return self._storages[url]

    def study(self, rec: JobRecord) -> optuna.Study | None:
        """The job's Optuna study, or None before its driver created it.

        The API never opens a storage its driver may still be initializing: two processes
        creating Optuna's schema at once make one of them fail. A storage is read once a
        driver has reported running (``storage_ready``), or when the job has ended.
        """
        url = rec.storage_url
        if url.startswith("sqlite:///") and not Path(url[len("sqlite:///") :]).exists():
            return None
        ready = bool(rec.progress.get("storage_ready"))
        if not ready and not (rec.state in FINAL_STATES and rec.started_at is not None):
            return None
        try:
            return optuna.load_study(study_name=rec.name, storage=self._storage(url))
        except KeyError:
            return None
        except Exception:
            if ready:
                raise
            return None  # a job that failed while creating its storage

    def detail(self, job_id: str, who: Principal | None = None) -> dict[str, Any]:
        """Status, progress, budget, trials and the front with the baseline and gains."""
        from optimizer.report import front_rows, study_status

        rec = self.get(job_id, who)
        doc = self.summary(rec)
        doc["job"] = redact_job(rec.job)
        study = self.study(rec)
        total = rec.job.get("trials")
        progress: dict[str, Any] = {
            "trials_total": total,
            "remaining": rec.progress.get("remaining", total),
            "budget_left_s": rec.progress.get("budget_left_s"),
            "last_event": rec.progress.get("last_event", ""),
        }
        doc["progress"] = progress
        doc["objectives"] = []
        doc["trials_detail"] = []
        doc["baseline"] = None
        doc["front"] = []
        if study is None:
            return doc
        names = metric_names(study)
        doc["objectives"] = [
            {"metric": n, "direction": d.name.lower()}
            for n, d in zip(names, study.directions, strict=False)
        ]
        st = study_status(study)
        progress.update(
            done=st.done,
            running=st.running,
            failed=st.failed,
            infeasible=st.infeasible,
            front_size=st.front_size,
            best=st.best,
            by_status=st.by_status,
        )
        if rec.state in FINAL_STATES:
            progress["remaining"] = 0
        elif total is not None and "remaining" not in rec.progress:
            progress["remaining"] = max(0, int(total) - st.done - st.running)
        doc["trials_detail"] = [
            self._trial_short(t, names) for t in study.get_trials(deepcopy=False)
        ]
        for row in front_rows(study):
            item = {
                "number": row.number,
                "values": {n: _num(v) for n, v in zip(names, row.values, strict=False)},
                "gains_pct": {n: _num(g) for n, g in zip(names, row.gains_pct, strict=False)},
                "changed": row.changed,
                "feasible": row.feasible,
            }
            if row.baseline:
                doc["baseline"] = item
            else:
                doc["front"].append(item)
        return doc

    @staticmethod
    def _trial_short(t: FrozenTrial, names: list[str]) -> dict[str, Any]:
        view = TrialView(t)
        return {
            "number": t.number,
            "state": t.state.name.lower(),
            "status": view.status,
            "baseline": view.is_baseline,
            "values": (
                {n: _num(v) for n, v in zip(names, t.values, strict=False)} if t.values else None
            ),
            "feasible": view.feasible if t.state == TrialState.COMPLETE else None,
            "failure_class": view.failure_class or None,
            "retry_of": view.retry_of,
        }

    def trial(self, job_id: str, number: int, who: Principal | None = None) -> dict[str, Any]:
        """One trial in full: engine args, summary, memory, constraints, message.

        Raises:
            NotFound: No such job or trial (or another team's).
        """
        rec = self.get(job_id, who)
        study = self.study(rec)
        trials = study.get_trials(deepcopy=False) if study is not None else []
        if not 0 <= number < len(trials):
            raise NotFound(f"study {job_id!r} has no trial {number}")
        t = trials[number]
        names = metric_names(study) if study is not None else []
        doc = self._trial_short(t, names)
        view = TrialView(t)
        attrs = {
            k: v
            for k, v in view.attributes().items()
            if k not in ("engine_args", "log_path") and not is_secret(k)
        }
        doc.update(
            engine_args=view.engine_args,
            params=t.params,
            constraints={k: _num(v) for k, v in t.constraints.items()},
            started_at=t.datetime_start.isoformat() if t.datetime_start else None,
            finished_at=t.datetime_complete.isoformat() if t.datetime_complete else None,
            attrs=json.loads(json.dumps(attrs, default=str)),
        )
        return doc

    # --- actions -------------------------------------------------------------------------------

    def cancel(self, job_id: str, who: Principal | None = None) -> dict[str, Any]:
        """Cancel a job (see :meth:`Scheduler.cancel`); returns its short form."""
        self.get(job_id, who)
        return self.summary(self.scheduler.cancel(job_id))

    def export(
        self,
        job_id: str,
        fmt: str,
        policy: str = "max-throughput",
        *,
        trial: int | None = None,
        weights: Mapping[str, float] | None = None,
        validate: bool = False,
        runs: int = 3,
        force: bool = False,
        who: Principal | None = None,
    ) -> ExportResult:
        """The chosen configuration rendered for ``fmt``.

        Raises:
            NotFound: No such job.
            ConfigError: Unknown format or policy, or nothing exportable.
            SubmissionRefused: (409) The study has no measured trial yet, or re-validation
                refused the export.
        """
        from optimizer import export as ex

        rec = self.get(job_id, who)
        study = self.study(rec)
        plan_file = Path(rec.out) / "plan.json"
        if study is None or not plan_file.exists():
            raise SubmissionRefused(
                f"study {job_id} has not started: nothing to export", status=409
            )
        saved = json.loads(plan_file.read_text())
        choice = ex.choose(study, policy, trial_number=trial, weights=weights)
        # What the service would refuse is not exported, nor re-run (a study stored before the
        # allow-list, or a trial whose arguments were changed since).
        _check_stored_job(rec.job)
        security.check_engine_args(
            choice.chosen.engine_args, f"trial {choice.chosen.number}'s engine arguments"
        )
        if validate:
            if choice.baseline is None:
                raise SubmissionRefused("the study has no baseline to validate against", status=409)
            security.check_engine_args(
                choice.baseline.engine_args, "the baseline's engine arguments"
            )
            gain, problems = self.validator(rec, study, choice, runs, force)
            if problems and not force:
                raise SubmissionRefused(
                    "refusing to export: " + "; ".join(problems) + " (force=true exports anyway)",
                    status=409,
                )
        else:
            gain = ex.unvalidated_gain(study, choice)
        text = ex.render(fmt, ex.context(saved, choice, gain, job=rec.job, study_name=rec.name))
        exports = list(study.user_attrs.get("exports", []))
        exports.append(
            {
                "trial": choice.chosen.number,
                "format": fmt,
                "policy": choice.policy,
                "via": "service",
                "gain": gain,
            }
        )
        study.set_user_attr("exports", exports)
        return ExportResult(
            text=text, filename=ex.default_filename(fmt), trial=choice.chosen.number, gain=gain
        )

    def health(self) -> dict[str, Any]:
        """Liveness of the store and the scheduler."""
        db_ok = True
        try:
            with self.store.engine.connect() as conn:
                conn.execute(sa.select(1))
        except Exception:
            db_ok = False
        return {
            "ok": db_ok,
            "database": db_ok,
            "scheduler": self.scheduler.alive,
            "last_tick": _iso(self.scheduler.last_tick),
        }


def _check_stored_job(job: Mapping[str, Any]) -> None:
    """A stored job's engine flags and environment against the service's allow-lists."""
    security.check_stored_study(job)


def _prepare_check(job: JobConfig, base: Path) -> None:
    """Build the plan without starting anything; flags and values are checked against the
    installed vLLM as `tune` does, when this process has one (else the driver checks them)."""
    from optimizer.study import prepare

    prepare(job, base, check_flags=_has_vllm())


@functools.cache
def _has_vllm() -> bool:
    from optimizer.vllm_flags import installed_vllm

    try:
        installed_vllm()
    except (ConfigError, OSError, ValueError):
        return False
    return True


def _cluster_validator(
    rec: JobRecord, study: optuna.Study, choice: Any, runs: int, force: bool
) -> tuple[str, list[str]]:
    """Re-run the choice and the baseline on the cluster (blocking), by the export use case
    the CLI uses (:func:`optimizer.export.revalidate`, :func:`optimizer.export.verdict`)."""
    from optimizer import export as ex
    from optimizer.runners import RayRunner
    from optimizer.study import prepare

    job, base = load_job(rec.job, base=Path(rec.base))
    plan = prepare(job, base)
    runner = RayRunner(capacity=1)
    val = ex.revalidate(
        plan,
        study,
        choice,
        lambda spec, gpus: runner.submit(spec, gpus).future.result(),
        workdir=plan.out / "validation" / f"service-{int(time.time())}",
        runs=runs,
    )
    return ex.verdict(val, choice.policy, force=force)
