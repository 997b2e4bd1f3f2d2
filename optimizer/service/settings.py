"""The service's settings and the tokens that authenticate its callers."""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from optimizer.errors import ConfigError
from optimizer.service.auth import TokenEntry, hash_token

__all__ = [
    "DEFAULT_MAX_TRACE_ROWS",
    "REPLICA_SLOTS",
    "ServiceSettings",
    "load_tokens",
    "token_matches",
]

log = logging.getLogger(__name__)

#: Rows of a job's trace the service reads at most (``serve --max-trace-rows``): hours of
#: replay at the request rates one server takes, and about 50 MiB while a submission's plan
#: is checked.
DEFAULT_MAX_TRACE_ROWS = 200_000

#: Requests the API's Serve replica takes at once (its ``max_ongoing_requests``); Serve's proxy
#: queues the rest. Request bodies in flight are held below it (``bodies_in_flight``), so reads
#: and ``/healthz`` always find a slot.
REPLICA_SLOTS = 64


@dataclass(frozen=True)
class ServiceSettings:
    """How the service runs (picklable: it travels to the Serve replica).

    Attributes:
        database_url: The job store (SQLAlchemy URL; SQLite file or PostgreSQL).
        data_dir: Study folders (``studies/<id>``) and uploaded traces (``uploads/<id>``).
        trace_roots: Folders a job's trace (and search-space) files must lie under.
        token_sha256: SHA-256 hex digests of accepted bearer tokens of the ``default`` team.
        tokens: Accepted tokens with their team and role (digests, never the tokens).
        model_roots: Folders a job's local model must lie under (besides ``DATA_DIR/models``,
            where ``model.make`` creates models); a relative ``model.path`` is looked for
            under each of them.
        allow_hub_models: Serve a model name found under no model root as a hub repository
            id (``ORG/NAME``), downloaded by vLLM; off: such a job is refused (403).
        mlflow_uri: MLflow tracking URI of every job (None: a store in each study's folder).
        max_concurrent: Studies running at once (None: 1 on a cluster without GPUs, else the
            number of GPUs).
        max_upload_bytes: Largest request body accepted (413 above); an uploaded trace, once
            decompressed, too. A JSON or YAML body (and a multipart ``job`` part) is at most
            :data:`~optimizer.service.security.MAX_BODY_BYTES` besides.
        max_trace_rows: Most rows a job's trace may hold (uploaded or under a trace root),
            counted before it is parsed (422 above).
        max_plan_checks: Submissions checked at once, all teams together (each reads and
            shapes its trace: seconds and tens of MiB at the row limit); one more is refused
            with 429 and a Retry-After.
        max_plan_checks_per_team: Submissions of one team checked at once (429 above).
        study_storage: Optuna storage URL for jobs that set none (None: SQLite per study).
        poll_interval_s: Scheduler period.
        mlflow: Let jobs log to MLflow (each job's ``mlflow.enabled`` still decides).
        cpus_per_trial: CPU resources each trial actor asks Ray for.
        max_driver_starts: A job whose driver died this many times is failed.
        body_timeout_s: Seconds a request body may take to arrive, plus one second for every
            ``body_min_rate`` bytes of it received so far (408 past it; Apache's
            ``RequestReadTimeout body=30,MinRate=16384``).
        body_min_rate: Bytes a second a body must keep up, on average, after its first
            ``body_timeout_s`` seconds (0: ``body_timeout_s`` is the whole deadline).
        bodies_per_team: Request bodies one team's tokens may be sending at once (429 above).
        bodies_in_flight: Request bodies being received at once, of all teams (429 above);
            below :data:`REPLICA_SLOTS`, so slow bodies never hold every request slot.
    """

    database_url: str
    data_dir: str
    trace_roots: tuple[str, ...] = ()
    token_sha256: tuple[str, ...] = ()
    tokens: tuple[TokenEntry, ...] = ()
    model_roots: tuple[str, ...] = ()
    allow_hub_models: bool = False
    mlflow_uri: str | None = None
    max_concurrent: int | None = None
    max_upload_bytes: int = 32 * 1024**2
    max_trace_rows: int = DEFAULT_MAX_TRACE_ROWS
    max_plan_checks: int = 4
    max_plan_checks_per_team: int = 2
    study_storage: str | None = None
    poll_interval_s: float = 2.0
    mlflow: bool = True
    cpus_per_trial: float = 1.0
    max_driver_starts: int = 5
    body_timeout_s: float = 30.0
    body_min_rate: int = 16 * 1024
    bodies_per_team: int = 4
    bodies_in_flight: int = 32

    def token_entries(self) -> tuple[TokenEntry, ...]:
        """Every accepted token: :attr:`tokens`, then :attr:`token_sha256` (team default)."""
        return self.tokens + tuple(TokenEntry(digest=d) for d in self.token_sha256)


def load_tokens(token_file: str | Path | None = None, env_value: str | None = None) -> list[str]:
    """Tokens from a file (one per line, ``#`` comments) and/or a comma/space separated string.

    Raises:
        ConfigError: The file cannot be read.
    """
    tokens: list[str] = []
    if token_file:
        try:
            text = Path(token_file).read_text()
        except OSError as exc:
            raise ConfigError(f"{token_file}: cannot read the token file ({exc.strerror})") from exc
        tokens += [ln.strip() for ln in text.splitlines() if ln.strip() and ln[0] != "#"]
    if env_value:
        tokens += [t for t in re.split(r"[\s,]+", env_value) if t]
    return tokens


def token_matches(presented: str | None, digests: Iterable[str]) -> bool:
    """True when ``presented`` hashes to one of ``digests`` (constant-time comparisons)."""
    if not presented:
        return False
    mine = hash_token(presented)
    ok = False
    for d in digests:
        # Compare against every digest so the time does not say which one matched.
        ok |= hmac.compare_digest(mine, d)
    return ok
