"""The store's liveness, checked off the request path, so ``/healthz`` waits for nothing.

``/healthz`` reported the store's liveness by asking the database (``SELECT 1``) inside the
request: a sync route, so each probe also waited for a thread of the replica's pool, then for
the database. Under load both hops add to a probe's time (issue 42: its bar is ``/healthz``
under 100 ms throughout). :class:`StoreLiveness` asks the database in a thread of its own every
``every_s`` and keeps the answer; ``/healthz`` reads it without I/O. A check that fails, or
none that succeeded within ``stale_s`` (the database hangs), reads as the store down.

Where the thread is not running (tests, tools), :meth:`StoreLiveness.ok` asks the database
itself, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["StoreLiveness"]

log = logging.getLogger(__name__)


class StoreLiveness:
    """The last answer of ``check`` (a call that raises when the store is down).

    Args:
        check: Asks the store; raises if it does not answer.
        every_s: Seconds between checks while running.
        stale_s: A store whose last successful check is older than this reads as down (a
            check that hangs is caught by this).
        clock: Monotonic seconds (tests).
    """

    def __init__(
        self,
        check: Callable[[], None],
        *,
        every_s: float = 1.0,
        stale_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self.every_s = every_s
        self.stale_s = stale_s
        self._clock = clock
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_ok: float | None = None  # clock() of the last check that answered
        self.last_error = ""

    def check_now(self) -> bool:
        """Ask the store now; record and return whether it answered."""
        try:
            self._check()
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.last_ok = None
            return False
        self.last_error = ""
        self.last_ok = self._clock()
        return True

    @property
    def running(self) -> bool:
        """The checking thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def ok(self) -> bool:
        """Whether the store is up: the thread's last answer, fresh (no I/O); without the
        thread, a check now."""
        if not self.running:
            return self.check_now()
        last = self.last_ok
        return last is not None and self._clock() - last <= self.stale_s

    def age_s(self) -> float | None:
        """Seconds since the store last answered (None: it has not)."""
        last = self.last_ok
        return None if last is None else max(0.0, self._clock() - last)

    def start(self) -> None:
        """Check now, then every ``every_s`` in a daemon thread."""
        if self._thread is not None:
            return
        self.check_now()

        def loop() -> None:
            while not self._halt.wait(self.every_s):
                if not self.check_now():
                    log.warning("the store did not answer: %s", self.last_error)

        self._thread = threading.Thread(target=loop, name="autotune-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (a check in progress finishes on its own)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
