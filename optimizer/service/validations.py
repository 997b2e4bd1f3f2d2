"""Re-validations of exports as jobs of their own, off the request path.

An export with ``validate=true`` re-measures the chosen configuration and the baseline on the
cluster: minutes of work. :class:`ValidationQueue` runs each in a thread of its own, never in
an API worker: a request queues one and answers at once with its id; the caller polls it and
downloads the export once it is done. One validation per team runs at a time (a team's next
one waits in its queue, at most :data:`MAX_QUEUED_PER_TEAM` of them: 429 above), and at most
``workers`` of all teams at once, so neither a team nor all of them together can hold the
service's threads. Validations live in the replica's memory: a restarted service has none
(ask again); the last :data:`KEEP_FINISHED` finished ones are kept for polling.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optimizer.errors import AutotuneError, NotFound, SubmissionRefused

__all__ = [
    "KEEP_FINISHED",
    "MAX_QUEUED_PER_TEAM",
    "Validation",
    "ValidationQueue",
]

log = logging.getLogger(__name__)

#: Validations of one team waiting behind its running one.
MAX_QUEUED_PER_TEAM = 4
#: Finished validations kept for polling (the oldest are forgotten first).
KEEP_FINISHED = 1000

#: States: ``queued`` and ``running`` are active; ``done`` (the export can be downloaded),
#: ``refused`` (re-validation refused the export, or the study could not be exported) and
#: ``failed`` (an error of the service) are final.
FINAL = ("done", "refused", "failed")


@dataclass
class Validation:
    """One re-validation of an export.

    Attributes:
        id: Its id.
        job_id: The study it exports.
        team: The team that asked (the study's owner, or an admin's team).
        request: The export's parameters (format, policy, trial, weights, runs, force).
        submitted_at: Epoch seconds.
        state: ``queued``, ``running``, ``done``, ``refused`` or ``failed``.
        started_at: Epoch seconds, once running.
        finished_at: Epoch seconds, once final.
        message: Why it was refused or failed.
        result: The export, once done.
    """

    id: str
    job_id: str
    team: str
    request: dict[str, Any]
    submitted_at: float
    state: str = "queued"
    started_at: float | None = None
    finished_at: float | None = None
    message: str = ""
    result: Any = None
    _seq: int = field(default=0, repr=False)


class ValidationQueue:
    """Validations queued per team and run in threads of their own.

    Args:
        run: Does one validation and returns its export (raises an AutotuneError to refuse
            it: its message is the answer).
        workers: Validations running at once, all teams together.
        max_queued_per_team: A team's validations waiting behind its running one.
        clock: Epoch seconds.
    """

    def __init__(
        self,
        run: Callable[[Validation], Any],
        *,
        workers: int = 2,
        max_queued_per_team: int = MAX_QUEUED_PER_TEAM,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._run = run
        self.workers = max(1, workers)
        self.max_queued_per_team = max_queued_per_team
        self.clock = clock
        self._lock = threading.Lock()
        self._items: dict[str, Validation] = {}
        self._seq = 0

    def submit(self, job_id: str, team: str, request: dict[str, Any]) -> Validation:
        """Queue a validation of ``job_id``'s export for ``team``; returns it at once.

        Raises:
            SubmissionRefused: (429) The team already has :attr:`max_queued_per_team`
                validations waiting.
        """
        with self._lock:
            waiting = [v for v in self._items.values() if v.team == team and v.state == "queued"]
            if len(waiting) >= self.max_queued_per_team:
                raise SubmissionRefused(
                    f"team {team} already has {len(waiting)} validations waiting (at most "
                    f"{self.max_queued_per_team}; one of a team runs at a time): poll them "
                    f"({', '.join(v.id for v in waiting)}) and ask again once one has ended",
                    status=429,
                )
            self._seq += 1
            item = Validation(
                id=uuid.uuid4().hex[:12],
                job_id=job_id,
                team=team,
                request=dict(request),
                submitted_at=self.clock(),
                _seq=self._seq,
            )
            self._items[item.id] = item
            self._forget_old()
            self._dispatch()
        return item

    def get(self, validation_id: str, job_id: str) -> Validation:
        """The validation ``validation_id`` of study ``job_id`` (a copy, safe to read).

        Raises:
            NotFound: No such validation of this study.
        """
        with self._lock:
            item = self._items.get(validation_id)
            if item is None or item.job_id != job_id:
                raise NotFound(f"study {job_id!r} has no validation {validation_id!r}")
            return Validation(**{k: getattr(item, k) for k in item.__dataclass_fields__})

    def _dispatch(self) -> None:
        """Start the oldest queued validation of each team with none running, while fewer than
        :attr:`workers` run (the lock is held)."""
        active = [v for v in self._items.values() if v.state == "running"]
        busy = {v.team for v in active}
        for item in sorted(self._items.values(), key=lambda v: v._seq):
            if len(active) >= self.workers:
                return
            if item.state != "queued" or item.team in busy:
                continue
            item.state, item.started_at = "running", self.clock()
            active.append(item)
            busy.add(item.team)
            threading.Thread(
                target=self._work, args=(item,), name=f"validation-{item.id}", daemon=True
            ).start()

    def _work(self, item: Validation) -> None:
        state, message, result = "done", "", None
        try:
            result = self._run(item)
        except AutotuneError as exc:
            state, message = "refused", str(exc)
        except Exception as exc:  # the service's error, not the caller's: logged, not quoted
            log.exception("validation %s of study %s failed", item.id, item.job_id)
            state, message = "failed", f"the validation failed ({type(exc).__name__}); see the logs"
        with self._lock:
            item.state, item.message, item.result = state, message, result
            item.finished_at = self.clock()
            self._dispatch()

    def _forget_old(self) -> None:
        """Keep at most :data:`KEEP_FINISHED` finished validations (the lock is held)."""
        finished = sorted(
            (v for v in self._items.values() if v.state in FINAL), key=lambda v: v._seq
        )
        for item in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._items[item.id]
