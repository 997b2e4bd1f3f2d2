"""One JSON document for a study folder written by ``vllm-autotune tune``: per trial its
configuration, status, failure class, startup and replay time, the headline metrics, the memory
account, and whether it is feasible / on the Pareto front. Used by benchmarks/gpu_study.sh.

Usage: python benchmarks/study_summary.py STUDY_FOLDER > summary.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import optuna

from optimizer.study import create_storage
from optimizer.study_folder import storage_url_of
from optimizer.trial_view import TrialView, feasible_front

KEYS = (
    "completed",
    "failed",
    "p50_ttft_ms",
    "p95_ttft_ms",
    "p99_ttft_ms",
    "p95_ttft_from_scheduled_ms",
    "p50_tpot_ms",
    "p95_tpot_ms",
    "p95_itl_ms",
    "output_throughput",
    "request_throughput",
    "goodput",
    "duration_s",
    "p99_send_lag_ms",
)


def _clean(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def summarize_study(folder: Path) -> dict[str, Any]:
    plan = json.loads((folder / "plan.json").read_text())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = create_storage(storage_url_of(plan, folder.resolve()))
    study = optuna.load_study(study_name=plan["study"], storage=storage)
    front = {t.number for t in feasible_front(study)}
    trials = []
    for t in study.get_trials(deepcopy=False):
        v = TrialView(t)
        summary = v.summary
        trials.append(
            {
                "number": t.number,
                "state": t.state.name,
                "baseline": v.is_baseline,
                "status": v.status,
                "failure_class": v.failure_class or None,
                "message": v.message or None,
                "engine_args": v.engine_args if v.engine_args_key is not None else None,
                "startup_s": v.startup_s,
                "replay_s": v.replay_s,
                "attempts": v.attempts,
                "metrics": {k: _clean(summary.get(k)) for k in KEYS if k in summary},
                "memory": v.memory or None,
                "server_metrics": v.server_metrics or None,
                "values": [_clean(x) for x in t.values] if t.values else None,
                "constraints": dict(t.constraints),
                "feasible": v.feasible,
                "on_front": t.number in front,
                "capacity": v.capacity_doc,
                "started": t.datetime_start.isoformat() if t.datetime_start else None,
                "completed": t.datetime_complete.isoformat() if t.datetime_complete else None,
            }
        )
    return {
        "study": plan["study"],
        "vllm": plan.get("vllm"),
        "requests": plan.get("requests"),
        "trace_notes": plan.get("trace_notes"),
        "baseline_args": plan.get("baseline_args"),
        "slos": plan.get("slos"),
        "objectives": plan.get("objectives"),
        "started_at": plan.get("started_at"),
        "trials": trials,
    }


if __name__ == "__main__":
    print(json.dumps(summarize_study(Path(sys.argv[1])), indent=2, default=str))
