"""A submission: a job file inside an optional envelope (time window, uploaded trace), parsed
from JSON, YAML or multipart bodies without trusting any of it.

The API hands a body over as it arrived (:class:`Body`: a JSON or YAML body's bytes, or the
file a multipart body was written to), and :func:`read_body` parses it where the submission is
checked (a worker process in the service: :mod:`optimizer.service.check_workers`). An uploaded
trace keeps a short, safe version of its file name (:func:`safe_filename`) and is copied in
chunks, refused past the upload limit (:func:`save_upload`). How many submissions are checked
at once is bounded, per team and in all (:class:`CheckSlots`)."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from optimizer.errors import ConfigError, SubmissionRefused
from optimizer.service import security
from optimizer.text import escape_controls

__all__ = [
    "CHECK_RETRY_AFTER_S",
    "MAX_FILENAME",
    "Body",
    "CheckSlots",
    "Submission",
    "TraceUpload",
    "Upload",
    "parse_body",
    "parse_submission",
    "read_body",
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


#: A trace sent with a submission: its file name and its bytes, or a binary file to copy
#: them from (a multipart part already spooled to disk).
Upload = tuple[str, bytes | IO[bytes]]


@dataclass(frozen=True)
class Body:
    """A submission's body as the API received it, none of it parsed (picklable: it travels to
    the process that checks it).

    Attributes:
        content_type: The request's Content-Type.
        data: A JSON or YAML body (at most
            :data:`~optimizer.service.security.MAX_BODY_BYTES`).
        path: Where a multipart body was written, byte for byte (None: ``data`` is the body).
    """

    content_type: str
    data: bytes = b""
    path: str | None = None


def parse_body(body: bytes, content_type: str = "") -> Any:
    """A JSON or YAML request body -> its document, within the service's limits (no YAML
    aliases, bounded depth and sizes: :func:`optimizer.service.security.parse_document`).

    Raises:
        ConfigError: Not parseable, or over a limit (the message quotes none of the body).
    """
    return security.parse_document(
        body, json_body="json" in content_type, exempt=[("trace_upload", "content_b64")]
    )


@contextmanager
def read_body(body: Body, job_limit: int) -> Iterator[tuple[Submission, Upload | None]]:
    """The submission of ``body`` and its uploaded trace (a multipart ``trace`` part: a file
    spooled to disk, closed on exit). A multipart body is parsed as Starlette parses a form
    (at most 2 files and 8 fields; a part in memory, such as ``job``, at most ``job_limit``
    bytes), read from its file in chunks.

    Raises:
        ConfigError: Not a submission, or no ``job`` part.
        SubmissionRefused: (400) A malformed multipart body or one over the form's bounds;
            (413) a ``job`` part over ``job_limit``.
    """
    if body.path is None:
        yield parse_submission(parse_body(body.data, body.content_type)), None
        return
    form = asyncio.run(_read_form(Path(body.path), body.content_type, job_limit))
    try:
        yield _form_submission(form, job_limit)
    finally:
        for _key, value in form.multi_items():
            if isinstance(value, UploadFile):
                value.file.close()


#: Bytes of a spooled multipart body read at a time.
_FORM_CHUNK = 64 * 1024


async def _read_form(path: Path, content_type: str, job_limit: int) -> FormData:
    """The form of a multipart body written to ``path``, parsed by Starlette's own parser."""
    scope = {
        "type": "http",
        "method": "POST",
        "headers": [(b"content-type", content_type.encode("latin-1", "replace"))],
    }
    with path.open("rb") as source:

        async def receive() -> dict[str, Any]:
            chunk = source.read(_FORM_CHUNK)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunk)}

        try:
            return await Request(scope, receive).form(
                max_files=2, max_fields=8, max_part_size=job_limit
            )
        except MultiPartException as exc:  # the app's answer to it: 400 with its message
            raise SubmissionRefused(exc.message, status=400) from None


def _form_submission(form: FormData, job_limit: int) -> tuple[Submission, Upload | None]:
    """The submission of a multipart form: its `job` part (at most ``job_limit`` bytes),
    time window and `trace` file."""
    part = form.get("job")
    if part is None:
        raise ConfigError("multipart submission: the `job` part is missing")
    if isinstance(part, UploadFile):
        raw, part_type = part.file.read(job_limit + 1), part.content_type or ""
        if len(raw) > job_limit:
            raise SubmissionRefused(
                f"the multipart `job` part is limited to {job_limit} bytes", status=413
            )
    else:
        raw, part_type = part.encode(), ""
    sub = parse_submission(parse_body(raw, part_type))
    window: dict[str, Any] = {}
    for key in ("not_before", "until"):
        value = form.get(key)
        if isinstance(value, str) and value:
            try:
                window[key] = datetime.fromisoformat(value)
            except ValueError:
                raise ConfigError(f"{key}: not an ISO 8601 time ({value[:40]!r})") from None
    if window:
        sub = sub.model_copy(update=window)
    trace = form.get("trace")
    upload = (trace.filename or "trace", trace.file) if isinstance(trace, UploadFile) else None
    return sub, upload


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

    def refusal(self, team: str) -> SubmissionRefused | None:
        """The 429 a submission of ``team`` would get now, or None while a slot is free (the
        API asks before it reads a body: :class:`~optimizer.service.bodies.BodyGuard`)."""
        with self._lock:
            return self._refusal(team)

    def _refusal(self, team: str) -> SubmissionRefused | None:
        mine, everyone = self._teams.get(team, 0), sum(self._teams.values())
        if mine < self.per_team and everyone < self.total:
            return None
        whose = (
            f"team {team} already has {mine} submissions"
            if mine >= self.per_team
            else f"the service already has {everyone} submissions"
        )
        return SubmissionRefused(
            f"{whose} being checked (at most {self.per_team} of a team and "
            f"{self.total} in all at once): submit again in {self.retry_after_s} s",
            status=429,
            retry_after_s=self.retry_after_s,
        )

    @contextmanager
    def hold(self, team: str) -> Iterator[None]:
        """One check of ``team``, for the ``with`` block.

        Raises:
            SubmissionRefused: (429) ``team`` already has :attr:`per_team` checks running, or
                all teams together :attr:`total`.
        """
        with self._lock:
            refusal = self._refusal(team)
            if refusal is not None:
                raise refusal
            self._teams[team] = self._teams.get(team, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._teams[team] - 1
                if left:
                    self._teams[team] = left
                else:
                    del self._teams[team]
