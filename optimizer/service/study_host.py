"""Where a job's study driver runs: :class:`StudyHost` prepares the plan and runs a
:class:`~optimizer.study_driver.StudyDriver` in a thread; :class:`RayDriverLauncher` hosts each
one in a detached, named Ray actor (through :mod:`optimizer.runners`, the one module that imports
Ray), so a restarted API finds its drivers by name; a trial lost with the cluster is not a result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa

from optimizer.config import load_job
from optimizer.errors import AutotuneError, ConfigError
from optimizer.service import security
from optimizer.service.auth import DEFAULT_TEAM
from optimizer.service.store import OWNER_ATTR, JobRecord, belongs_to, owner_mark
from search_spaces.schema import load_space

__all__ = ["DriverLauncher", "DriverStatus", "RayDriverLauncher", "StudyHost"]

log = logging.getLogger(__name__)

_NAMESPACE = "vllm-autotune"


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
        study_name: The study's name in its storage (the job record's: team and job id;
            None: the job's name, as a driver started before studies were named by id).
        owner: The team whose job this is (the study is marked as this job's and team's).
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
        study_name: str | None = None,
        owner: str = DEFAULT_TEAM,
    ) -> None:
        self.job_id = job_id
        self._study_name = study_name
        self._owner = owner
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
        self._gate_runner: Any = None  # the runner while the quality gate runs (cancel stops it)
        self._cancel = cancel_requested
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"study-{job_id}", daemon=True)
        self._thread.start()

    def _on_event(self, ev: Any) -> None:
        text = f"trial {ev.number} {ev.kind}"
        if ev.kind == "progress":
            text += f": {ev.detail}"
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
            # keyed by the stored study (TEAM/ID), in the team's experiments (TEAM/NAME)
            return make(plan, team=self._owner) if make is not None else None
        except Exception as exc:  # MLflow is a review aid: its failure never stops a study
            self._message = f"MLflow off: {type(exc).__name__}: {exc}"
            return None

    def _run(self) -> None:
        from datetime import timedelta

        from optimizer.runners import ClusterLossGuard, RayRunner
        from optimizer.study import prepare
        from optimizer.study_driver import StudyDriver

        runner: Any = None
        try:
            # A job stored before the service's policy (queued, or resumed after an upgrade)
            # is held to it too: its flags would otherwise reach a server here.
            security.check_stored_study(self._job)
            job, base = load_job(self._job, base=Path(self._base))
            security.check_space(load_space(job.search_space))
            # named by team and job id in the storage, not by the job's name (issue 33)
            plan = dataclasses.replace(prepare(job, base), study_name=self._study_name or "")
            security.mark_service_study(plan.out, self.job_id)  # a job queued before markers
            capacity = 1 if plan.context.cpu_build else job.parallel
            runner = ClusterLossGuard(
                RayRunner(capacity=capacity, cpus_per_trial=self._cpus), lambda: self._cancel
            )
            tracker: Any = None  # made once the study is known to be this job's

            def on_event(ev: Any) -> None:
                self._on_event(ev)
                if tracker is not None:
                    with contextlib.suppress(Exception):
                        tracker.on_event(ev)

            def make() -> Any:
                _check_storage_name(plan, self.job_id, self._owner)
                made = StudyDriver(plan, runner, on_event=on_event)
                made.study.set_user_attr(OWNER_ATTR, owner_mark(self._owner, self.job_id))
                return made

            driver = _create_driver(make)
            tracker = self._tracker(plan)
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
            self._quality_stage(plan, study, runner)
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

    def _quality_stage(self, plan: Any, study: Any, runner: Any) -> None:
        """The job's ``quality.enabled``, as ``tune`` runs it: the gate on the feasible front's
        numeric-changing members before the study ends, each check in an actor pinned to the
        GPUs its servers need (the runner's ``call``), so that the export picks the best
        configuration that passes. None after a cancel. A gate that fails does not fail the
        study: the unchecked members stay unchecked, and the export header says so."""
        if not plan.job.quality.enabled:
            return
        from optimizer.quality_check import gate_plan

        def progress(line: str) -> None:
            self._last_event = line

        with self._lock:
            if self._cancel:
                return
            self._gate_runner = runner
        try:
            gate_plan(plan, study, progress=progress, runner=runner)
        except Exception as exc:
            self._message = f"quality gate not run to its end: {type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._gate_runner = None

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
            if self._gate_runner is not None:  # the check's actor, and its servers, end
                with contextlib.suppress(Exception):
                    self._gate_runner.close()

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


def _check_storage_name(plan: Any, job_id: str, team: str) -> None:
    """The study this driver will create or resume is this job's: absent from its storage,
    or marked as this job's (:data:`~optimizer.service.store.OWNER_ATTR`), or unmarked in the
    study folder's own file (a study written before the mark). Never another job's, another
    team's included, whatever a shared storage holds under the name.

    Raises:
        ConfigError: The storage holds a study of this name that is not this job's.
    """
    from optimizer.study import create_storage

    storage = create_storage(plan.storage_url)
    try:
        study_id = storage.get_study_id_from_name(plan.storage_name)
    except KeyError:
        return
    mark = storage.get_study_user_attrs(study_id).get(OWNER_ATTR)
    if belongs_to(mark, team=team, job_id=job_id, storage_url=plan.storage_url, out=str(plan.out)):
        return
    raise ConfigError(
        f"job {job_id}: the study storage already holds a study named "
        f"{plan.storage_name!r} that is not this job's; the service never writes into "
        "another job's study (ask the operator to check the study storage)"
    )


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


class RayDriverLauncher:
    """Each job's driver is a detached, named Ray actor on the current cluster.

    Detached, so a restart of the API replica (or of Serve) finds the driver by name and keeps
    it; when the cluster itself went away the scheduler starts a new driver, which resumes.

    Args:
        mlflow: Let drivers log to MLflow.
        cpus_per_trial: CPU resources of each trial actor.
    """

    def __init__(self, *, mlflow: bool = True, cpus_per_trial: float = 1.0) -> None:
        from optimizer.runners import DetachedActors

        self._mlflow = mlflow
        self._cpus = cpus_per_trial
        self._actors = DetachedActors(StudyHost, _NAMESPACE)

    @staticmethod
    def actor_name(job_id: str) -> str:
        """The driver actor's name."""
        return f"vllm-autotune-study-{job_id}"

    def start(self, rec: JobRecord) -> None:
        self._actors.start(
            self.actor_name(rec.id),
            rec.id,
            rec.job,
            rec.base,
            rec.until,
            self._mlflow,
            self._cpus,
            rec.cancel_requested,
            rec.study_name or None,
            rec.owner,
        )

    def poll(self, job_id: str) -> DriverStatus | None:
        try:
            doc = self._actors.call(self.actor_name(job_id), "status")
        except TimeoutError:
            return DriverStatus(state="running", message="the driver did not answer in time")
        except LookupError:
            return None
        return DriverStatus(**doc)

    def cancel(self, job_id: str) -> None:
        with contextlib.suppress(LookupError):
            self._actors.call(self.actor_name(job_id), "cancel")

    def request_stop(self, job_id: str) -> None:
        with contextlib.suppress(LookupError):
            self._actors.call(self.actor_name(job_id), "request_stop")

    def release(self, job_id: str) -> None:
        self._actors.kill(self.actor_name(job_id))

    def cluster_gpus(self) -> int:
        """GPUs of the cluster."""
        from optimizer.runners import cluster_gpus

        return cluster_gpus()
