"""The HTTP API of the tuner service, and its Ray Serve deployment (thin wiring).

:func:`create_app` maps HTTP onto a :class:`~optimizer.service.facade.JobService`
(FastAPI; the OpenAPI document is at ``/openapi.json``); :func:`build_app` wraps it in a Ray
Serve deployment whose single replica also runs the
:class:`~optimizer.service.scheduler.Scheduler` thread, and :func:`run_service` starts it on a
cluster. Every route but ``/healthz`` wants ``Authorization: Bearer TOKEN``;
the replica keeps only SHA-256 digests of the tokens. Request bodies are read with a size cap
(413 above it; a JSON or YAML job body, and a multipart `job` part, at most
:data:`~optimizer.service.security.MAX_BODY_BYTES`, its parse bounded); a multipart body is
written to a temporary file as it streams in (never the whole body in memory). The replica
parses and checks none of it: a submission is parsed and checked in one of the replica's
check processes (:mod:`optimizer.service.check_workers`), the replica only storing what passed.
Every body must arrive in time, and a team may be sending only a few at once (408, 429:
:mod:`optimizer.service.bodies`), so slow bodies never hold the replica's request slots; a
submission is refused (429) before its body is read while its team's check slots are full. A
re-validated export is a validation
queued off the request path (202, then polled:
:mod:`optimizer.service.validations`). Errors map to statuses in one place: an invalid job is
422 with the job file loader's message (the key's path and the fix), a file outside the
allowed roots 403, an unknown id 404, a conflict with the study's state 409, a team's full
validation queue 429.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from optimizer.errors import ConfigError, NotFound, SubmissionRefused
from optimizer.export import FORMATS, POLICIES, parse_weights
from optimizer.service.auth import (
    Principal,
    TokenEntry,
    authenticate,
    parse_token_env,
    read_token_file,
)
from optimizer.service.bodies import BodyGuard, BodyLimits
from optimizer.service.check_workers import check_processes
from optimizer.service.facade import ExportResult, JobService
from optimizer.service.scheduler import Scheduler
from optimizer.service.security import MAX_BODY_BYTES
from optimizer.service.settings import DEFAULT_MAX_TRACE_ROWS, REPLICA_SLOTS, ServiceSettings
from optimizer.service.store import JobStore
from optimizer.service.study_host import RayDriverLauncher
from optimizer.service.submissions import Body

__all__ = [
    "APP_NAME",
    "body_limits",
    "build_app",
    "create_app",
    "run_service",
    "settings_from_args",
]

APP_NAME = "vllm-autotune"
TOKENS_ENV = "VLLM_AUTOTUNE_TOKENS"
DATABASE_ENV = "VLLM_AUTOTUNE_DATABASE"
STORAGE_ENV = "VLLM_AUTOTUNE_STORAGE"

_bearer = HTTPBearer(auto_error=False, description="a token from the service's token list")


class _TooLarge(Exception):
    def __init__(self, limit: int, what: str = "the request") -> None:
        super().__init__(limit)
        self.limit, self.what = limit, what


_JOB_BODY = "a JSON or YAML job body (send a larger trace as a multipart `trace` part)"


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(limit, _JOB_BODY)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(limit, _JOB_BODY)
        chunks.append(chunk)
    return b"".join(chunks)


def _error(status: int, detail: str) -> JSONResponse:
    # Every line plain, whatever a message quotes (a lone surrogate would not even encode).
    detail = "\n".join(printable(line, None) for line in detail.split("\n"))
    body: dict[str, Any] = {"detail": detail}
    if status == 422:
        body["errors"] = [ln.strip() for ln in detail.splitlines()[1:] if ln.strip()]
    return JSONResponse(status_code=status, content=body)


def printable(text: str, limit: int | None = 80) -> str:
    """``text`` cut to ``limit`` characters (None: whole), every character that does not
    print (controls, format characters, line separators, lone surrogates, unassigned ones)
    written as its escape (``\\x1b``, ``\\u2028``, ``\\ud800``): one plain line, whatever
    was sent."""
    cut = text if limit is None else text[:limit]
    shown = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in cut
    )
    return shown + ("..." if len(cut) < len(text) else "")


def _invalid_request(errors: Sequence[Any]) -> str:
    """FastAPI's validation errors of query and path parameters as one line each, the input
    escaped (:func:`printable`), never echoed raw (issue 42)."""
    lines = ["invalid request parameters:"]
    for err in errors:
        where = ".".join(printable(str(p), 40) for p in err.get("loc", ())) or "request"
        line = f"{where}: {printable(str(err.get('msg', 'invalid')), 200)}"
        value = err.get("input")
        if isinstance(value, str | int | float | bool):
            line += f" (got {printable(repr(value) if isinstance(value, str) else str(value))})"
        lines.append(line)
    return "\n".join(lines)


#: OpenAPI description of a submission body (JSON, YAML or multipart).
_SUBMISSION_BODY = {
    "requestBody": {
        "required": True,
        "description": (
            "A job (the job file's schema), or an envelope {job, not_before, until, "
            "trace_upload: {filename, content_b64}}; JSON or YAML. Multipart: a `job` part "
            "(JSON or YAML, either shape), an optional `trace` file part, optional "
            "`not_before` / `until` fields."
        ),
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "application/yaml": {"schema": {"type": "string"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "job": {"type": "string"},
                        "trace": {"type": "string", "format": "binary"},
                        "not_before": {"type": "string", "format": "date-time"},
                        "until": {"type": "string", "format": "date-time"},
                    },
                    "required": ["job"],
                }
            },
        },
    }
}


def _map_errors(app: FastAPI) -> None:
    """Errors to statuses, in one place: 422 invalid (FastAPI's own for query and path
    parameters too, its input escaped), 404 unknown, the refusal's own, 413."""

    @app.exception_handler(ConfigError)
    async def _config(_r: Request, exc: ConfigError) -> JSONResponse:
        return _error(422, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, _invalid_request(exc.errors()))

    @app.exception_handler(NotFound)
    async def _missing(_r: Request, exc: NotFound) -> JSONResponse:
        return _error(404, str(exc))

    @app.exception_handler(SubmissionRefused)
    async def _refused(_r: Request, exc: SubmissionRefused) -> JSONResponse:
        response = _error(exc.status, str(exc))
        if exc.retry_after_s is not None:
            response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(_TooLarge)
    async def _large(_r: Request, exc: _TooLarge) -> JSONResponse:
        return _error(413, f"{exc.what} is limited to {exc.limit} bytes")


#: Bytes of a multipart body gathered before they are written to its file (in a worker
#: thread: the event loop never waits for the disk).
_SPOOL_WRITE = 1024**2


@asynccontextmanager
async def _received(request: Request, limit: int) -> AsyncIterator[Body]:
    """A submission's body as it arrives, nothing of it parsed here: a JSON or YAML body of at
    most :data:`~optimizer.service.security.MAX_BODY_BYTES` in memory; a multipart body of at
    most ``limit`` bytes written to a temporary file as it streams in (removed on exit), so
    the replica never holds it. Parsing and every check happen where the body is checked
    (:meth:`JobService.submit_body <optimizer.service.facade.JobService.submit_body>`)."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        yield Body(ctype, data=await _read_body(request, min(limit, MAX_BODY_BYTES)))
        return
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(limit)
    fd, path = tempfile.mkstemp(prefix="vllm-autotune-body-")
    try:
        with os.fdopen(fd, "wb") as out:
            size = 0
            pending: list[bytes] = []
            gathered = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _TooLarge(limit)
                pending.append(chunk)
                gathered += len(chunk)
                if gathered >= _SPOOL_WRITE:
                    await run_in_threadpool(out.writelines, pending)
                    pending, gathered = [], 0
            await run_in_threadpool(out.writelines, pending)
        yield Body(ctype, path=path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def create_app(service: JobService) -> FastAPI:
    """The FastAPI application over ``service``.

    Args:
        service: The job service (tests pass one with a fake launcher).
    """
    settings = service.settings
    app = FastAPI(
        title="vllm-autotune",
        description="Submit, watch, cancel and export vLLM tuning studies.",
        version="1",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )

    auth = _bearer_auth(settings.token_entries())
    authed = [Depends(auth)]
    caller = Depends(auth)  # the same (cached) dependency, as a parameter: who is asking

    _map_errors(app)
    # Slow bodies: each one timed (408), a team's and all teams' in flight bounded (429); a
    # submission refused (429) before its body is read while its team's check slots are full.
    app.add_middleware(
        BodyGuard,
        entries=settings.token_entries(),
        limits=body_limits(settings),
        checks=service.checks,
    )

    @app.get("/healthz", tags=["service"])
    async def healthz() -> dict[str, Any]:
        """Liveness (no token needed)."""
        if service.liveness.running:  # no I/O: answered on the event loop, no thread's hop
            return service.health()
        return await run_in_threadpool(service.health)

    @app.get("/openapi.json", dependencies=authed, include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    _add_study_routes(app, service, authed, caller)
    _add_export_route(app, service, authed, caller)
    return app


def body_limits(settings: ServiceSettings) -> BodyLimits:
    """The request-body bounds of ``settings`` (:mod:`optimizer.service.bodies`)."""
    return BodyLimits(
        timeout_s=settings.body_timeout_s,
        min_rate=settings.body_min_rate,
        per_team=settings.bodies_per_team,
        in_flight=settings.bodies_in_flight,
    )


def _bearer_auth(entries: Sequence[TokenEntry]) -> Callable[..., Principal]:
    """The dependency that answers who a request's bearer token names (401 when none)."""

    def auth(
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        who = authenticate(creds.credentials, entries) if creds is not None else None
        if who is None:
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return who

    return auth


def _add_study_routes(app: FastAPI, service: JobService, authed: list[Any], caller: Any) -> None:
    """Submit, list, read and cancel studies (``caller``: the dependency naming the caller)."""
    settings = service.settings

    @app.post(
        "/v1/studies",
        dependencies=authed,
        status_code=201,
        tags=["studies"],
        openapi_extra=_SUBMISSION_BODY,
    )
    async def submit(request: Request, who: Principal = caller) -> dict[str, Any]:
        """Queue a study; returns its id."""
        async with _received(request, settings.max_upload_bytes) as body:
            # parsed and checked in a check process (the replica's): this thread only waits
            rec, notes = await run_in_threadpool(service.submit_body, body, who)
        return {**service.summary(rec), "notes": notes}

    @app.get("/v1/studies", dependencies=authed, tags=["studies"])
    def list_studies(who: Principal = caller) -> list[dict[str, Any]]:
        """Every study of the caller's team (an admin: all), in submission order."""
        return service.list_summaries(who)

    @app.get("/v1/studies/{study_id}", dependencies=authed, tags=["studies"])
    def get_study(study_id: str, who: Principal = caller) -> dict[str, Any]:
        """Status, progress, budget left, trials, and the Pareto front beside the baseline."""
        return service.detail(study_id, who)

    @app.get("/v1/studies/{study_id}/trials/{number}", dependencies=authed, tags=["studies"])
    def get_trial(study_id: str, number: int, who: Principal = caller) -> dict[str, Any]:
        """One trial: engine arguments, summary, memory account, constraints."""
        return service.trial(study_id, number, who)

    @app.post("/v1/studies/{study_id}/cancel", dependencies=authed, tags=["studies"])
    def cancel(study_id: str, who: Principal = caller) -> dict[str, Any]:
        """Stop launching, stop the running trials (actors and servers), keep what finished."""
        return service.cancel(study_id, who)


def _download(study_id: str, fmt: str, result: ExportResult) -> Response:
    media = "text/x-shellscript" if fmt == "vllm-cli" else "application/yaml"
    return Response(
        content=result.text,
        media_type=media,
        headers={
            "Content-Disposition": f'attachment; filename="{study_id}-{result.filename}"',
            "X-Autotune-Trial": str(result.trial),
        },
    )


def _add_export_route(app: FastAPI, service: JobService, authed: list[Any], caller: Any) -> None:
    """Export a study's chosen configuration as a download; a re-validated export is a
    validation to poll (queued, run off the request path), then to download."""

    @app.post(
        "/v1/studies/{study_id}/export",
        dependencies=authed,
        tags=["studies"],
        responses={202: {"description": "validate=true: the validation queued, to poll"}},
    )
    def export(
        study_id: str,
        format: Annotated[Literal[FORMATS], Query()],  # type: ignore[valid-type]
        policy: Annotated[
            Literal[tuple(p for p in POLICIES if p != "trial")],  # type: ignore[valid-type]
            Query(),
        ] = "max-throughput",
        trial: int | None = None,
        weight: Annotated[list[str] | None, Query()] = None,
        validate: bool = False,
        runs: Annotated[int, Query(ge=1, le=10)] = 3,
        force: bool = False,
        who: Principal = caller,
    ) -> Response:
        """The chosen configuration as a download; with validate=true, 202 and the queued
        validation (poll it; download its export once done)."""
        weights = parse_weights(weight or [])
        if validate:
            doc = service.request_validation(
                study_id,
                format,
                policy,
                trial=trial,
                weights=weights,
                runs=runs,
                force=force,
                who=who,
            )
            return JSONResponse(status_code=202, content=doc, headers={"Location": doc["poll"]})
        result = service.export(study_id, format, policy, trial=trial, weights=weights, who=who)
        return _download(study_id, format, result)

    @app.get(
        "/v1/studies/{study_id}/validations/{validation_id}", dependencies=authed, tags=["studies"]
    )
    def validation(study_id: str, validation_id: str, who: Principal = caller) -> dict[str, Any]:
        """A queued export validation: queued, running, done (download it), refused, failed."""
        return service.validation(study_id, validation_id, who)

    @app.get(
        "/v1/studies/{study_id}/validations/{validation_id}/export",
        dependencies=authed,
        tags=["studies"],
    )
    def validation_export(study_id: str, validation_id: str, who: Principal = caller) -> Response:
        """The export of a validation that is done (409 before, or with the refusal)."""
        result = service.validation_export(study_id, validation_id, who)
        doc = service.validation(study_id, validation_id, who)
        return _download(study_id, doc["format"], result)


# --- Ray Serve --------------------------------------------------------------------------------


def freeze_heap() -> int:
    """Move every object alive now (the replica's imports, its app, its settings) out of the
    garbage collector's reach, and return how many: a full collection then walks only what
    requests make. Over the imports alone a full collection took about 0.1 s on a 2-core host,
    a stall every request in flight waits out (issue 42)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _Ingress:
    """The Serve replica: the job service, its scheduler thread, and the FastAPI app."""

    def __init__(self, settings: ServiceSettings) -> None:
        store = JobStore(settings.database_url)
        launcher = RayDriverLauncher(mlflow=settings.mlflow, cpus_per_trial=settings.cpus_per_trial)
        concurrent = settings.max_concurrent
        if concurrent is None:
            gpus = launcher.cluster_gpus()
            concurrent = 1 if gpus == 0 else gpus
        self.scheduler = Scheduler(
            store,
            launcher,
            max_concurrent=concurrent,
            max_driver_starts=settings.max_driver_starts,
        )
        self.service = JobService(
            settings, store, self.scheduler, check_processes=check_processes(settings)
        )
        self.scheduler.start(settings.poll_interval_s)
        self.service.liveness.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.service)
        freeze_heap()
        return app

    def __del__(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stop()
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


#: The keys of a Serve config's ``args`` (and of the CLI's options).
_SETTINGS_KEYS = frozenset(
    {
        "database_url",
        "data_dir",
        "trace_roots",
        "model_roots",
        "allow_hub_models",
        "mlflow_uri",
        "token_file",
        "max_concurrent",
        "max_upload_mib",
        "max_trace_rows",
        "study_storage",
        "poll_interval_s",
        "mlflow",
        "body_timeout_s",
        "body_min_rate",
        "bodies_per_team",
        "bodies_in_flight",
    }
)


def settings_from_args(args: dict[str, Any]) -> ServiceSettings:
    """Settings from a Serve config's ``args`` (or the CLI's options).

    Keys: ``database_url``, ``data_dir``, ``trace_roots`` (list), ``model_roots`` (list),
    ``allow_hub_models``, ``token_file``, ``max_concurrent``, ``max_upload_mib``,
    ``max_trace_rows``, ``study_storage``, ``mlflow_uri``, ``poll_interval_s``, ``mlflow``,
    and the request-body bounds ``body_timeout_s``, ``body_min_rate``, ``bodies_per_team``,
    ``bodies_in_flight`` (:class:`~optimizer.service.settings.ServiceSettings`). Tokens come
    from ``token_file`` (``TEAM TOKEN [admin]`` or ``TEAM sha256:DIGEST [admin]`` a line:
    :mod:`optimizer.service.auth`) and the ``VLLM_AUTOTUNE_TOKENS`` environment variable of
    the process that builds the application; only their digests are kept, with their team.
    Without ``database_url`` / ``study_storage``, ``VLLM_AUTOTUNE_DATABASE`` /
    ``VLLM_AUTOTUNE_STORAGE`` are read (so a password never has to appear in a manifest).

    Raises:
        ConfigError: No token configured, an unknown key, a row limit below 1, an
            ``allow_hub_models`` that is not a boolean, or body bounds out of range.
    """
    unknown = sorted(set(args) - _SETTINGS_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown service settings {unknown}; valid: {', '.join(sorted(_SETTINGS_KEYS))}"
        )
    data_dir = str(Path(args.get("data_dir") or "autotune-service").expanduser().resolve())
    max_rows = int(args.get("max_trace_rows") or DEFAULT_MAX_TRACE_ROWS)
    if max_rows < 1:
        raise ConfigError(f"max_trace_rows {max_rows}: give 1 or more")
    hub = args.get("allow_hub_models", False)
    if not isinstance(hub, bool):  # a YAML "false" in quotes would be true
        raise ConfigError(f"allow_hub_models {hub!r}: give true or false")
    return ServiceSettings(
        database_url=args.get("database_url")
        or os.environ.get(DATABASE_ENV)
        or f"sqlite:///{data_dir}/service.db",
        data_dir=data_dir,
        trace_roots=_folders(args.get("trace_roots")),
        tokens=_tokens(args.get("token_file")),
        model_roots=_folders(args.get("model_roots")),
        allow_hub_models=hub,
        mlflow_uri=args.get("mlflow_uri") or None,
        max_concurrent=(
            int(args["max_concurrent"]) if args.get("max_concurrent") is not None else None
        ),
        max_upload_bytes=int(float(args.get("max_upload_mib") or 32) * 1024**2),
        max_trace_rows=max_rows,
        study_storage=args.get("study_storage") or os.environ.get(STORAGE_ENV) or None,
        poll_interval_s=float(args.get("poll_interval_s") or 2.0),
        mlflow=bool(args.get("mlflow", True)),
        **_body_bounds(args),
    )


def _body_bounds(args: dict[str, Any]) -> dict[str, Any]:
    """The request-body bounds of a Serve config's ``args`` (defaults where absent).

    Raises:
        ConfigError: A timeout not above 0, a negative rate, a team bound below 1, or bodies
            in flight below the team bound or not below the replica's request slots.
    """
    defaults = ServiceSettings(database_url="", data_dir="")
    bounds = {
        "body_timeout_s": float(args.get("body_timeout_s") or defaults.body_timeout_s),
        "body_min_rate": int(args.get("body_min_rate", defaults.body_min_rate)),
        "bodies_per_team": int(args.get("bodies_per_team") or defaults.bodies_per_team),
        "bodies_in_flight": int(args.get("bodies_in_flight") or defaults.bodies_in_flight),
    }
    if bounds["body_timeout_s"] <= 0 or bounds["body_min_rate"] < 0:
        raise ConfigError(
            f"body_timeout_s {bounds['body_timeout_s']:g} / body_min_rate "
            f"{bounds['body_min_rate']}: give a timeout above 0 and a rate of 0 or more"
        )
    if not 1 <= bounds["bodies_per_team"] <= bounds["bodies_in_flight"] < REPLICA_SLOTS:
        raise ConfigError(
            f"bodies_per_team {bounds['bodies_per_team']} / bodies_in_flight "
            f"{bounds['bodies_in_flight']}: give 1 <= bodies_per_team <= bodies_in_flight < "
            f"{REPLICA_SLOTS} (the API replica's request slots: the rest serve reads)"
        )
    return bounds


def _folders(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """One folder or a list of them, resolved."""
    folders = [value] if isinstance(value, str) else list(value or [])
    return tuple(str(Path(r).expanduser().resolve()) for r in folders)


def _tokens(token_file: str | None) -> tuple[TokenEntry, ...]:
    """The token file's entries and ``VLLM_AUTOTUNE_TOKENS``'s (digests only).

    Raises:
        ConfigError: Neither gives a token.
    """
    tokens: list[TokenEntry] = []
    if token_file:
        tokens += read_token_file(token_file)
    tokens += parse_token_env(os.environ.get(TOKENS_ENV))
    if not tokens:
        raise ConfigError(
            f"no API tokens: give --token-file (one token a line) or set {TOKENS_ENV}"
        )
    return tuple(dict.fromkeys(tokens))


def build_app(args: dict[str, Any] | ServiceSettings) -> Any:
    """The Serve application (``import_path: optimizer.service.api:build_app`` in a Serve
    config). One replica: it owns the scheduler."""
    from optimizer.runners import serve_deployment

    settings = args if isinstance(args, ServiceSettings) else settings_from_args(args)
    return serve_deployment(_Ingress, "autotune-api", settings, max_ongoing_requests=REPLICA_SLOTS)


def run_service(
    settings: ServiceSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_address: str | None = None,
) -> str:
    """Deploy the service on a Ray cluster (a local one without ``ray_address``); its URL."""
    from optimizer.runners import serve_run, start_ray

    # A local cluster listens on the operator's address (deploy/SERVICE.md, "Limits").
    start_ray(ray_address, host=host)
    serve_run(build_app(settings), name=APP_NAME, host=host, port=port)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown}:{port}"
