"""Where a study's MLflow review goes: the experiment and store of a study (from its plan, or
from a study folder's ``review/`` record), the review's inputs written beside the study, the
MLflow UI's address and command, and a copied folder's own store pointed at its own artifacts.

Imports no MLflow: it names a target and writes files; :mod:`optimizer.tracking.sync` logs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from optimizer.errors import ConfigError
from optimizer.study import StudyPlan
from optimizer.study_folder import (
    portable_path,
    portable_url,
    resolve_path,
    resolve_url,
    storage_url_of,
)

__all__ = [
    "REVIEW_DIR",
    "VIEW_TAG",
    "TrackingTarget",
    "adopt_copied_store",
    "bound_http_retries",
    "experiment_name",
    "local_tracking_uri",
    "read_json",
    "redact",
    "redact_job",
    "relative",
    "review_url",
    "runs_url",
    "target_for_dir",
    "target_from_plan",
    "ui_command",
    "write_review_inputs",
]

_log = logging.getLogger(__name__)

# The runs table's columns: MLflow (3.15+) has no default-columns setting, but it opens a view
# saved as an experiment tag when the URL names it (its "Views" menu lists it too).
_VIEW_KEY = "vllm-autotune"
VIEW_TAG = f"mlflow.sharedViewState.{_VIEW_KEY}"
_RUNS_VIEW_QUERY = f"workflowType=machine_learning&viewStateShareKey={_VIEW_KEY}"

REVIEW_DIR = "review"


@dataclass(frozen=True)
class TrackingTarget:
    """Which study goes to which MLflow experiment.

    Attributes:
        study: The study's name in its Optuna storage (a service study's is ``TEAM/ID``);
            the parent run's name and every run's ``vllm_autotune.study`` tag.
        storage_url: Optuna storage URL (the source of truth).
        out: The study folder (trial folders, plan.json, review/).
        tracking_uri: MLflow tracking URI.
        experiment: MLflow experiment name.
        sampler: Sampler name, logged as a param of every trial.
        artifact_root: Where a newly created experiment keeps artifacts (local stores only).
    """

    study: str
    storage_url: str
    out: Path
    tracking_uri: str
    experiment: str
    sampler: str = ""
    artifact_root: Path | None = None


def local_tracking_uri(out: Path) -> str:
    """The embedded default store of a study folder: ``sqlite:///<out>/mlflow.db``."""
    return f"sqlite:///{Path(out).resolve() / 'mlflow.db'}"


def relative(path: Path) -> str:
    """A path as a message shows it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def ui_command(target: TrackingTarget) -> str:
    """The command that opens the MLflow UI on this target (or its URL for a server)."""
    if target.tracking_uri.startswith(("http://", "https://")):
        return target.tracking_uri
    if target.tracking_uri.startswith("sqlite:///"):
        db = Path(target.tracking_uri[len("sqlite:///") :])
        root = target.artifact_root or db.parent / "mlartifacts"
        return (
            f"mlflow ui --backend-store-uri sqlite:///{relative(db)} "
            f"--default-artifact-root {relative(root)}"
        )
    return f"mlflow ui --backend-store-uri {target.tracking_uri}"


def runs_url(experiment_id: str, server: str = "http://127.0.0.1:5000") -> str:
    """The MLflow UI's runs table of an experiment (not MLflow 3's GenAI traces pages).

    Args:
        experiment_id: The experiment.
        server: Where ``mlflow ui`` (or the tracking server) serves the UI.
    """
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?{_RUNS_VIEW_QUERY}"


def review_url(target: TrackingTarget, experiment_id: str) -> str:
    """Where a reviewer opens the study's runs table: the tracking server's UI, or the local
    ``mlflow ui`` (:func:`ui_command`) at its default address."""
    if target.tracking_uri.startswith(("http://", "https://")):
        return runs_url(experiment_id, redact(target.tracking_uri))
    return runs_url(experiment_id)


def redact(text: str) -> str:
    """A URL as a team may see it: its password and secret query values (``?password=``,
    ``?token=``, ...) masked, by the service's one rule
    (:func:`optimizer.service.security.redact_url`)."""
    from optimizer.service.security import redact_url

    return redact_url(text) or text


def redact_job(job: dict[str, Any]) -> dict[str, Any]:
    """A job as a team may see it: its URLs as :func:`redact` shows them, secret env values
    masked (:func:`optimizer.service.security.redact_job`)."""
    from optimizer.service.security import redact_job

    return redact_job(job)


def experiment_name(plan: StudyPlan, team: str | None = None) -> str:
    """The MLflow experiment of a study: ``mlflow.experiment``, else the job's name; in the
    service behind its team's prefix (``TEAM/NAME``), which the job cannot choose: a team
    name holds no ``/``, so ``beta/alpha/x`` is beta's, never alpha's."""
    name = plan.job.mlflow.experiment or plan.job.name
    return f"{team}/{name}" if team else name


def target_from_plan(plan: StudyPlan, team: str | None = None) -> TrackingTarget:
    """The target of a prepared study: the job's tracking URI or the folder's own store, its
    experiment (:func:`experiment_name`), keyed by the study's name in its storage."""
    job = plan.job
    uri = job.mlflow.tracking_uri or local_tracking_uri(plan.out)
    local = uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri
    return TrackingTarget(
        # The study as stored (a service study is TEAM/ID there), never the job's name: a
        # study of that name in a shared storage may be anyone's.
        study=plan.storage_name,
        storage_url=plan.storage_url,
        out=plan.out,
        tracking_uri=uri,
        experiment=experiment_name(plan, team),
        sampler=job.sampler.name,
        artifact_root=(plan.out / "mlartifacts").resolve() if local else None,
    )


def write_review_inputs(plan: StudyPlan, target: TrackingTarget) -> None:
    """Write what the parent run shows into ``<out>/review`` (so mlflow-sync can re-log it)."""
    from optimizer.workload.stats import inspect_trace

    folder = plan.out / REVIEW_DIR
    folder.mkdir(parents=True, exist_ok=True)
    job = plan.job.model_dump(mode="json")
    # Server env may hold secrets (config.EngineSection): keep the names, never the values.
    job["engine"]["env"] = {k: "***" for k in job["engine"].get("env", {})}
    if job.get("storage"):
        job["storage"] = redact(job["storage"])
    if job.get("mlflow", {}).get("tracking_uri"):
        job["mlflow"]["tracking_uri"] = redact(job["mlflow"]["tracking_uri"])
    (folder / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    (folder / "search_space.yaml").write_text(
        yaml.safe_dump(plan.space.model_dump(mode="json", exclude_none=True), sort_keys=False)
    )
    trace = {"stats": inspect_trace(plan.trace), "notes": list(plan.trace_notes)}
    (folder / "trace.json").write_text(json.dumps(trace, indent=2, default=str) + "\n")
    meta = {
        "study": target.study,
        # Relative to the study folder where inside it: a copied folder stays self-contained.
        "storage": portable_url(target.storage_url, plan.out),
        "tracking_uri": portable_url(target.tracking_uri, plan.out),
        "experiment": target.experiment,
        "sampler": target.sampler,
        "artifact_root": (
            portable_path(target.artifact_root, plan.out) if target.artifact_root else None
        ),
        "model": plan.engine.model,
        "search_space": plan.space.name,
    }
    (folder / "mlflow.json").write_text(json.dumps(meta, indent=2) + "\n")


def bound_http_retries() -> None:
    """Keep MLflow's own HTTP retries short; the tracker's thread does the patient retrying.

    MLflow reads these variables on every request, and by default retries for minutes; it also
    prints a "View run at" line per finished run to stdout, into the tuner's progress output.
    Values a user has set win.
    """
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def adopt_copied_store(target: TrackingTarget) -> None:
    """A study folder's own SQLite store, copied with the folder, still names the artifact
    folder where it was written (MLflow keeps absolute locations per experiment and run): point
    the study's experiment and its runs at the copy's artifact folder, so logging from the copy
    never writes into the original folder. Only for ``sqlite:///<folder>/mlflow.db`` with the
    folder's own artifact root; anything else is left as it is."""
    import sqlite3
    from urllib.parse import unquote, urlparse

    db = Path(target.tracking_uri.removeprefix("sqlite:///"))
    own = target.tracking_uri.startswith("sqlite:///") and (
        db.resolve() == (target.out / "mlflow.db").resolve()
    )
    if not (own and db.is_file() and target.artifact_root is not None):
        return
    new = target.artifact_root.resolve().as_uri()
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        row = con.execute(
            "SELECT experiment_id, artifact_location FROM experiments WHERE name = ?",
            (target.experiment,),
        ).fetchone()
        if row is None or not str(row[1] or "").startswith(("file:", "/")):
            return
        old = str(row[1]).rstrip("/")
        path = Path(unquote(urlparse(old).path)) if old.startswith("file:") else Path(old)
        if old == new or path.resolve().is_relative_to(target.out.resolve()):
            return
        con.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, row[0])
        )
        con.execute(
            "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
            "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
            (new, len(old) + 1, row[0], len(old), old),
        )
    _log.info("MLflow: the copied store's artifacts now live in %s (were %s)", new, old)


def target_for_dir(
    study_dir: str | Path, tracking_uri: str | None, experiment: str | None
) -> TrackingTarget:
    """The target a study folder was tuned with (``review/mlflow.json``, its paths resolved
    where the folder is now), else the folder's own store; ``tracking_uri`` and ``experiment``
    replace the recorded ones.

    Raises:
        ConfigError: Not a study folder (no ``plan.json`` naming a study and its storage).
    """
    bound_http_retries()
    folder = Path(study_dir).resolve()
    plan = read_json(folder / "plan.json")
    if not plan.get("study") or not plan.get("storage"):
        raise ConfigError(f"{folder}: no plan.json here; give a study folder written by `tune`")
    meta = read_json(folder / REVIEW_DIR / "mlflow.json")
    job = plan.get("job")
    old_out = job.get("out") if isinstance(job, dict) else None
    old_out = old_out if isinstance(old_out, str) else None
    recorded_uri = meta.get("tracking_uri")
    uri = tracking_uri or (
        resolve_url(str(recorded_uri), folder, old_out)
        if recorded_uri
        else local_tracking_uri(folder)
    )
    local = "://" not in uri or uri.startswith(("sqlite:", "file:"))
    root = meta.get("artifact_root")
    root = resolve_path(str(root), folder, old_out) if root else None
    target = TrackingTarget(
        study=str(plan["study"]),
        storage_url=storage_url_of(plan, folder),
        out=folder,
        tracking_uri=uri,
        experiment=experiment or meta.get("experiment") or str(plan["study"]),
        sampler=str(meta.get("sampler") or ""),
        artifact_root=(root if root and not tracking_uri else folder / "mlartifacts")
        if local
        else None,
    )
    return target


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content ({} when missing, unreadable or not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
