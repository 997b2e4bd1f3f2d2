"""The MLflow side of a study's review: its runs brought in line with its Optuna storage.

The Optuna storage stays the source of truth; MLflow is a view of it, rebuilt idempotently.
:class:`Syncer` finds a study's runs by their tags (``vllm_autotune.study``,
``vllm_autotune.trial``), creates what is missing, updates what is there and deletes duplicates,
so running it twice creates nothing new. :func:`sync_study` (``vllm-autotune mlflow-sync DIR``)
runs it once over a study folder; :func:`log_export` and :func:`log_stability` add an export and
a stability check to the study's parent run; :class:`optimizer.tracking.live.Tracker` runs it
from a background thread while a study runs.

The parent run holds the job, the search space, the trace's statistics and shaping notes, a
hypervolume-over-trials metric, the Pareto front (JSON, CSV, plots), parameter importances and
a Markdown report (baseline vs front, gain per objective, what the winners changed, a diagnosis
per trial class), and the study folder's stability check when there is one (its metrics, tags,
``stability.json`` and plots); :mod:`optimizer.analysis` and :mod:`optimizer.stability` make
every one of them, this module only logs.
Each child run holds the engine configuration (params), the whole summary,
startup/replay times, the memory account and server metrics (metrics), the trial's state,
failure class, baseline / Pareto / SLO tags, and its records, engine log and latency CDF.

Uses :class:`mlflow.tracking.MlflowClient` with explicit run ids, never the fluent API
(DESIGN.md §7.9). This is the only module that imports mlflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
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
from optimizer.study import create_storage
from optimizer.tracking.target import (
    REVIEW_DIR,
    VIEW_TAG,
    TrackingTarget,
    adopt_copied_store,
    read_json,
    redact,
    redact_job,
    review_url,
    target_for_dir,
)
from optimizer.trial_view import TrialView, metric_names, quality_verdicts
from search_spaces.speculation import stated_acceptance

__all__ = [
    "ROLE_TAG",
    "STUDY_TAG",
    "TRIAL_TAG",
    "SyncSummary",
    "Syncer",
    "log_export",
    "log_stability",
    "sync_study",
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

_MAX_PARAM = 6000
_MAX_TAG = 7900
_BATCH = 200


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
        runs_url: Where the runs table opens (:func:`~optimizer.tracking.target.review_url`).
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
_NOT_RUN_STATUSES = ("rejected", "duplicate", "cancelled", "infeasible", "lost")


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
    stopped early as infeasible, lost with its node)."""
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


class Syncer:
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
        adopt_copied_store(self.target)
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

    def _sync_quality(self, study: optuna.Study) -> None:
        """The quality gate's verdict on each checked trial's run: tags ``quality`` and
        ``quality.reason``, metrics ``quality.top1_agreement``, ``quality.logprob_drift`` and
        ``quality.floor_drift`` (a refused configuration named with its numbers)."""
        for number, doc in quality_verdicts(study).items():
            run = self.children.get(number)
            if run is None:
                continue
            comparison = doc.get("comparison") or {}
            floor = doc.get("floor") or {}
            metrics = {
                name: n
                for name, value in (
                    ("quality.top1_agreement", comparison.get("top1_agreement")),
                    ("quality.logprob_drift", comparison.get("mean_abs_logprob_diff")),
                    ("quality.floor_drift", floor.get("mean_abs_logprob_diff")),
                )
                if (n := finite(value)) is not None
            }
            tags = {
                "quality": str(doc.get("status")),
                "quality.reason": _tag_value(doc.get("reason", "")),
            }
            self._log(run, metrics=metrics, tags=tags)

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
        trace = read_json(self.target.out / REVIEW_DIR / "trace.json")
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
        meta = read_json(folder / "mlflow.json")
        plan = read_json(self.target.out / "plan.json")
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
            tags={"storage": redact(self.target.storage_url)},
        )
        assert self.experiment_id is not None
        if VIEW_TAG not in self.client.get_experiment(self.experiment_id).tags:  # edits stay
            view = _review_view(plan.get("objectives", []))
            self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, view)
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
        self._sync_quality(study)
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
        plan = read_json(self.target.out / "plan.json")
        trace = read_json(self.target.out / REVIEW_DIR / "trace.json")
        hv = hypervolume_history(study.get_trials(deepcopy=False), list(study.directions))
        stability = read_json(self.target.out / "stability.json") or None
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
                        plan[key] = redact(plan[key])
                if isinstance(plan.get("job"), dict):  # its storage and MLflow URI too
                    plan["job"] = redact_job(plan["job"])
                (root / "plan.json").write_text(json.dumps(plan, indent=2, default=str) + "\n")
            self.client.log_artifacts(self.parent.run_id, str(root))
        headline = headline_md(doc, gains, stability=stability)
        self._log(self.parent, tags={_NOTE_TAG: _note(headline + "\n" + report)})

    def _stability_key(self) -> str:
        """Which stability check the study folder holds ("" for none)."""
        doc = read_json(self.target.out / "stability.json")
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
    return Syncer(target_for_dir(study_dir, tracking_uri, experiment)).sync_all()


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
        syncer = Syncer(target_for_dir(study_dir, None, None))
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
        target = target_for_dir(study_dir, None, None)
        syncer = Syncer(target)
        syncer.connect()
        doc = read_json(target.out / "stability.json")
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
