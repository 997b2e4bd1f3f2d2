"""The job store (SQLAlchemy Core: SQLite by default, PostgreSQL by URL): the source of truth
for every job's state, so a restarted service finds queued and running jobs where it left them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from optimizer.errors import NotFound
from optimizer.service.auth import DEFAULT_TEAM

__all__ = [
    "ACTIVE_STATES",
    "FINAL_STATES",
    "OWNER_ATTR",
    "JobRecord",
    "JobStore",
    "belongs_to",
    "own_folder_storage",
    "owner_mark",
    "study_name_for",
]

log = logging.getLogger(__name__)

#: Job states. ``queued`` and ``running`` are active; the others are final.
ACTIVE_STATES = ("queued", "running")
FINAL_STATES = ("done", "failed", "cancelled", "expired")


@dataclass(frozen=True)
class QueuedJob:
    """What the scheduler reads of a queued job on each pass (:meth:`JobStore.queued`)."""

    id: str
    not_before: float | None
    until: float | None
    cancel_requested: bool


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
        study_name: The study's name in its Optuna storage (:func:`study_name_for`: the team
            and the job id, never the job's name: two teams' jobs of one name in a shared
            storage are two studies).
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
    study_name: str = ""


def study_name_for(team: str, job_id: str) -> str:
    """The storage name of a job's study: ``TEAM/JOB_ID``. A job file's name cannot hold a
    ``/``, so no study that ``tune`` creates in the same storage can take it."""
    return f"{team}/{job_id}"


#: The study user attribute that names the job (and team) a service study belongs to.
OWNER_ATTR = "vllm_autotune_job"


def owner_mark(team: str, job_id: str) -> dict[str, str]:
    """The value of :data:`OWNER_ATTR` a job's driver writes on its study."""
    return {"team": team, "job": job_id}


def belongs_to(mark: Any, *, team: str, job_id: str, storage_url: str, out: str) -> bool:
    """A study whose :data:`OWNER_ATTR` is ``mark`` is job ``job_id``'s of ``team``: marked
    for them, or unmarked in the job's own folder's file (``out``: a study written before
    the mark; no other job's study is in that file)."""
    if mark is None:
        return own_folder_storage(storage_url, out)
    return bool(mark == owner_mark(team, job_id))


def own_folder_storage(storage_url: str, out: str) -> bool:
    """The storage is the study folder's own SQLite file (no other study is in it)."""
    return storage_url == f"sqlite:///{Path(out) / 'study.db'}"


def _legacy_study_name(m: Any) -> str:
    """The storage name of a job stored before studies were named by id: its job name in its
    own folder's file (the study it created); in a shared storage a new ``TEAM/JOB_ID``, since
    a study there named like the job may be another team's (it is never read or resumed)."""
    if own_folder_storage(m["storage_url"], m["out"]):
        return str(m["name"])
    return study_name_for(m["owner"] or DEFAULT_TEAM, m["id"])


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
    sa.Column("study_name", sa.String(200)),
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
        self._add_columns()

    def _add_columns(self) -> None:
        """A store written before studies had owners: its jobs belong to the default team;
        before they had storage names: each job's is read as :func:`_legacy_study_name`."""
        columns = {c["name"] for c in sa.inspect(self.engine).get_columns(_jobs.name)}
        added = {
            "owner": f"VARCHAR(64) NOT NULL DEFAULT '{DEFAULT_TEAM}'",
            "study_name": "VARCHAR(200)",
        }
        for name, kind in added.items():
            if name not in columns:
                with self.engine.begin() as conn:
                    conn.execute(sa.text(f"ALTER TABLE {_jobs.name} ADD COLUMN {name} {kind}"))

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
            study_name=m["study_name"] or _legacy_study_name(m),
        )

    def add(self, rec: JobRecord) -> JobRecord:
        """Insert a new job; returns it with its submission order (and its storage name)."""
        study_name = rec.study_name or study_name_for(rec.owner, rec.id)
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
                    study_name=study_name,
                )
            )
            pk = result.inserted_primary_key
            assert pk is not None
            seq = int(pk[0])
        return replace(rec, seq=seq, study_name=study_name)

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

    def queued(self) -> list[QueuedJob]:
        """The queued jobs in submission order, only the columns a scheduler's pass reads: a
        job's document (tens of KiB for a large search space) is not read, nor parsed, for
        each queued job on every pass (:meth:`get` reads it when the job starts)."""
        q = (
            sa.select(_jobs.c.id, _jobs.c.not_before, _jobs.c.until, _jobs.c.cancel_requested)
            .where(_jobs.c.state == "queued")
            .order_by(_jobs.c.seq)
        )
        with self.engine.connect() as conn:
            return [
                QueuedJob(job_id, not_before, until, bool(cancel))
                for job_id, not_before, until, cancel in conn.execute(q)
            ]

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
