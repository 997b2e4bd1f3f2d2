"""Judge a stored stability check again (``vllm-autotune stability DIR --rejudge``): the
verdicts recomputed from what the check stored (``stability.json``'s plan, each run's
``records.jsonl.gz`` and ``samples.jsonl``) with the verdict rules installed now, so a change
of the rules does not cost a new run of minutes or tens of minutes. Nothing is measured again;
the document says when it was re-judged."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from objectives import parse_slo
from optimizer.errors import ConfigError
from optimizer.stability.plan import (
    Phase,
    PlanSettings,
    StabilityPlan,
    build_load,
    with_trace,
)
from optimizer.stability.verdicts import Verdict, compare, evaluate, overall, windows

__all__ = ["plan_from_doc", "rejudge"]


def plan_from_doc(doc: Mapping[str, Any]) -> StabilityPlan:
    """The plan a ``stability.json`` recorded (``StabilityPlan.doc``'s inverse).

    Raises:
        ConfigError: A plan this version cannot read.
    """
    try:
        settings = PlanSettings(**doc["settings"])
        return StabilityPlan(
            phases=tuple(Phase(**p) for p in doc["phases"]),
            base_scale=float(doc["base_scale"]),
            burst_scale=float(doc["burst_scale"]),
            max_model_len=int(doc["max_model_len"]),
            long_input_tokens=int(doc["long_input_tokens"]),
            settings=settings,
            trace_period_s=doc.get("trace_period_s"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"stability.json: a plan this version cannot read ({exc})") from exc


def _judge_run(
    where: Path, plan: StabilityPlan, long_input: tuple[bool, ...], slos: tuple[Any, ...]
) -> tuple[list[Verdict], list[dict[str, Any]]]:
    from optimizer.stability.plots import read_samples
    from optimizer.trial_io import read_records

    records_file = where / "records.jsonl.gz"
    if not records_file.is_file():
        raise ConfigError(f"{records_file}: missing; the run cannot be judged again")
    records = read_records(records_file)
    if len(records) != len(long_input):
        raise ConfigError(
            f"{records_file}: {len(records)} requests, the plan makes {len(long_input)}: the "
            "study's trace or plan changed since the check"
        )
    verdicts = evaluate(records, long_input, read_samples(where / "samples.jsonl"), plan, slos)
    return verdicts, [asdict(w) for w in windows(records, plan, slos)]


def rejudge(folder: Path, saved: Mapping[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    """The check's verdicts, statuses and comparison recomputed from its stored runs;
    ``stability.json`` rewritten and returned.

    Raises:
        ConfigError: A run's stored files are missing or do not match the plan.
    """
    from optimizer.stability.plots import runs_folder
    from optimizer.stability.run import finite
    from optimizer.stability.stored import STABILITY_FILE
    from optimizer.stability_check.workflow import prepare_plan

    study_plan = prepare_plan(folder, saved)
    plan = plan_from_doc(doc.get("plan") or {})
    if plan.trace_period_s is None:
        plan = with_trace(plan, study_plan.trace)
    long_input = build_load(study_plan.trace, plan).long_input
    slos = tuple(parse_slo(str(s)) for s in (doc.get("slos") or study_plan.objectives.slos))
    judged: dict[str, list[Verdict]] = {}
    for label, run in (doc.get("runs") or {}).items():
        if run.get("failure"):
            continue
        verdicts, wins = _judge_run(runs_folder(folder, doc) / label, plan, long_input, slos)
        run.update(
            verdicts=finite([asdict(v) for v in verdicts]),
            windows=finite(wins),
            status=overall(verdicts),
        )
        judged[label] = verdicts
    doc["plan"] = plan.doc()
    chosen = (doc.get("runs") or {}).get("chosen")
    if chosen is not None:
        doc["status"] = chosen["status"]
    if "chosen" in judged and "baseline" in judged:
        doc["worse_than_baseline"] = compare(judged["chosen"], judged["baseline"])
    doc["rejudged_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    (Path(folder) / STABILITY_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    return doc
