"""A trial's files: per-request records (gzip-compressed JSON lines, one record a line) and
the progress file a running trial writes for its driver (:class:`TrialProgress`)."""

from __future__ import annotations

import gzip
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from optimizer.types import RequestRecord

if TYPE_CHECKING:
    from optimizer.workload.replay import ReplayProgress


class _Step(Protocol):
    """A finished capacity step as the progress record reads it (a capacity search's
    ``StepOutcome``; named here so that this record imports nothing of the capacity room)."""

    @property
    def scale(self) -> float: ...
    @property
    def reason(self) -> str: ...


__all__ = [
    "PROGRESS_FILE",
    "TrialProgress",
    "progress_line",
    "read_progress",
    "read_records",
    "write_records",
]


def write_records(records: tuple[RequestRecord, ...] | list[RequestRecord], path: Path) -> None:
    """Per-request records as gzip-compressed JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for r in records:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    """Read records written by :func:`write_records`."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            d = json.loads(line)
            d["chunk_times_s"] = tuple(d["chunk_times_s"])
            out.append(RequestRecord(**d))
    return out


# --- progress of a running trial ------------------------------------------------------------------

#: The progress file in a trial's folder (:class:`TrialProgress`, :func:`read_progress`).
PROGRESS_FILE = "progress.json"


class TrialProgress:
    """A running trial's progress in ``<workdir>/progress.json``, for its driver to poll.

    A trial runs in a Ray actor (or a driver thread) and its replay client in a process of its
    own, so the driver cannot be called back: each of them writes this small file instead, and
    the driver reads it every few seconds (:func:`read_progress`). A phase change is written at
    once; replay progress (the replay's own progress callback, a few times a second, never per
    request) at most every ``interval_s``; every write replaces the file atomically. Picklable
    without ``forward``: the isolated client process gets a copy that writes the same file.
    Never raises: progress is a display aid.

    Args:
        workdir: The trial's (attempt's) folder.
        interval_s: Least seconds between two replay-progress writes.
        forward: Also called with every replay progress (a caller's own display).
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        interval_s: float = 2.0,
        forward: Callable[[ReplayProgress], None] | None = None,
    ) -> None:
        self.path = Path(workdir) / PROGRESS_FILE
        self.interval_s = interval_s
        self.forward = forward
        self.doc: dict[str, Any] = {}
        self._last = -math.inf

    def phase(self, phase: str, **fields: Any) -> None:
        """A new phase (``starting server``, ``replaying``, ``capacity search``, ``stopping``)."""
        self.doc = {"phase": phase, **fields}
        self._write(force=True)

    def __call__(self, p: ReplayProgress) -> None:
        """The replay's progress callback."""
        if self.forward is not None:
            self.forward(p)
        self.doc.update(
            sent=p.sent,
            completed=p.completed,
            failed=p.failed,
            total=p.total,
            elapsed_s=round(p.elapsed_s, 1),
            p95_ttft_ms=None if p.p95_ttft_ms is None else round(p.p95_ttft_ms, 1),
        )
        self._write(force=p.sent == p.total and p.in_flight == 0)

    def step_started(self, scale: float, note: str = "") -> None:
        """A capacity step at rate ``scale`` starts (``note``: e.g. ``pre-roll of 120 requests
        first``): the replay counts shown from now on are this step's."""
        kept: dict[str, Any] = {
            k: self.doc[k] for k in ("steps_done", "last_scale", "last_verdict") if k in self.doc
        }
        self.doc = {"phase": "capacity search", **kept, "scale": scale, "note": note}
        self._write(force=True)

    def step(self, outcome: _Step) -> None:
        """A capacity step finished (the capacity search's ``on_step``)."""
        self.doc = {
            "phase": "capacity search",
            "steps_done": int(self.doc.get("steps_done", 0)) + 1,
            "last_scale": outcome.scale,
            "last_verdict": outcome.reason or "SLOs met",
        }
        self._write(force=True)

    def _write(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        tmp = self.path.with_name(f".{PROGRESS_FILE}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps({**self.doc, "updated": time.time()}))
            os.replace(tmp, self.path)
        except OSError:
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["forward"] = None  # a caller's display stays in the caller's process
        return state


def read_progress(workdir: str | Path) -> dict[str, Any] | None:
    """The progress a running trial last wrote (None: none, or not readable yet)."""
    try:
        doc = json.loads((Path(workdir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def progress_line(doc: Mapping[str, Any]) -> str:
    """One line of a trial's progress: ``replaying 120/361 done, p95 TTFT so far 840 ms``;
    during a capacity search the step being replayed (its scale) and, apart, the previous
    step's verdict: ``capacity search: replaying x2: 40/361 done | 2 steps done, previous
    x1.4: SLOs met``."""
    head = str(doc.get("phase") or "running")
    replay = ""
    if doc.get("total"):
        replay = f"{doc.get('completed', 0)}/{doc['total']} done"
        if doc.get("failed"):
            replay += f" ({doc['failed']} failed)"
        if doc.get("p95_ttft_ms") is not None:
            replay += f", p95 TTFT so far {float(doc['p95_ttft_ms']):,.0f} ms"
    parts = []
    if "scale" in doc:
        now = f"replaying x{float(doc['scale']):.3g}"
        if doc.get("note"):
            now += f" ({doc['note']})"
        parts.append(f"{now}: {replay}" if replay else now)
    elif replay:
        parts.append(f"replaying {replay}")
    if "steps_done" in doc:
        done = int(doc["steps_done"])
        parts.append(
            f"{done} step{'s' if done != 1 else ''} done, previous "
            f"x{float(doc['last_scale']):.3g}: {doc.get('last_verdict', '')}"
        )
    if head == "replaying" and parts:
        return " | ".join(parts)
    return f"{head}: {' | '.join(parts)}" if parts else head
