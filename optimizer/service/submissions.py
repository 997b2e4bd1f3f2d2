"""A submission: a job file inside an optional envelope (time window, uploaded trace), parsed
from JSON, YAML or multipart bodies without trusting any of it.

An uploaded trace keeps a short, safe version of its file name (:func:`safe_filename`) and is
copied in chunks, refused past the upload limit (:func:`save_upload`). How many submissions
are checked at once is bounded, per team and in all (:class:`CheckSlots`)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optimizer.errors import ConfigError, SubmissionRefused
from optimizer.service import security
from optimizer.text import escape_controls

__all__ = [
    "CHECK_RETRY_AFTER_S",
    "MAX_FILENAME",
    "CheckSlots",
    "Submission",
    "TraceUpload",
    "parse_body",
    "parse_submission",
    "safe_filename",
    "save_upload",
]

log = logging.getLogger(__name__)


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
                # a key is the submitter's text: one line, bounded, never raw
                path = ".".join(escape_controls(str(p)[:80]) for p in err["loc"]) or "(top level)"
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


#: Longest file name an upload is stored under (file systems allow 255 bytes).
MAX_FILENAME = 100


def safe_filename(name: str) -> str:
    """An uploaded file's name as the service stores it: its last path part, only ASCII
    letters, digits, ``.``, ``_`` and ``-``, not hidden, at most :data:`MAX_FILENAME`
    characters with its suffixes kept (``.csv``, ``.jsonl.gz``: the format is read from
    them)."""
    base = Path(name.replace("\\", "/")).name
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".") or "trace"
    if len(clean) <= MAX_FILENAME:
        return clean
    suffix = "".join(Path(clean).suffixes[-2:])
    if len(suffix) > 20:
        suffix = Path(clean).suffix if len(Path(clean).suffix) <= 20 else ""
    return clean[: MAX_FILENAME - len(suffix)] + suffix


def save_upload(source: bytes | IO[bytes], path: Path, limit: int) -> int:
    """Copy an uploaded trace (bytes, or a binary file read in 1 MiB chunks) to ``path``;
    its size.

    Raises:
        SubmissionRefused: (413) More than ``limit`` bytes (the partial file is left for the
            caller to remove with its folder).
    """
    chunks = [source] if isinstance(source, bytes) else iter(lambda: source.read(1024**2), b"")
    size = 0
    with path.open("wb") as out:
        for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise SubmissionRefused(
                    f"the trace is more than {limit} bytes, the service's upload limit",
                    status=413,
                )
            out.write(chunk)
    return size


#: The Retry-After of a submission refused because too many are being checked: a plan check
#: of a trace at the row limit takes a few seconds.
CHECK_RETRY_AFTER_S = 5


class CheckSlots:
    """Submissions being checked at once: at most ``per_team`` of one team and ``total`` of
    all teams. A submission's check (its upload copied, its trace's rows counted, its plan
    built: the trace read and shaped) costs seconds of CPU and tens of MiB at the row limit,
    so a team sending many at once would hold the replica's CPU and memory; one over either
    bound is refused at once (429 with a Retry-After) rather than queued.

    Args:
        total: Checks at once, all teams together (at least 1).
        per_team: Checks of one team at once (at least 1).
        retry_after_s: The Retry-After of a refusal.
    """

    def __init__(self, total: int, per_team: int, retry_after_s: int = CHECK_RETRY_AFTER_S) -> None:
        self.total = max(1, total)
        self.per_team = max(1, per_team)
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._teams: dict[str, int] = {}

    def running(self, team: str | None = None) -> int:
        """Checks running now: ``team``'s, or all teams' (None)."""
        with self._lock:
            return self._teams.get(team, 0) if team is not None else sum(self._teams.values())

    @contextmanager
    def hold(self, team: str) -> Iterator[None]:
        """One check of ``team``, for the ``with`` block.

        Raises:
            SubmissionRefused: (429) ``team`` already has :attr:`per_team` checks running, or
                all teams together :attr:`total`.
        """
        with self._lock:
            mine, everyone = self._teams.get(team, 0), sum(self._teams.values())
            if mine >= self.per_team or everyone >= self.total:
                whose = (
                    f"team {team} already has {mine} submissions"
                    if mine >= self.per_team
                    else f"the service already has {everyone} submissions"
                )
                raise SubmissionRefused(
                    f"{whose} being checked (at most {self.per_team} of a team and "
                    f"{self.total} in all at once): submit again in {self.retry_after_s} s",
                    status=429,
                    retry_after_s=self.retry_after_s,
                )
            self._teams[team] = mine + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._teams[team] - 1
                if left:
                    self._teams[team] = left
                else:
                    del self._teams[team]
