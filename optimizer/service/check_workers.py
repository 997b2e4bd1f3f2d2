"""Submissions checked in worker processes, so the API's replica only moves bytes.

Checking a submission costs CPU in proportion to what it carries: a search space of 10,000
choices is parsed and loaded, a trace at the row limit is counted, read and shaped by the plan
check (seconds, and tens of MiB). Run in the Serve replica's threads, that work held the GIL
beside the replica's event loop, and ``/healthz`` waited for it (issue 42, case 5: p95 232 ms
while four such spaces were checked, 897 ms while eight uploads at the row limit were).
:class:`CheckWorkers` runs the whole of it (:meth:`Admission.admit_body
<optimizer.service.admission.Admission.admit_body>`: the body parsed, the job's limits and
text, the upload stored, the job loaded, its roots, space and trace size, the plan check) in
a few processes of its own, started with the replica (``spawn``: a clean interpreter, never a
fork of the replica's threads) at the lowest CPU priority (:data:`CHECK_NICENESS`: the API,
Serve's proxy and the trials come first). The replica keeps what needs its state: the check
slots (:class:`~optimizer.service.submissions.CheckSlots`), the job store and the scheduler.

A worker answers with the :class:`~optimizer.service.admission.Admitted` record, or with the
refusal (its status, message and Retry-After as the replica would have said them). A worker
that dies (killed for its memory) is replaced, and the submission is answered 503 with a
Retry-After; workers end with the replica (each watches its parent).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from optimizer.config import JobConfig
from optimizer.errors import ConfigError, SubmissionRefused
from optimizer.service.admission import Admission, Admitted
from optimizer.service.settings import ServiceSettings
from optimizer.service.submissions import CHECK_RETRY_AFTER_S, Body

__all__ = ["CHECK_NICENESS", "CheckWorkers", "check_processes"]

log = logging.getLogger(__name__)

#: The niceness of the check processes: the lowest priority, so the API's replica, Serve's
#: proxy and the trials (nice 0) take the CPU first, and a check gets what they leave.
CHECK_NICENESS = 19

#: Seconds between a worker's looks at whether its parent (the replica) is still there.
_PARENT_EVERY_S = 1.0


def check_processes(settings: ServiceSettings) -> int:
    """How many check processes the replica starts: one per check slot of all teams, at most
    one per CPU this process may run on (more would only wait for each other)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(settings.max_plan_checks, cpus))


@dataclass(frozen=True)
class _Outcome:
    """What a worker sends back: the admitted record, or the refusal's words."""

    admitted: Admitted | None = None
    message: str = ""
    status: int | None = None  # None: a ConfigError (422); else a SubmissionRefused's status
    retry_after_s: int | None = None

    def result(self) -> Admitted:
        if self.admitted is not None:
            return self.admitted
        if self.status is None:
            raise ConfigError(self.message)
        raise SubmissionRefused(self.message, status=self.status, retry_after_s=self.retry_after_s)


_ADMISSION: Admission | None = None


def _start_worker(
    parent: int, settings: ServiceSettings, check_plan: Callable[[JobConfig, Path], None]
) -> None:
    """A worker's start: its priority lowered, a watch on its parent, the checks ready (their
    imports made now, not in the first submission's time)."""
    global _ADMISSION
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(CHECK_NICENESS, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:  # never fatal: the checks still run, at the replica's priority
        log.warning("check process %d: its priority was not lowered", os.getpid())
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _ADMISSION = Admission(settings, check_plan)
    import optimizer.study  # noqa: F401  (the plan check's imports)


def _watch_parent(parent: int) -> None:
    """End this worker once its parent is gone (a killed replica leaves no worker behind)."""
    while os.getppid() == parent:
        time.sleep(_PARENT_EVERY_S)
    os._exit(0)


def _ready() -> int:
    return os.getpid()


def _admit(job_id: str, team: str, body: Body) -> _Outcome:
    """In a worker: every check of a submission (its answer, should it be refused)."""
    assert _ADMISSION is not None, "the worker was not started by CheckWorkers"
    try:
        return _Outcome(admitted=_ADMISSION.admit_body(job_id, team, body))
    except SubmissionRefused as exc:
        return _Outcome(message=str(exc), status=exc.status, retry_after_s=exc.retry_after_s)
    except ConfigError as exc:
        return _Outcome(message=str(exc))


class CheckWorkers:
    """A pool of check processes (see the module).

    Args:
        settings: The service's settings (each worker builds its checks from them).
        check_plan: The plan check (picklable: a module's function, or a partial of one).
        processes: Workers, all started now.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        check_plan: Callable[[JobConfig, Path], None],
        processes: int,
    ) -> None:
        self._args = (os.getpid(), settings, check_plan)
        self.processes = max(1, processes)
        self._lock = threading.Lock()
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(
            max_workers=self.processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=self._args,
        )
        for _ in range(self.processes):  # each submit while none is idle starts one
            pool.submit(_ready)
        return pool

    def admit(self, job_id: str, team: str, body: Body) -> Admitted:
        """Every check of ``body`` (a submission of ``team`` that will be job ``job_id``) in a
        worker; blocks until it is done.

        Raises:
            ConfigError: An invalid job (422).
            SubmissionRefused: The refusal the checks made; (503) the worker died.
        """
        with self._lock:
            pool = self._pool
        try:
            outcome: _Outcome = pool.submit(_admit, job_id, team, body).result()
        except BrokenProcessPool:
            self._replace(pool)
            raise SubmissionRefused(
                "the service's check process ended before the submission was checked: submit "
                f"again in {CHECK_RETRY_AFTER_S} s",
                status=503,
                retry_after_s=CHECK_RETRY_AFTER_S,
            ) from None
        return outcome.result()

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                log.warning("a check process died; starting new ones")
                broken.shutdown(wait=False, cancel_futures=True)
                self._pool = self._start()

    def close(self) -> None:
        """Stop the workers (those checking finish first)."""
        with self._lock:
            self._pool.shutdown(wait=False, cancel_futures=True)
