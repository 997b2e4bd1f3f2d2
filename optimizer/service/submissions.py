"""A submission: a job file inside an optional envelope (time window, uploaded trace), parsed
from JSON, YAML or multipart bodies without trusting any of it."""

from __future__ import annotations

import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optimizer.errors import ConfigError
from optimizer.service import security

__all__ = ["Submission", "TraceUpload", "parse_body", "parse_submission", "safe_filename"]

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
                path = ".".join(str(p) for p in err["loc"]) or "(top level)"
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


def safe_filename(name: str) -> str:
    base = Path(name.replace("\\", "/")).name
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip(".")
    return clean or "trace"
