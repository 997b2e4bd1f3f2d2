"""The live tracker: a running study logged to MLflow from a background thread, so a slow or
unreachable tracking server never delays a trial.

:class:`Tracker` receives the driver's :class:`~optimizer.study_driver.StudyEvent` objects and hands
them to its thread, which reads the finished trials from the study's own storage, writes them
to MLflow through :class:`~optimizer.tracking.sync.Syncer` with bounded exponential backoff, and
re-tags every child run whenever the Pareto front changes. :func:`tracker_for_plan` makes one
for a prepared study.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import optuna

from optimizer.analysis.front import front_numbers
from optimizer.study import StudyPlan
from optimizer.study_driver import StudyEvent
from optimizer.tracking.sync import Syncer
from optimizer.tracking.target import (
    TrackingTarget,
    bound_http_retries,
    redact,
    relative,
    target_from_plan,
    write_review_inputs,
)

__all__ = ["Tracker", "tracker_for_plan"]

_log = logging.getLogger(__name__)

_STOP = object()


class Tracker:
    """Logs a running study to MLflow from a background thread.

    :meth:`on_event` only puts the event on a queue, so the driver never waits for MLflow. The
    thread coalesces pending work (trials to log, front to refresh), retries failures with
    exponential backoff up to ``max_backoff_s`` between attempts, and keeps what it could not
    log; :meth:`close` waits a bounded time, after which ``vllm-autotune mlflow-sync`` logs the
    rest from the Optuna storage.

    Args:
        target: Study and MLflow experiment.
        base_backoff_s: First wait after a failure.
        max_backoff_s: Longest wait between attempts.
        close_timeout_s: How long :meth:`close` waits for the queue to drain.
        give_up_after: Consecutive failures after which :meth:`close` stops waiting.
    """

    def __init__(
        self,
        target: TrackingTarget,
        *,
        base_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        close_timeout_s: float = 60.0,
        give_up_after: int = 3,
    ) -> None:
        bound_http_retries()
        self.target = target
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.close_timeout_s = close_timeout_s
        self.give_up_after = give_up_after
        self.failures = 0
        self.last_error = ""
        self._queue: queue.Queue[Any] = queue.Queue()
        self._abandon = threading.Event()
        self._closed = False
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._syncer: Syncer | None = None
        self._thread = threading.Thread(target=self._run, name="mlflow-tracker", daemon=True)
        self._thread.start()
        self._queue.put(("inputs", None))

    @property
    def experiment_id(self) -> str | None:
        """The MLflow experiment, once the thread has reached MLflow."""
        syncer = self._syncer
        return syncer.experiment_id if syncer is not None else None

    @property
    def pending(self) -> set[int]:
        """Trial numbers not (yet) logged."""
        with self._lock:
            return set(self._pending)

    def on_event(self, event: StudyEvent) -> None:
        """Queue a driver event; never blocks, never raises."""
        if event.kind in ("finished", "rejected", "stale"):
            self._queue.put(("trial", event.number))

    def finish(self, study: optuna.Study | None = None) -> bool:
        """Queue the final refresh (parent marked finished), then :meth:`close`.

        Returns:
            True when everything was logged.
        """
        if not self._closed:
            self._queue.put(("finish", None))
        return self.close()

    def close(self, timeout_s: float | None = None) -> bool:
        """Drain the queue for at most ``timeout_s`` (default ``close_timeout_s``); idempotent.

        Returns early when MLflow failed ``give_up_after`` times in a row. Whatever is left is
        named in a warning with the command that logs it later.

        Returns:
            True when everything was logged.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        deadline = time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s)
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self.failures >= self.give_up_after:
                break
            self._thread.join(0.1)
        left = self.pending
        ok = not self._thread.is_alive() and not left and self.failures == 0
        if self._thread.is_alive():
            self._abandon.set()
            self._thread.join(1.0)
        if not ok:
            _log.warning(
                "MLflow: %s not fully logged (%s); the Optuna storage has everything: run "
                "`vllm-autotune mlflow-sync %s`",
                f"trials {sorted(left)}" if left else "the study",
                self.last_error or "timed out",
                relative(self.target.out),
            )
        return ok

    def _run(self) -> None:
        inputs = finish = front = stopping = False
        while not self._abandon.is_set():
            busy = bool(inputs or finish or front or self._pending)
            items: list[Any] = []
            try:
                items.append(self._queue.get(timeout=0.05 if busy else 0.5))
                while True:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            for it in items:
                if it is _STOP:
                    stopping = True
                elif it[0] == "trial":
                    with self._lock:
                        self._pending.add(int(it[1]))
                    front = True
                elif it[0] == "finish":
                    finish = front = True
                elif it[0] == "inputs":
                    inputs = True
            if not (inputs or finish or front or self._pending):
                if stopping:
                    return
                continue
            try:
                syncer = self._syncer or Syncer(self.target)
                self._syncer = syncer
                syncer.connect()
                if inputs:
                    syncer.sync_parent_inputs()
                    inputs = False
                if self._pending:
                    study = syncer.study()
                    trials = study.get_trials(deepcopy=False)
                    current = front_numbers(study)
                    for number in sorted(self.pending):
                        if number < len(trials):
                            syncer.sync_trial(trials[number], current)
                        with self._lock:
                            self._pending.discard(number)
                if front or finish:
                    syncer.sync_front(finished=finish)
                    front = finish = False
                self.failures = 0
                self.last_error = ""
            except Exception as exc:
                # Start over from the tags next time: a call that failed may still have
                # created a run, and a fresh search finds it instead of creating another.
                self._syncer = None
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                if self.failures == 1 or self.failures % 10 == 0:
                    _log.warning(
                        "MLflow at %s: %s (attempt %d; trials keep running, retrying)",
                        redact(self.target.tracking_uri),
                        self.last_error,
                        self.failures,
                    )
                delay = min(self.base_backoff_s * 2 ** (self.failures - 1), self.max_backoff_s)
                self._abandon.wait(delay)


def tracker_for_plan(
    plan: StudyPlan, *, enabled: bool = True, team: str | None = None, **options: Any
) -> Tracker | None:
    """A :class:`Tracker` for a prepared study, or None when MLflow is off for it.

    Writes the review inputs (job, search space, trace statistics, MLflow target) to
    ``<out>/review`` so ``mlflow-sync`` can rebuild the same view later. Contacts nothing.
    Runs are keyed by the study's name in its storage (:attr:`StudyPlan.storage_name`).

    Args:
        plan: The prepared plan.
        enabled: False turns tracking off (``--no-mlflow``).
        team: The service's team whose study it is: its experiment is ``TEAM/NAME``
            (:func:`~optimizer.tracking.target.experiment_name`). None: the experiment as
            the job names it (``tune``).
        **options: Passed to :class:`Tracker` (backoff and close timeouts).
    """
    if not enabled or not plan.job.mlflow.enabled:
        return None
    target = target_from_plan(plan, team)
    write_review_inputs(plan, target)
    return Tracker(target, **options)
