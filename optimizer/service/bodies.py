"""Slow request bodies: a deadline to receive each body and a bound on the bodies in flight.

The API runs in one Serve replica that takes :data:`~optimizer.service.settings.REPLICA_SLOTS`
requests at once; Serve's proxy queues the rest. A request whose body trickles in (headers,
then a byte every few seconds) held its slot as long as its client liked: 66 of them left
``/healthz`` and every read of every team waiting 30-42 s (issue 42). :class:`BodyGuard`, an
ASGI middleware of the app, bounds both what such a request may take and how many may wait:

- **time**: a body must arrive within ``body_timeout_s`` plus one second for every
  ``body_min_rate`` bytes received (Apache's ``RequestReadTimeout body=...,MinRate=...``);
  past it the request is answered 408 and its slot freed;
- **slots**: a request that declares a body and carries a valid token counts against its
  team (at most ``bodies_per_team``) and against all teams (``bodies_in_flight``, below the
  replica's slots) from its first byte to its last; beyond either it is answered 429 at once,
  before any of its body is read;
- **checks**: a submission (``POST /v1/studies``) while its team's check slots, or all
  teams', are full (:class:`~optimizer.service.submissions.CheckSlots`) is answered their 429
  at once too, before any of its body is read: a 7.6 MB upload was read in full, through
  Serve's proxy, only to be refused. The slot itself is taken once the body is in, so a body
  still arriving holds none (a slow one would otherwise keep a team's submissions out).

A request without a valid token is not counted: the app answers it 401 without reading its
body. Neither answer reads the rest of the body; the connection is closed. A client that
hangs up mid-body is let go quietly (no error logged for each one).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect

from optimizer.service.auth import TokenEntry, authenticate
from optimizer.service.submissions import CheckSlots

__all__ = ["SUBMIT_PATH", "BodyGuard", "BodyLimits", "BodyTimeout"]

#: The route whose bodies are submissions (checked in a check slot).
SUBMIT_PATH = "/v1/studies"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[Message], Any]


class BodyTimeout(Exception):
    """A request body did not arrive in time (408)."""

    def __init__(self, waited_s: float, received: int) -> None:
        super().__init__(waited_s, received)
        self.waited_s, self.received = waited_s, received


@dataclass(frozen=True)
class BodyLimits:
    """How long a body may take and how many may be in flight (see the module)."""

    timeout_s: float = 30.0
    min_rate: int = 16 * 1024
    per_team: int = 4
    in_flight: int = 32

    def deadline(self, start: float, received: int) -> float:
        """When a body begun at ``start`` with ``received`` bytes so far is late."""
        extra = received / self.min_rate if self.min_rate > 0 else 0.0
        return start + self.timeout_s + extra


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def _declares_body(scope: Scope) -> bool:
    """The request has a body to come (a non-zero Content-Length, or chunked)."""
    if _header(scope, b"transfer-encoding") is not None:
        return True
    length = _header(scope, b"content-length")
    return length is not None and length.strip() not in (b"", b"0")


def _is_submission(scope: Scope) -> bool:
    """A POST to :data:`SUBMIT_PATH` (below the app's root path, where it has one)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return scope.get("method") == "POST" and path == SUBMIT_PATH


def _bearer(scope: Scope) -> str | None:
    raw = _header(scope, b"authorization")
    if raw is None:
        return None
    scheme, _, token = raw.decode("latin-1").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def _answer(send: Send, status: int, detail: str, retry_after: int | None = None) -> None:
    """A JSON error that closes the connection (the rest of the body is never read)."""
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    """ASGI middleware bounding each request body's time and the bodies in flight.

    Args:
        app: The application.
        entries: The accepted tokens (a body counts against its token's team).
        limits: The bounds.
        checks: The service's check slots (a submission is refused before its body while
            its team's, or all teams', are full); None: not asked.
        clock: Monotonic seconds (tests).
    """

    def __init__(
        self,
        app: Any,
        *,
        entries: Sequence[TokenEntry],
        limits: BodyLimits,
        checks: CheckSlots | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self._entries = tuple(entries)
        self.limits = limits
        self._checks = checks
        self._clock = clock
        self.held: Counter[str] = Counter()  # bodies in flight, by team

    @property
    def in_flight(self) -> int:
        """Bodies being received now, of all teams."""
        return sum(self.held.values())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _declares_body(scope):
            await self.app(scope, receive, send)
            return
        who = authenticate(_bearer(scope), self._entries)
        team = who.team if who is not None else None
        if team is not None:
            refusal = self._refusal(team)
            if refusal is not None:
                await _answer(send, 429, refusal, retry_after=1)
                return
            full = self._checks.refusal(team) if self._checks and _is_submission(scope) else None
            if full is not None:
                await _answer(send, 429, str(full), retry_after=full.retry_after_s)
                return
            self.held[team] += 1
        await self._guarded(scope, receive, send, team)

    def _refusal(self, team: str) -> str | None:
        """Why a new body of ``team`` is refused now, or None."""
        limits = self.limits
        if self.held[team] >= limits.per_team:
            return (
                f"team {team!r} is already sending {self.held[team]} request bodies (at most "
                f"{limits.per_team} at once): retry once one is done"
            )
        if self.in_flight >= limits.in_flight:
            return (
                f"the service is receiving {self.in_flight} request bodies (at most "
                f"{limits.in_flight} at once): retry shortly"
            )
        return None

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, team: str | None) -> None:
        """Run the app with a receive that times the body out; free the team's slot once the
        body is in (or the request ends)."""
        start = self._clock()
        received = 0
        done = False
        started = False

        def release() -> None:
            nonlocal done
            if not done and team is not None:
                self.held[team] -= 1
                if self.held[team] <= 0:
                    del self.held[team]
            done = True

        async def timed_receive() -> Message:
            nonlocal received
            if done:  # the body is in: a wait for the disconnect is not timed
                return await receive()  # type: ignore[no-any-return]
            left = self.limits.deadline(start, received) - self._clock()
            try:
                if left <= 0:
                    raise TimeoutError
                message: Message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                raise BodyTimeout(self._clock() - start, received) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    release()
            else:  # http.disconnect
                release()
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, watched_send)
        except BodyTimeout as exc:
            if started:
                raise
            await _answer(send, 408, self.late(exc))
        except ClientDisconnect:
            if started:
                raise
            # gone mid-body: nobody to answer (and no traceback in the log for each one)
        finally:
            release()

    def late(self, exc: BodyTimeout) -> str:
        """The 408's words."""
        limits = self.limits
        rate = f" plus a second per {limits.min_rate} bytes" if limits.min_rate > 0 else ""
        return (
            f"the request body did not arrive in time ({exc.received} bytes in "
            f"{exc.waited_s:.1f} s; a body may take {limits.timeout_s:g} s{rate})"
        )
