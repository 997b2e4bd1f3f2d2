"""Command-line side of the tuner service: ``serve`` starts it, a thin HTTP client talks to it.

``serve`` deploys the Ray Serve application of :mod:`optimizer.service.api` on a Ray cluster (a
local one unless ``--ray-address``). ``submit``, ``status``, ``cancel`` and ``fetch-export``
call its API with the bearer token from ``$VLLM_AUTOTUNE_TOKEN`` or ``--token-file``; the server URL
comes from ``--server`` or ``$VLLM_AUTOTUNE_SERVER``. :func:`register` adds the commands to the
main parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from optimizer.errors import ConfigError

__all__ = ["ServiceClient", "register"]

console = Console()
err_console = Console(stderr=True)

TOKEN_ENV = "VLLM_AUTOTUNE_TOKEN"
SERVER_ENV = "VLLM_AUTOTUNE_SERVER"


class ServiceClient:
    """A small client of the service's HTTP API.

    Args:
        server: Base URL, e.g. ``http://127.0.0.1:8000``.
        token: Bearer token.
        timeout_s: Per-request timeout (exports with re-validation take long: raise it).
        http: An ``httpx.Client`` to use instead (tests pass FastAPI's TestClient).
    """

    def __init__(
        self, server: str, token: str, *, timeout_s: float = 60.0, http: Any = None
    ) -> None:
        import httpx

        self.server = server.rstrip("/")
        self._http = http or httpx.Client(base_url=self.server, timeout=httpx.Timeout(timeout_s))
        self._auth = {"Authorization": f"Bearer {token}"}

    def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, url, headers=self._auth, **kwargs)
        except httpx.TransportError as exc:
            raise ConfigError(f"cannot reach the service at {self.server}: {exc}") from exc
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ConfigError(f"the service answered {r.status_code}: {detail}")
        return r

    def submit(
        self,
        job: dict[str, Any],
        *,
        trace: Path | None = None,
        not_before: str | None = None,
        until: str | None = None,
    ) -> dict[str, Any]:
        """Queue a job (uploading ``trace`` when given); the study's short form."""
        doc: dict[str, Any] = {"job": job}
        if not_before:
            doc["not_before"] = not_before
        if until:
            doc["until"] = until
        if trace is None:
            result: dict[str, Any] = self._call("POST", "/v1/studies", json=doc).json()
            return result
        data = {k: v for k, v in (("not_before", not_before), ("until", until)) if v}
        with trace.open("rb") as f:
            files = {
                "job": ("job.json", json.dumps(job), "application/json"),
                "trace": (trace.name, f, "application/octet-stream"),
            }
            result = self._call("POST", "/v1/studies", files=files, data=data).json()
        return result

    def list(self) -> list[dict[str, Any]]:
        """Every study, short form."""
        result: list[dict[str, Any]] = self._call("GET", "/v1/studies").json()
        return result

    def get(self, study_id: str) -> dict[str, Any]:
        """One study in full."""
        result: dict[str, Any] = self._call("GET", f"/v1/studies/{study_id}").json()
        return result

    def trial(self, study_id: str, number: int) -> dict[str, Any]:
        """One trial in full."""
        result: dict[str, Any] = self._call("GET", f"/v1/studies/{study_id}/trials/{number}").json()
        return result

    def cancel(self, study_id: str) -> dict[str, Any]:
        """Cancel a study."""
        result: dict[str, Any] = self._call("POST", f"/v1/studies/{study_id}/cancel").json()
        return result

    def export(
        self, study_id: str, fmt: str, *, poll_s: float = 5.0, **params: Any
    ) -> tuple[str, str]:
        """(file text, suggested file name) of an export. A re-validated one (``validate``)
        is a validation the service queues: polled every ``poll_s`` seconds until it ends,
        then downloaded (or its refusal raised)."""
        query = {"format": fmt, **{k: v for k, v in params.items() if v is not None}}
        r = self._call("POST", f"/v1/studies/{study_id}/export", params=query)
        if r.status_code == 202:
            doc = r.json()
            while doc["state"] in ("queued", "running"):
                time.sleep(poll_s)
                doc = self._call("GET", doc["poll"]).json()
            if doc["state"] != "done":
                raise ConfigError(f"the validation {doc['state']}: {doc['message']}")
            r = self._call("GET", doc["download"])
        disposition = r.headers.get("content-disposition", "")
        name = disposition.split("filename=")[-1].strip('"') if "filename=" in disposition else ""
        return r.text, name or f"{study_id}-{fmt}.txt"


# --- commands ---------------------------------------------------------------------------------


def _token(ns: argparse.Namespace) -> str:
    if getattr(ns, "token_file", None):
        try:
            lines = Path(ns.token_file).read_text().split()
        except OSError as exc:
            raise ConfigError(f"{ns.token_file}: cannot read ({exc.strerror})") from exc
        if lines:
            return lines[0]
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ConfigError(f"no token: set {TOKEN_ENV} or give --token-file")
    return token


def _client(ns: argparse.Namespace, timeout_s: float = 60.0) -> ServiceClient:
    server = ns.server or os.environ.get(SERVER_ENV) or "http://127.0.0.1:8000"
    return ServiceClient(server, _token(ns), timeout_s=timeout_s)


def cmd_serve(ns: argparse.Namespace) -> int:
    """Deploy the service and keep it up until interrupted (unless --detach)."""
    from optimizer.service.api import run_service, settings_from_args

    settings = settings_from_args(
        {
            "database_url": ns.database,
            "data_dir": ns.data_dir,
            "trace_roots": ns.trace_root,
            "model_roots": ns.model_root,
            "allow_hub_models": ns.allow_hub_models,
            "mlflow_uri": ns.mlflow_uri,
            "token_file": ns.token_file,
            "max_concurrent": ns.max_concurrent,
            "max_upload_mib": ns.max_upload_mib,
            "max_trace_rows": ns.max_trace_rows,
            "study_storage": ns.study_storage,
            "mlflow": not ns.no_mlflow,
        }
    )
    if not settings.trace_roots:
        err_console.print(
            "[yellow]no --trace-root: jobs must upload their traces with the request[/]"
        )
    url = run_service(settings, host=ns.host, port=ns.port, ray_address=ns.ray_address)
    console.print(
        f"vllm-autotune service at {url} (API /v1/studies, OpenAPI /openapi.json); "
        f"jobs in {settings.database_url.split('://')[0]} database, studies in {settings.data_dir}"
    )
    if ns.detach:
        if not ns.ray_address:
            err_console.print("[yellow]--detach without --ray-address: the local Ray stops now[/]")
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from optimizer.runners import serve_shutdown

        serve_shutdown()
    return 0


def cmd_token(ns: argparse.Namespace) -> int:
    """Print a new token (for the team) and the line for the service's token file."""
    import secrets

    from optimizer.service.auth import hash_token, parse_token_lines

    token = secrets.token_hex(32)
    line = f"{ns.team} sha256:{hash_token(token)}" + (" admin" if ns.admin else "")
    parse_token_lines(line, "--team")  # a bad team name fails here, not at the service's start
    console.print(f"token (give it to the team; it is shown once): {token}", soft_wrap=True)
    console.print(f"token-file line (the service keeps only this): {line}", soft_wrap=True)
    return 0


def _job_from_file(path: str) -> tuple[dict[str, Any], Path]:
    from optimizer.config import read_job_document

    file = Path(path)
    return read_job_document(file), file.parent


def cmd_submit(ns: argparse.Namespace) -> int:
    """Send a job file to the service."""
    job, folder = _job_from_file(ns.job)
    trace: Path | None = Path(ns.trace) if ns.trace else None
    if ns.upload_trace and trace is None:
        raw = Path(str((job.get("trace") or {}).get("path", "")))
        trace = raw if raw.is_absolute() else folder / raw
    if trace is not None and not trace.is_file():
        raise ConfigError(f"{trace}: no such trace file to upload")
    result = _client(ns).submit(job, trace=trace, not_before=ns.not_before, until=ns.until)
    console.print(f"submitted: study [bold]{result['id']}[/] ({result['name']}), {result['state']}")
    for note in result.get("notes", []):
        console.print(f"[dim]{note}[/]")
    return 0


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}"
    return "-" if v is None else str(v)


def cmd_status(ns: argparse.Namespace) -> int:
    """List studies, or show one."""
    client = _client(ns)
    if ns.id is None:
        rows = client.list()
        if ns.json:
            print(json.dumps(rows, indent=2))
            return 0
        table = Table(title="studies")
        for col in ("id", "name", "state", "submitted", "trials", "last event"):
            table.add_column(col)
        for s in rows:
            table.add_row(
                s["id"],
                s["name"],
                s["state"],
                s["submitted_at"] or "-",
                _fmt(s.get("trials")),
                str(s.get("progress", {}).get("last_event", "")),
            )
        console.print(table)
        return 0
    doc = client.get(ns.id)
    if ns.json:
        print(json.dumps(doc, indent=2))
        return 0
    p = doc["progress"]
    left = p.get("budget_left_s")
    console.print(
        f"study [bold]{doc['id']}[/] {doc['name']}: {doc['state']}"
        + (f" - {doc['message']}" if doc.get("message") else "")
    )
    console.print(
        f"done {p.get('done', 0)} running {p.get('running', 0)} failed {p.get('failed', 0)} "
        f"infeasible {p.get('infeasible', 0)} | remaining {_fmt(p.get('remaining'))}"
        + (f" | budget left {left / 60:.0f} min" if left is not None else "")
    )
    names = [o["metric"] for o in doc["objectives"]]
    if names:
        table = Table(title="Pareto front (feasible) vs baseline")
        table.add_column("trial", justify="right")
        for n in names:
            table.add_column(n, justify="right")
        table.add_column("changed vs baseline")
        rows = ([doc["baseline"]] if doc["baseline"] else []) + doc["front"]
        for row in rows:
            is_base = row is doc["baseline"]
            cells = []
            for n in names:
                text = _fmt(row["values"].get(n))
                gain = row["gains_pct"].get(n)
                if not is_base and gain is not None:
                    text += f" ({gain:+.0f}%)"
                cells.append(text)
            changed = ", ".join(f"{k}={v}" for k, v in sorted(row["changed"].items()))
            label = f"{row['number']} (baseline)" if is_base else str(row["number"])
            table.add_row(label, *cells, "vLLM defaults" if is_base else (changed or "-"))
        console.print(table)
    return 0


def cmd_cancel(ns: argparse.Namespace) -> int:
    """Cancel a study."""
    result = _client(ns).cancel(ns.id)
    console.print(f"study {result['id']}: {result['state']}")
    return 0


def cmd_fetch_export(ns: argparse.Namespace) -> int:
    """Download an export of a study from the service."""
    client = _client(ns, timeout_s=120.0)  # a validation is polled: no request waits on it
    text, name = client.export(
        ns.id,
        ns.format,
        policy=ns.policy,
        trial=ns.trial,
        validate="true" if ns.validate else None,
        runs=ns.runs if ns.validate else None,
        force="true" if ns.force else None,
        weight=ns.weight or None,
    )
    if ns.out == "-":
        sys.stdout.write(text)
        return 0
    path = Path(ns.out or name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    console.print(f"wrote {path}")
    return 0


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server", default=None, help=f"service URL (default ${SERVER_ENV}, else :8000 here)"
    )
    p.add_argument(
        "--token-file", default=None, help=f"file holding the API token (default ${TOKEN_ENV})"
    )


def register(sub: Any) -> None:
    """Add ``serve``, ``submit``, ``status``, ``cancel`` and ``fetch-export`` to ``sub``.

    Args:
        sub: The main parser's subparsers (``parser.add_subparsers()``).
    """
    _add_serve(sub)
    _add_client_commands(sub)


def _add_serve(sub: Any) -> None:
    """``serve``: the service's options (cluster, address, roots, limits, tokens)."""
    from optimizer.service.settings import DEFAULT_MAX_TRACE_ROWS

    p = sub.add_parser("serve", help="run the tuner as an HTTP service on Ray Serve")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--data-dir",
        default="autotune-service",
        help="study folders and uploads (default ./autotune-service)",
    )
    p.add_argument(
        "--database",
        default=None,
        help="job store URL (default: SQLite in --data-dir; postgresql+psycopg2://...)",
    )
    p.add_argument(
        "--trace-root",
        action="append",
        default=[],
        help="folder job traces may come from (repeatable); others must be uploaded",
    )
    p.add_argument(
        "--model-root",
        action="append",
        default=[],
        help="folder local models may come from (repeatable; a team's made models too, in "
        "DATA_DIR/models/TEAM); a relative model.path is looked for under each",
    )
    p.add_argument(
        "--allow-hub-models",
        action="store_true",
        help="serve a model name found under no model root as a hub repository id (ORG/NAME), "
        "downloaded by vLLM (default: refused)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="API tokens: 'TEAM sha256:DIGEST [admin]' a line (see `vllm-autotune token`); "
        "also $VLLM_AUTOTUNE_TOKENS (TEAM:TOKEN, comma separated)",
    )
    p.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="studies at once (default: 1 without GPUs, else the cluster's GPU count)",
    )
    p.add_argument("--max-upload-mib", type=float, default=32.0, help="largest request body")
    p.add_argument(
        "--max-trace-rows",
        type=int,
        default=DEFAULT_MAX_TRACE_ROWS,
        help="most rows of a job's trace, uploaded or under a trace root "
        f"(default {DEFAULT_MAX_TRACE_ROWS:,}); counted before the trace is parsed",
    )
    p.add_argument(
        "--study-storage",
        default=None,
        help="Optuna storage for jobs that set none (default: SQLite per study)",
    )
    p.add_argument("--no-mlflow", action="store_true", help="never log studies to MLflow")
    p.add_argument(
        "--mlflow-uri", default=None, help="MLflow store of every study (default: per study)"
    )
    p.add_argument(
        "--detach", action="store_true", help="return once deployed (with --ray-address)"
    )
    p.set_defaults(func=cmd_serve)


def _add_client_commands(sub: Any) -> None:
    """``token``, and the thin client's ``submit``, ``status``, ``cancel``, ``fetch-export``."""
    from optimizer.export import FORMATS, POLICIES

    p = sub.add_parser("token", help="make an API token for a team and its token-file line")
    p.add_argument("--team", required=True)
    p.add_argument("--admin", action="store_true", help="the token sees every team's studies")
    p.set_defaults(func=cmd_token)

    p = sub.add_parser("submit", help="send a job file to a tuner service")
    p.add_argument("job", help="job YAML file")
    p.add_argument("--trace", default=None, help="upload this trace file with the job")
    p.add_argument(
        "--upload-trace", action="store_true", help="upload the job's own trace.path file"
    )
    p.add_argument("--not-before", default=None, help="start no earlier (ISO time)")
    p.add_argument("--until", default=None, help="stop launching trials then (ISO time)")
    _client_options(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="studies of a tuner service, or one in detail")
    p.add_argument("id", nargs="?", default=None)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _client_options(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="cancel a study on a tuner service")
    p.add_argument("id")
    _client_options(p)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("fetch-export", help="download an export of a study from a tuner service")
    p.add_argument("id")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument(
        "--policy", default="max-throughput", choices=[x for x in POLICIES if x != "trial"]
    )
    p.add_argument("--trial", type=int, default=None)
    p.add_argument("--weight", action="append", default=[], metavar="OBJECTIVE=W")
    p.add_argument("--validate", action="store_true", help="re-validate on the cluster first")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--force", action="store_true")
    p.add_argument("--out", default=None, help="output file ('-': stdout)")
    _client_options(p)
    p.set_defaults(func=cmd_fetch_export)
