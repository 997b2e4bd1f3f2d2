"""MLflow review of a study: one parent run per study, one nested child run per trial.

The Optuna storage stays the source of truth; MLflow is a view of it, rebuilt idempotently.

- :mod:`.target`: where a study's review goes (experiment, store, the review's inputs beside
  the study, the UI's address); no MLflow import;
- :mod:`.sync`: the study's runs brought in line with its Optuna storage, once
  (:func:`sync_study`, ``vllm-autotune mlflow-sync DIR``) or for an export and a stability
  check (:func:`log_export`, :func:`log_stability`); the only module that imports mlflow;
- :mod:`.live`: :class:`Tracker`, the same from a background thread while a study runs, so a
  slow or unreachable tracking server never delays a trial.

The default store is local: ``sqlite:///<out>/mlflow.db`` with artifacts in
``<out>/mlartifacts``; ``mlflow.tracking_uri`` in the job points at a team's server instead.
Runs are keyed by the study's name in its storage (a service study's is ``TEAM/ID``), and a
service study's experiment is behind its team's prefix (``TEAM/NAME``: :func:`experiment_name`),
so two teams' jobs of one name never share an experiment or a run.
"""

from optimizer.tracking.live import Tracker, tracker_for_plan
from optimizer.tracking.sync import SyncSummary, log_export, log_stability, sync_study
from optimizer.tracking.target import (
    TrackingTarget,
    experiment_name,
    local_tracking_uri,
    review_url,
    runs_url,
    ui_command,
)

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
