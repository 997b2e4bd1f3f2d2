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
from optuna.trial import TrialState

from optimizer.study import create_storage

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
    study = optuna.load_study(study_name=plan["study"], storage=create_storage(plan["storage"]))
    front = {t.number for t in study.best_trials}
    trials = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        summary = ua.get("summary") or {}
        trials.append(
            {
                "number": t.number,
                "state": t.state.name,
                "baseline": bool(ua.get("baseline")),
                "status": ua.get("status"),
                "failure_class": ua.get("failure_class"),
                "message": ua.get("message"),
                "engine_args": json.loads(ua["engine_args"]) if "engine_args" in ua else None,
                "startup_s": ua.get("startup_s"),
                "replay_s": ua.get("replay_s"),
                "attempts": ua.get("attempts"),
                "metrics": {k: _clean(summary.get(k)) for k in KEYS if k in summary},
                "memory": ua.get("memory"),
                "server_metrics": ua.get("server_metrics"),
                "values": [_clean(v) for v in t.values] if t.values else None,
                "constraints": dict(t.constraints),
                "feasible": t.state == TrialState.COMPLETE
                and bool(t.constraints)
                and all(c <= 0 for c in t.constraints.values()),
                "on_front": t.number in front,
                "capacity": ua.get("capacity"),
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
