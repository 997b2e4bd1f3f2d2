"""MLflow review of a study: one parent run per study, one nested child run per trial.

The Optuna storage stays the source of truth; MLflow is a view of it, rebuilt idempotently.
:class:`Tracker` receives the driver's :class:`~optimizer.study.StudyEvent` objects and hands
them to a background thread, so a slow or unreachable tracking server never delays a trial:
the thread reads the finished trials from the study's own storage, writes them to MLflow with
bounded exponential backoff, and re-tags every child run whenever the Pareto front changes.
:func:`sync_study` (``vllm-autotune mlflow-sync DIR``) runs the same code once over a study
folder, finding existing runs by their tags (``vllm_autotune.study``, ``vllm_autotune.trial``)
and updating them, so running it twice creates nothing new.

The parent run holds the job, the search space, the trace's statistics and shaping notes, a
hypervolume-over-trials metric, the Pareto front (JSON, CSV, plots), parameter importances and
a Markdown report (baseline vs front, gain per objective, what the winners changed, a diagnosis
per trial class), and the study folder's stability check when there is one (its metrics, tags,
``stability.json`` and plots: :func:`log_stability`); :mod:`optimizer.analysis` and
:mod:`optimizer.stability` make every one of them, this module only logs.
Each child run holds the engine configuration (params), the whole summary,
startup/replay times, the memory account and server metrics (metrics), the trial's state,
failure class, baseline / Pareto / SLO tags, and its records, engine log and latency CDF.

The default store is local: ``sqlite:///<out>/mlflow.db`` with artifacts in
``<out>/mlartifacts``; ``mlflow.tracking_uri`` in the job points at a team's server instead.
Runs are keyed by the study's name in its storage (a service study's is ``TEAM/ID``), and a
service study's experiment is behind its team's prefix (``TEAM/NAME``: :func:`experiment_name`),
so two teams' jobs of one name never share an experiment or a run.
Uses :class:`mlflow.tracking.MlflowClient` with explicit run ids, never the fluent API
(DESIGN.md §7.9). This is the only module that imports mlflow.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml
from mlflow.entities import Metric, Param, RunTag, ViewType
from mlflow.tracking import MlflowClient
from optuna.trial import FrozenTrial, TrialState

from optimizer.analysis.diagnosis import diagnose
from optimizer.analysis.documents import headline_md, report_md
from optimizer.analysis.front import (
    FAILED_STATUSES,
    best_gains,
    finite,
    front_csv,
    front_doc,
    front_numbers,
    importances,
    trial_class,
)
from optimizer.analysis.hypervolume import hypervolume_history
from optimizer.analysis.plots import latency_cdf, plot_front
from optimizer.errors import ConfigError
from optimizer.study import StudyEvent, StudyPlan, create_storage
from optimizer.study_folder import (
    portable_path,
    portable_url,
    resolve_path,
    resolve_url,
    storage_url_of,
)
from optimizer.trial_view import TrialView, metric_names
from search_spaces.speculation import stated_acceptance

__all__ = [
    "SyncSummary",
    "Tracker",
    "TrackingTarget",
    "experiment_name",
    "local_tracking_uri",
    "log_export",
    "log_stability",
    "review_url",
    "runs_url",
    "sync_study",
    "tracker_for_plan",
    "ui_command",
]

_log = logging.getLogger(__name__)

STUDY_TAG = "vllm_autotune.study"
TRIAL_TAG = "vllm_autotune.trial"
ROLE_TAG = "vllm_autotune.role"
_ARTIFACTS_TAG = "vllm_autotune.artifacts"
_DIGEST_TAG = "vllm_autotune.digest"
_INPUTS_TAG = "vllm_autotune.inputs"
_STABILITY_TAG = "vllm_autotune.stability"
_PARENT_TAG = "mlflow.parentRunId"
_NOTE_TAG = "mlflow.note.content"
_RUN_NAME_TAG = "mlflow.runName"
# MLflow 3 opens an experiment on its GenAI (traces) pages unless it is marked as a model
# development experiment (the tag below; MLflow UIs with the GenAI / machine learning switch in
# the sidebar read the switch instead, which the ``workflowType`` URL parameter sets).
_EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
_EXPERIMENT_KIND = "custom_model_development"
# The runs table's columns: MLflow (3.15+) has no default-columns setting, but it opens a view
# saved as an experiment tag when the URL names it (its "Views" menu lists it too).
_VIEW_KEY = "vllm-autotune"
_VIEW_TAG = f"mlflow.sharedViewState.{_VIEW_KEY}"
_RUNS_VIEW_QUERY = f"workflowType=machine_learning&viewStateShareKey={_VIEW_KEY}"

REVIEW_DIR = "review"
_MAX_PARAM = 6000
_MAX_TAG = 7900
_BATCH = 200


# --- where to log --------------------------------------------------------------------------------


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


def _relative(path: Path) -> str:
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
            f"mlflow ui --backend-store-uri sqlite:///{_relative(db)} "
            f"--default-artifact-root {_relative(root)}"
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
        return runs_url(experiment_id, _redact(target.tracking_uri))
    return runs_url(experiment_id)


def _redact(text: str) -> str:
    """A URL as a team may see it: its password and secret query values (``?password=``,
    ``?token=``, ...) masked, by the service's one rule
    (:func:`optimizer.service.security.redact_url`)."""
    from optimizer.service.security import redact_url

    return redact_url(text) or text


def _redact_job(job: dict[str, Any]) -> dict[str, Any]:
    """A job as a team may see it: its URLs as :func:`_redact` shows them, secret env values
    masked (:func:`optimizer.service.security.redact_job`)."""
    from optimizer.service.security import redact_job

    return redact_job(job)


def experiment_name(plan: StudyPlan, team: str | None = None) -> str:
    """The MLflow experiment of a study: ``mlflow.experiment``, else the job's name; in the
    service behind its team's prefix (``TEAM/NAME``), which the job cannot choose: a team
    name holds no ``/``, so ``beta/alpha/x`` is beta's, never alpha's."""
    name = plan.job.mlflow.experiment or plan.job.name
    return f"{team}/{name}" if team else name


def _target_from_plan(plan: StudyPlan, team: str | None = None) -> TrackingTarget:
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


def _write_review_inputs(plan: StudyPlan, target: TrackingTarget) -> None:
    """Write what the parent run shows into ``<out>/review`` (so mlflow-sync can re-log it)."""
    from optimizer.workload.stats import inspect_trace

    folder = plan.out / REVIEW_DIR
    folder.mkdir(parents=True, exist_ok=True)
    job = plan.job.model_dump(mode="json")
    # Server env may hold secrets (config.EngineSection): keep the names, never the values.
    job["engine"]["env"] = {k: "***" for k in job["engine"].get("env", {})}
    if job.get("storage"):
        job["storage"] = _redact(job["storage"])
    if job.get("mlflow", {}).get("tracking_uri"):
        job["mlflow"]["tracking_uri"] = _redact(job["mlflow"]["tracking_uri"])
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


def _bound_http_retries() -> None:
    """Keep MLflow's own HTTP retries short; the tracker's thread does the patient retrying.

    MLflow reads these variables on every request, and by default retries for minutes; it also
    prints a "View run at" line per finished run to stdout, into the tuner's progress output.
    Values a user has set win.
    """
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def _adopt_copied_store(target: TrackingTarget) -> None:
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


# --- the MLflow side -----------------------------------------------------------------------------


@dataclass
class _Run:
    run_id: str
    status: str
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    start_time: int = 0


@dataclass(frozen=True)
class SyncSummary:
    """What :func:`sync_study` did.

    Attributes:
        experiment_id: The MLflow experiment.
        parent_run_id: The study's parent run.
        trials: Trials in the Optuna storage.
        created: Child runs created.
        updated: Child runs that already existed (brought up to date).
        duplicates_deleted: Extra runs of the same trial (or study) deleted.
        front: Trial numbers of the feasible Pareto front.
        runs_url: Where the runs table opens (:func:`review_url`).
    """

    experiment_id: str
    parent_run_id: str
    trials: int
    created: int
    updated: int
    duplicates_deleted: int
    front: tuple[int, ...]
    runs_url: str = ""


#: Trial outcomes that measured nothing because the study (not the engine) stopped them.
_NOT_RUN_STATUSES = ("rejected", "duplicate", "cancelled", "infeasible")


def _review_view(objectives: list[str]) -> str:
    """The saved runs-table view: each objective and its gain (parent run), class, duration."""
    names = [str(o).rsplit(":", 1)[-1] for o in objectives]
    cols = [f"metrics.`{n}`" for n in names] + [f"metrics.`gain_pct.{n}`" for n in names]
    state = {"selectedColumns": [*cols, "tags.`class`", "attributes.`Duration`"]}
    now = int(time.time() * 1000)
    view = {"name": "vllm-autotune review", "createdAt": now, "state": json.dumps(state)}
    return json.dumps(view)


def _run_status(t: FrozenTrial) -> str:
    """The child run's MLflow status, so the runs list tells good trials from the others at a
    glance: FINISHED for a full measurement (SLOs met or not), FAILED when the engine or the
    replay failed, KILLED when the study stopped or refused it (rejected, duplicate, cancelled,
    stopped early as infeasible)."""
    status = TrialView(t).status
    if status in _NOT_RUN_STATUSES:
        return "KILLED"
    if status in FAILED_STATUSES or t.state == TrialState.FAIL or not TrialView(t).measured:
        return "FAILED"
    return "FINISHED"


def _run_name(t: FrozenTrial) -> str:
    """``baseline`` / ``trial-0007``, with what went wrong appended when something did
    (``trial-0007 rejected``, ``trial-0003 slo missed``): the runs list shows it unexpanded."""
    view = TrialView(t)
    name = "baseline" if view.is_baseline else f"trial-{t.number:04d}"
    if t.state == TrialState.FAIL and view.status in ("running", "fail"):
        return f"{name} failed"
    if not view.measured:
        return f"{name} {view.status.replace('_', ' ')}"
    if not view.feasible:
        return f"{name} slo missed"
    return name


def _ms(dt: Any) -> int | None:
    return int(dt.timestamp() * 1000) if dt is not None else None


def _param_value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return text[:_MAX_PARAM]


def _note(markdown: str) -> str:
    """A run description within MLflow's tag limit, saying where the rest is when cut."""
    if len(markdown) <= _MAX_TAG:
        return markdown
    tail = "\n\n… (cut here: the whole text is the run's `report.md` artifact)\n"
    return markdown[: _MAX_TAG - len(tail)].rsplit("\n", 1)[0] + tail


def _tag_value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text[:_MAX_TAG]


class _Syncer:
    """Brings one study's MLflow runs in line with its Optuna storage (idempotent)."""

    def __init__(self, target: TrackingTarget) -> None:
        self.target = target
        self.client = MlflowClient(tracking_uri=target.tracking_uri)
        self.experiment_id: str | None = None
        self.parent: _Run | None = None
        self.children: dict[int, _Run] = {}
        self.duplicates_deleted = 0
        self.created = 0
        self._study: optuna.Study | None = None

    # connection ------------------------------------------------------------------------------

    def study(self) -> optuna.Study:
        if self._study is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = create_storage(self.target.storage_url)
            self._study = optuna.load_study(study_name=self.target.study, storage=storage)
        return self._study

    def connect(self) -> None:
        if self.parent is not None:
            return
        _adopt_copied_store(self.target)
        exp = self.client.get_experiment_by_name(self.target.experiment)
        if exp is None:
            root = self.target.artifact_root
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(
                self.target.experiment,
                artifact_location=root.as_uri() if root else None,
                tags={_EXPERIMENT_KIND_TAG: _EXPERIMENT_KIND},
            )
        else:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            self.experiment_id = exp.experiment_id
            if _EXPERIMENT_KIND_TAG not in exp.tags:  # a user's own choice of kind stays
                self.client.set_experiment_tag(
                    exp.experiment_id, _EXPERIMENT_KIND_TAG, _EXPERIMENT_KIND
                )
        runs = self._search(f"tags.`{ROLE_TAG}` = 'study'")
        parent = self._dedupe(runs)
        if parent is None:
            run = self.client.create_run(
                self.experiment_id,
                tags={
                    STUDY_TAG: self.target.study,
                    ROLE_TAG: "study",
                    _RUN_NAME_TAG: self.target.study,
                },
                run_name=self.target.study,
            )
            parent = _Run(run.info.run_id, run.info.status, tags=dict(run.data.tags))
        self.parent = parent
        by_trial: dict[int, list[_Run]] = {}
        for r in self._search(f"tags.`{ROLE_TAG}` = 'trial'"):
            try:
                by_trial.setdefault(int(r.tags.get(TRIAL_TAG, "")), []).append(r)
            except ValueError:
                continue
        for number, group in by_trial.items():
            kept = self._dedupe(group)
            if kept is not None:
                self.children[number] = kept

    def _search(self, extra: str) -> list[_Run]:
        assert self.experiment_id is not None
        study = self.target.study.replace("'", "\\'")
        flt = f"tags.`{STUDY_TAG}` = '{study}' and {extra}"
        out: list[_Run] = []
        token: str | None = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=flt,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=1000,
                order_by=["attributes.start_time ASC"],
                page_token=token,
            )
            for run in page:
                out.append(
                    _Run(
                        run.info.run_id,
                        run.info.status,
                        params=dict(run.data.params),
                        metrics=dict(run.data.metrics),
                        tags=dict(run.data.tags),
                        start_time=int(run.info.start_time or 0),
                    )
                )
            token = page.token
            if not token:
                return out

    def _dedupe(self, runs: list[_Run]) -> _Run | None:
        """Keep the oldest run; delete the others (left by a crash between create and tag)."""
        if not runs:
            return None
        runs = sorted(runs, key=lambda r: (r.start_time, r.run_id))
        for extra in runs[1:]:
            self.client.delete_run(extra.run_id)
            self.duplicates_deleted += 1
        return runs[0]

    # writing ---------------------------------------------------------------------------------

    def _log(
        self,
        run: _Run,
        *,
        params: dict[str, str] | None = None,
        metrics: dict[str, float] | None = None,
        tags: dict[str, str] | None = None,
        step: int = 0,
        timestamp_ms: int | None = None,
    ) -> None:
        """Log only what differs from what the run has (params are immutable: missing only)."""
        ts = timestamp_ms or int(time.time() * 1000)
        new_params = [Param(k, v) for k, v in (params or {}).items() if k not in run.params]
        new_metrics = [
            Metric(k, v, ts, step)
            for k, v in (metrics or {}).items()
            if k not in run.metrics or not math.isclose(run.metrics[k], v, rel_tol=1e-9)
        ]
        new_tags = [RunTag(k, v) for k, v in (tags or {}).items() if run.tags.get(k) != v]
        while new_params or new_metrics or new_tags:
            p, new_params = new_params[:100], new_params[100:]
            m, new_metrics = new_metrics[:_BATCH], new_metrics[_BATCH:]
            t, new_tags = new_tags[:100], new_tags[100:]
            self.client.log_batch(run.run_id, metrics=m, params=p, tags=t)
            run.params.update({x.key: x.value for x in p})
            run.metrics.update({x.key: x.value for x in m})
            run.tags.update({x.key: x.value for x in t})

    def sync_trial(self, t: FrozenTrial, front: set[int]) -> bool:
        """Create or update the child run of one finished trial; returns True when created."""
        self.connect()
        assert self.parent is not None and self.experiment_id is not None
        if t.state in (TrialState.RUNNING, TrialState.WAITING):
            return False
        name = _run_name(t)
        run = self.children.get(t.number)
        created = run is None
        if run is None:
            info = self.client.create_run(
                self.experiment_id,
                start_time=_ms(t.datetime_start),
                tags={
                    STUDY_TAG: self.target.study,
                    TRIAL_TAG: str(t.number),
                    ROLE_TAG: "trial",
                    _PARENT_TAG: self.parent.run_id,
                    _RUN_NAME_TAG: name,
                },
                run_name=name,
            )
            run = _Run(info.info.run_id, info.info.status, tags=dict(info.data.tags))
            self.children[t.number] = run
            self.created += 1
        self._log(
            run,
            params=self._trial_params(t),
            metrics=self._trial_metrics(t),
            tags={**self._trial_tags(t, front), _RUN_NAME_TAG: name},
            timestamp_ms=_ms(t.datetime_complete),
        )
        if run.tags.get(_ARTIFACTS_TAG) != "uploaded":
            state = self._trial_artifacts(t, run)
            self._log(run, tags={_ARTIFACTS_TAG: state})
        status = _run_status(t)
        if run.status != status:
            self.client.set_terminated(run.run_id, status, end_time=_ms(t.datetime_complete))
            run.status = status
        return created

    def _trial_params(self, t: FrozenTrial) -> dict[str, str]:
        params = {k: _param_value(v) for k, v in TrialView(t).engine_args.items() if k.strip()}
        params["trial_number"] = str(t.number)
        if self.target.sampler:
            params["sampler"] = self.target.sampler
        return params

    def _trial_metrics(self, t: FrozenTrial) -> dict[str, float]:
        out: dict[str, float] = {}
        view = TrialView(t)
        for k, v in view.summary.items():
            if (n := finite(v)) is not None:
                out[str(k)] = n
        for k, value in (
            ("startup_s", view.startup_s),
            ("replay_s", view.replay_s),
            ("attempts", view.attempts),
        ):
            if (n := finite(value)) is not None:
                out[k] = n
        for phase, seconds in view.startup_phases.items():
            if (n := finite(seconds)) is not None:
                out[f"startup.{phase}_s"] = n
        for k, v in view.memory.items():
            if (n := finite(v)) is not None:
                out[str(k)] = n
        for k, v in view.server_metrics.items():
            if (n := finite(v)) is not None:
                out["server." + re.sub(r"[^\w.\-/ ]", "_", str(k).removeprefix("vllm:"))] = n
        return out

    def _trial_tags(self, t: FrozenTrial, front: set[int]) -> dict[str, str]:
        tags = {
            "state": TrialView(t).status,
            "baseline": str(TrialView(t).is_baseline).lower(),
            "pareto": str(t.number in front).lower(),
            "slo_met": str(TrialView(t).feasible).lower(),
            "class": trial_class(t, front),
        }
        view = TrialView(t)
        if view.failure_class:
            tags["failure_class"] = view.failure_class
        if view.capacity is not None:
            # The answer with its bracket: the estimate, how it was made, what was measured.
            tags["capacity"] = view.capacity.rps_text()
        if view.message:
            tags["message"] = _tag_value(view.message)
        if view.retry_of is not None:
            tags["retry_of"] = _tag_value(view.retry_of)
        if view.enqueued:
            tags["enqueued"] = _tag_value(True)
        missed = [k for k, v in t.constraints.items() if v > 0]
        if missed:
            tags["slo_missed"] = _tag_value(", ".join(missed))
        tags[_NOTE_TAG] = _tag_value(
            f"**{tags['state']}** ({tags['class']})\n\n"
            + "\n".join(f"- {line}" for line in diagnose(t, self._trace_stats()))
        )
        return tags

    def _trace_stats(self) -> dict[str, Any] | None:
        trace = _read_json(self.target.out / REVIEW_DIR / "trace.json")
        stats = trace.get("stats")
        return stats if isinstance(stats, dict) else None

    def _trial_artifacts(self, t: FrozenTrial, run: _Run) -> str:
        folder = self.target.out / "trials" / f"{t.number:04d}"
        attempts = sorted(
            (p for p in folder.glob("attempt-*") if p.is_dir()),
            key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name[8:].isdigit() else -1,
        )
        if not attempts:
            return "none"
        last = attempts[-1]
        logged = False
        for name in ("records.jsonl.gz", "engine.log", "result.json"):
            path = last / name
            if path.is_file():
                self.client.log_artifact(run.run_id, str(path))
                logged = True
        log_path = Path(TrialView(t).log_path)
        if log_path.name and log_path.is_file() and log_path.parent != last:
            self.client.log_artifact(run.run_id, str(log_path), "engine")
        records = last / "records.jsonl.gz"
        if records.is_file():
            with tempfile.TemporaryDirectory() as tmp:
                png = Path(tmp) / "latency_cdf.png"
                if latency_cdf(records, png):
                    self.client.log_artifact(run.run_id, str(png), "plots")
        return "uploaded" if logged else "none"

    def sync_parent_inputs(self) -> None:
        """The job, search space and trace description (once per parent run)."""
        self.connect()
        assert self.parent is not None
        folder = self.target.out / REVIEW_DIR
        meta = _read_json(folder / "mlflow.json")
        plan = _read_json(self.target.out / "plan.json")
        params = {
            "sampler": self.target.sampler,
            "model": str(meta.get("model") or ""),
            "search_space": str(meta.get("search_space") or ""),
            "objectives": ", ".join(plan.get("objectives", [])),
            "slos": ", ".join(plan.get("slos", [])),
            "trace": Path(str(plan.get("trace") or "")).name,
            "vllm": str(plan.get("vllm") or ""),
            "speculation_acceptance": stated_acceptance(plan) or "",
        }
        self._log(
            self.parent,
            params={k: _param_value(v) for k, v in params.items() if v},
            tags={"storage": _redact(self.target.storage_url)},
        )
        assert self.experiment_id is not None
        if _VIEW_TAG not in self.client.get_experiment(self.experiment_id).tags:  # edits stay
            view = _review_view(plan.get("objectives", []))
            self.client.set_experiment_tag(self.experiment_id, _VIEW_TAG, view)
        if self.parent.tags.get(_INPUTS_TAG) == "uploaded":
            return
        inputs = [folder / n for n in ("job.yaml", "search_space.yaml", "trace.json")]
        present = [p for p in inputs if p.is_file()]
        for p in present:
            self.client.log_artifact(self.parent.run_id, str(p), "inputs")
        if present:
            self._log(self.parent, tags={_INPUTS_TAG: "uploaded"})

    def sync_front(self, *, finished: bool | None = None) -> set[int]:
        """Re-tag children as the front changes; log progress metrics and the review files.

        Args:
            finished: Whether the study is over (parent run FINISHED) or still running; None
                infers it from the trials (none running: finished).
        """
        self.connect()
        assert self.parent is not None
        study = self.study()
        trials = study.get_trials(deepcopy=False)
        front = front_numbers(study)
        for number, run in self.children.items():
            want = str(number in front).lower()
            if run.tags.get("pareto") != want:
                self._log(run, tags={"pareto": want})
        self._progress(study, trials, front)
        digest = hashlib.sha256(
            json.dumps(
                [
                    (
                        t.number,
                        t.state.name,
                        t.values,
                        TrialView(t).status,
                        sorted(t.constraints.items()),
                    )
                    for t in trials
                ]
                + ([key] if (key := self._stability_key()) else []),
                default=str,
            ).encode()
        ).hexdigest()[:16]
        if self.parent.tags.get(_DIGEST_TAG) != digest:
            self._parent_artifacts(study, front)
            self._log(
                self.parent,
                tags={
                    _DIGEST_TAG: digest,
                    "pareto_trials": ",".join(str(n) for n in sorted(front)),
                    "trials": str(len(trials)),
                },
            )
        running = any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials)
        if finished is None:
            finished = not running
        want_status = "FINISHED" if finished else "RUNNING"
        if self.parent.status != want_status:
            if want_status == "FINISHED":
                self.client.set_terminated(self.parent.run_id, "FINISHED")
            else:
                self.client.update_run(self.parent.run_id, status="RUNNING")
            self.parent.status = want_status
        return front

    def _progress(self, study: optuna.Study, trials: list[FrozenTrial], front: set[int]) -> None:
        """Per finished trial (step = trial number): hypervolume, front size, bests."""
        assert self.parent is not None
        hv = hypervolume_history(trials, list(study.directions))
        history = self.client.get_metric_history(self.parent.run_id, "trials_done")
        logged = {int(m.step) for m in history}
        names = metric_names(study)
        done = sorted(
            (t for t in trials if t.state == TrialState.COMPLETE and t.datetime_complete),
            key=lambda t: (t.datetime_complete, t.number),
        )
        metrics: list[Metric] = []
        for k, t in enumerate(done):
            if t.number in logged:
                continue
            seen = done[: k + 1]
            feasible = [x for x in seen if TrialView(x).feasible]
            ts = _ms(t.datetime_complete) or int(time.time() * 1000)
            values = {"trials_done": float(k + 1), "feasible_trials": float(len(feasible))}
            if t.number in hv:
                values["hypervolume"] = hv[t.number]
            for i, (name, d) in enumerate(zip(names, study.directions, strict=True)):
                vals = [x.values[i] for x in feasible if x.values]
                if vals:
                    best = min(vals) if d == optuna.study.StudyDirection.MINIMIZE else max(vals)
                    values[f"best_{name}"] = best
            metrics += [Metric(key, v, ts, t.number) for key, v in values.items()]
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.parent.run_id, metrics=metrics[i : i + _BATCH])
        if metrics:
            self.parent.metrics.update({m.key: m.value for m in metrics})

    def _summary_metrics(
        self, study: optuna.Study, plan: dict[str, Any], gains: dict[str, tuple[float, int]]
    ) -> None:
        """Parent-run metrics: the front's best gain over the baseline per objective
        (``gain_pct.<objective>``, positive = better, and ``gain_trial.<objective>``); a capacity
        study's baseline and best capacity and the gain; every study's trial-time account (share
        replaying, median server start and its phases)."""
        from optimizer.analysis.capacity import answer_for_plan

        assert self.parent is not None
        from optimizer.analysis.trial_cost import study_cost

        answer = answer_for_plan(study, plan)
        cost = study_cost(study.get_trials(deepcopy=False))
        values = dict(answer.metrics()) if answer is not None else {}
        for name, (gain, trial) in gains.items():
            values[f"gain_pct.{name}"] = gain
            values[f"gain_trial.{name}"] = float(trial)
        for key, value in (
            ("trial_time.replay_share", cost.replay_share),
            ("trial_time.startup_share", cost.startup_share),
            ("trial_time.median_startup_s", cost.median_startup_s),
            *((f"trial_time.startup.{p}_s", s) for p, s in cost.median_phases.items()),
        ):
            if value is not None:
                values[key] = float(value)
        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, 0) for k, v in values.items()]
        if metrics:
            self.client.log_batch(self.parent.run_id, metrics=metrics)
            self.parent.metrics.update({m.key: m.value for m in metrics})

    def _parent_artifacts(self, study: optuna.Study, front: set[int]) -> None:
        assert self.parent is not None
        doc = front_doc(study)
        ranked = importances(study)
        plan = _read_json(self.target.out / "plan.json")
        trace = _read_json(self.target.out / REVIEW_DIR / "trace.json")
        hv = hypervolume_history(study.get_trials(deepcopy=False), list(study.directions))
        stability = _read_json(self.target.out / "stability.json") or None
        report = report_md(study, doc, front, hv, ranked, plan, trace, stability=stability)
        gains = best_gains(doc)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            pareto = root / "pareto"
            pareto.mkdir()
            (pareto / "front.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
            (pareto / "front.csv").write_text(front_csv(study, doc))
            try:
                plot_front(study, front, pareto)
            except Exception as exc:  # a plot must never stop the review
                _log.warning("MLflow: Pareto plots failed: %s", exc)
            (root / "importance.json").write_text(json.dumps(ranked, indent=2, default=str) + "\n")
            (root / "report.md").write_text(report)
            self._summary_metrics(study, plan, gains)
            if plan:
                for key in ("storage",):
                    if isinstance(plan.get(key), str):
                        plan[key] = _redact(plan[key])
                if isinstance(plan.get("job"), dict):  # its storage and MLflow URI too
                    plan["job"] = _redact_job(plan["job"])
                (root / "plan.json").write_text(json.dumps(plan, indent=2, default=str) + "\n")
            self.client.log_artifacts(self.parent.run_id, str(root))
        headline = headline_md(doc, gains, stability=stability)
        self._log(self.parent, tags={_NOTE_TAG: _note(headline + "\n" + report)})

    def _stability_key(self) -> str:
        """Which stability check the study folder holds ("" for none)."""
        doc = _read_json(self.target.out / "stability.json")
        if not doc:
            return ""
        return f"trial {doc.get('trial')} {doc.get('runs_dir')} {doc.get('written_at')}"

    def sync_stability(self, *, force: bool = False) -> bool:
        """The study folder's stability check on the parent run: its metrics and tags
        (:func:`~optimizer.stability.stored.tracking_values`; the worse-than-baseline tag
        removed when the check is not worse), ``stability.json`` and the check's plots as
        artifacts under ``stability/`` (once per check, or when forced), and the checked
        trial's child run tagged ``stability`` = status. False when there is no check."""
        from optimizer.stability.plots import runs_folder
        from optimizer.stability.stored import STABILITY_FILE, read_stability, tracking_values

        doc = read_stability(self.target.out)
        if doc is None or not doc.get("runs"):
            return False
        self.connect()
        assert self.parent is not None
        metrics, tags = tracking_values(doc)
        self._log(self.parent, metrics=metrics, tags=tags)
        worse_tag = "stability.worse_than_baseline"
        if worse_tag not in tags and worse_tag in self.parent.tags:
            self.client.delete_tag(self.parent.run_id, worse_tag)
            del self.parent.tags[worse_tag]
        key = self._stability_key()
        if force or self.parent.tags.get(_STABILITY_TAG) != key:
            files = [self.target.out / STABILITY_FILE]
            files += sorted(runs_folder(self.target.out, doc).glob("*.png"))
            for path in files:
                self.client.log_artifact(self.parent.run_id, str(path), "stability")
            self._log(self.parent, tags={_STABILITY_TAG: key})
        trial = doc.get("trial")
        child = self.children.get(trial) if isinstance(trial, int) else None
        if child is not None:
            self._log(child, tags={"stability": str(doc.get("status"))})
        return True

    def sync_all(self) -> SyncSummary:
        """Every finished trial, then the front and the parent's review files."""
        self.connect()
        assert self.parent is not None and self.experiment_id is not None
        self.sync_parent_inputs()
        study = self.study()
        trials = study.get_trials(deepcopy=False)
        front = front_numbers(study)
        existed = 0
        for t in trials:
            if t.state in (TrialState.RUNNING, TrialState.WAITING):
                continue
            if not self.sync_trial(t, front):
                existed += 1
        front = self.sync_front()
        self.sync_stability()
        return SyncSummary(
            experiment_id=self.experiment_id,
            parent_run_id=self.parent.run_id,
            trials=len(trials),
            created=self.created,
            updated=existed,
            duplicates_deleted=self.duplicates_deleted,
            front=tuple(sorted(front)),
            runs_url=review_url(self.target, self.experiment_id),
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --- the live tracker ----------------------------------------------------------------------------


_STOP = object()


class Tracker:
    """Logs a running study to MLflow from a background thread.

    :meth:`on_event` only puts the event on a queue, so the driver never waits for MLflow. The
    thread coalesces pending work (trials to log, front to refresh), retries failures with
    exponential backoff up to ``max_backoff_s`` between attempts, and keeps what it could not
    log; :meth:`close` waits a bounded time, after which ``vllm-autotune mlflow-sync`` logs the
    rest from the Optuna storage.

    Args:
        target: Study and MLflow experiment.
        base_backoff_s: First wait after a failure.
        max_backoff_s: Longest wait between attempts.
        close_timeout_s: How long :meth:`close` waits for the queue to drain.
        give_up_after: Consecutive failures after which :meth:`close` stops waiting.
    """

    def __init__(
        self,
        target: TrackingTarget,
        *,
        base_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        close_timeout_s: float = 60.0,
        give_up_after: int = 3,
    ) -> None:
        _bound_http_retries()
        self.target = target
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.close_timeout_s = close_timeout_s
        self.give_up_after = give_up_after
        self.failures = 0
        self.last_error = ""
        self._queue: queue.Queue[Any] = queue.Queue()
        self._abandon = threading.Event()
        self._closed = False
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._syncer: _Syncer | None = None
        self._thread = threading.Thread(target=self._run, name="mlflow-tracker", daemon=True)
        self._thread.start()
        self._queue.put(("inputs", None))

    @property
    def experiment_id(self) -> str | None:
        """The MLflow experiment, once the thread has reached MLflow."""
        syncer = self._syncer
        return syncer.experiment_id if syncer is not None else None

    @property
    def pending(self) -> set[int]:
        """Trial numbers not (yet) logged."""
        with self._lock:
            return set(self._pending)

    def on_event(self, event: StudyEvent) -> None:
        """Queue a driver event; never blocks, never raises."""
        if event.kind in ("finished", "rejected", "stale"):
            self._queue.put(("trial", event.number))

    def finish(self, study: optuna.Study | None = None) -> bool:
        """Queue the final refresh (parent marked finished), then :meth:`close`.

        Returns:
            True when everything was logged.
        """
        if not self._closed:
            self._queue.put(("finish", None))
        return self.close()

    def close(self, timeout_s: float | None = None) -> bool:
        """Drain the queue for at most ``timeout_s`` (default ``close_timeout_s``); idempotent.

        Returns early when MLflow failed ``give_up_after`` times in a row. Whatever is left is
        named in a warning with the command that logs it later.

        Returns:
            True when everything was logged.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        deadline = time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s)
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self.failures >= self.give_up_after:
                break
            self._thread.join(0.1)
        left = self.pending
        ok = not self._thread.is_alive() and not left and self.failures == 0
        if self._thread.is_alive():
            self._abandon.set()
            self._thread.join(1.0)
        if not ok:
            _log.warning(
                "MLflow: %s not fully logged (%s); the Optuna storage has everything: run "
                "`vllm-autotune mlflow-sync %s`",
                f"trials {sorted(left)}" if left else "the study",
                self.last_error or "timed out",
                _relative(self.target.out),
            )
        return ok

    def _run(self) -> None:
        inputs = finish = front = stopping = False
        while not self._abandon.is_set():
            busy = bool(inputs or finish or front or self._pending)
            items: list[Any] = []
            try:
                items.append(self._queue.get(timeout=0.05 if busy else 0.5))
                while True:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            for it in items:
                if it is _STOP:
                    stopping = True
                elif it[0] == "trial":
                    with self._lock:
                        self._pending.add(int(it[1]))
                    front = True
                elif it[0] == "finish":
                    finish = front = True
                elif it[0] == "inputs":
                    inputs = True
            if not (inputs or finish or front or self._pending):
                if stopping:
                    return
                continue
            try:
                syncer = self._syncer or _Syncer(self.target)
                self._syncer = syncer
                syncer.connect()
                if inputs:
                    syncer.sync_parent_inputs()
                    inputs = False
                if self._pending:
                    study = syncer.study()
                    trials = study.get_trials(deepcopy=False)
                    current = front_numbers(study)
                    for number in sorted(self.pending):
                        if number < len(trials):
                            syncer.sync_trial(trials[number], current)
                        with self._lock:
                            self._pending.discard(number)
                if front or finish:
                    syncer.sync_front(finished=finish)
                    front = finish = False
                self.failures = 0
                self.last_error = ""
            except Exception as exc:
                # Start over from the tags next time: a call that failed may still have
                # created a run, and a fresh search finds it instead of creating another.
                self._syncer = None
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                if self.failures == 1 or self.failures % 10 == 0:
                    _log.warning(
                        "MLflow at %s: %s (attempt %d; trials keep running, retrying)",
                        _redact(self.target.tracking_uri),
                        self.last_error,
                        self.failures,
                    )
                delay = min(self.base_backoff_s * 2 ** (self.failures - 1), self.max_backoff_s)
                self._abandon.wait(delay)


def tracker_for_plan(
    plan: StudyPlan, *, enabled: bool = True, team: str | None = None, **options: Any
) -> Tracker | None:
    """A :class:`Tracker` for a prepared study, or None when MLflow is off for it.

    Writes the review inputs (job, search space, trace statistics, MLflow target) to
    ``<out>/review`` so ``mlflow-sync`` can rebuild the same view later. Contacts nothing.
    Runs are keyed by the study's name in its storage (:attr:`StudyPlan.storage_name`).

    Args:
        plan: The prepared plan.
        enabled: False turns tracking off (``--no-mlflow``).
        team: The service's team whose study it is: its experiment is ``TEAM/NAME``
            (:func:`experiment_name`). None: the experiment as the job names it (``tune``).
        **options: Passed to :class:`Tracker` (backoff and close timeouts).
    """
    if not enabled or not plan.job.mlflow.enabled:
        return None
    target = _target_from_plan(plan, team)
    _write_review_inputs(plan, target)
    return Tracker(target, **options)


def sync_study(
    study_dir: str | Path,
    *,
    tracking_uri: str | None = None,
    experiment: str | None = None,
) -> SyncSummary:
    """(Re)build the MLflow view of a study folder from its Optuna storage; idempotent.

    Existing runs are found by their tags and updated, missing ones created, duplicates
    deleted. The target is the one the study was tuned with (``review/mlflow.json``), else the
    folder's local store; either can be overridden.

    Args:
        study_dir: A study folder written by ``tune`` (holds ``plan.json``).
        tracking_uri: Log here instead.
        experiment: Experiment name instead.

    Returns:
        What was done.

    Raises:
        ConfigError: Not a study folder.
    """
    return _Syncer(_target_for_dir(study_dir, tracking_uri, experiment)).sync_all()


def _target_for_dir(
    study_dir: str | Path, tracking_uri: str | None, experiment: str | None
) -> TrackingTarget:
    _bound_http_retries()
    folder = Path(study_dir).resolve()
    plan = _read_json(folder / "plan.json")
    if not plan.get("study") or not plan.get("storage"):
        raise ConfigError(f"{folder}: no plan.json here; give a study folder written by `tune`")
    meta = _read_json(folder / REVIEW_DIR / "mlflow.json")
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


def log_export(
    study_dir: str | Path,
    *,
    trial: int,
    fmt: str,
    path: str | Path,
    policy: str,
    gain: str,
) -> bool:
    """Record an export on the study's MLflow parent run and tag the exported trial's run.

    The export file becomes an artifact of the parent run (``exports/``), the parent gets
    ``exported.<format>`` = trial, and the trial's child run gets ``exported`` = format. Never
    raises for MLflow trouble: the export itself already succeeded.

    Returns:
        True when MLflow took it.
    """
    try:
        syncer = _Syncer(_target_for_dir(study_dir, None, None))
        syncer.connect()
        if trial not in syncer.children:
            syncer.sync_all()
        assert syncer.parent is not None
        client = syncer.client
        client.log_artifact(syncer.parent.run_id, str(path), artifact_path="exports")
        client.set_tag(syncer.parent.run_id, f"exported.{fmt}", str(trial))
        client.set_tag(syncer.parent.run_id, f"exported.{fmt}.gain", gain[:_MAX_TAG])
        client.set_tag(syncer.parent.run_id, f"exported.{fmt}.policy", policy)
        child = syncer.children.get(trial)
        if child is not None:
            client.set_tag(child.run_id, "exported", fmt)
    except Exception as exc:
        _log.warning(
            "could not log the export to MLflow (%s); `vllm-autotune mlflow-sync` "
            "rebuilds the view later",
            exc,
        )
        return False
    return True


def log_stability(study_dir: str | Path) -> str | None:
    """Log the study folder's stability check to its MLflow parent run (found, like
    :func:`log_export`'s, through the folder's ``review/mlflow.json``): metrics, tags, the
    report and description with their "Stability check" section, ``stability.json`` and the
    plots as artifacts. Never raises for MLflow trouble: the check itself already succeeded.

    Returns:
        Where it went (``run ID of experiment NAME``, and the runs table's address), or None
        when MLflow did not take it or there is no check.
    """
    try:
        target = _target_for_dir(study_dir, None, None)
        syncer = _Syncer(target)
        syncer.connect()
        doc = _read_json(target.out / "stability.json")
        if doc.get("trial") not in syncer.children:
            syncer.sync_all()
        else:
            syncer.sync_front()  # the report and description, with the check in them
        if not syncer.sync_stability(force=True):
            return None
        assert syncer.parent is not None and syncer.experiment_id is not None
    except Exception as exc:
        _log.warning(
            "could not log the stability check to MLflow (%s); `vllm-autotune stability DIR "
            "--replot` or `vllm-autotune mlflow-sync DIR` logs it later",
            exc,
        )
        return None
    return (
        f"run {syncer.parent.run_id} of experiment {target.experiment!r}, "
        f"{review_url(target, syncer.experiment_id)}"
    )
