"""The scheduler: first in, first out, a configurable number of studies at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from optimizer.service.store import ACTIVE_STATES, FINAL_STATES, JobRecord, JobStore
from optimizer.service.study_host import DriverLauncher

__all__ = ["Scheduler"]

log = logging.getLogger(__name__)


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
        # queued jobs: their scheduling columns only, each job's document read as it starts
        # (parsing every queued job on every pass slowed the replica's answers: issue 42)
        for q in self.store.queued():
            if q.cancel_requested:
                self.store.finish(q.id, "cancelled", "cancelled before it started", now)
                continue
            if q.until is not None and now >= q.until:
                self.store.finish(q.id, "expired", "its time window closed while queued", now)
                continue
            if running >= self.max_concurrent:
                continue
            if q.not_before is not None and now < q.not_before:
                continue
            if self.store.update(
                q.id,
                expect=("queued",),
                state="running",
                started_at=now,
                driver_starts=1,
                message="",
            ):
                self.launcher.start(self.store.get(q.id))
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
