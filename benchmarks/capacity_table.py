"""The ground-truth table of the search-efficiency benchmark, from capacity studies' folders.

Every trial of the given study folders (a grid study and its repeats, made with
``benchmarks/data/cpu-capacity-grid.yaml``) becomes one measurement of its configuration: the
steps of its capacity search (scale, verdict, stopped early, deciding margin, replay seconds),
its server's start, its wall time, its capacity estimated from the steps with the
project's own :func:`optimizer.capacity.search.estimate_capacity` (so folders written before
the estimate existed read the same as later ones), the SLO that broke first above it
(``broke_first``) and the symptom the tuning guide reads there
(:func:`optimizer.guided.symptom_of`: ``symptom``, None where nothing broke). Measurements of
one configuration across folders are its repeats: their spread is the table's noise. A grid
label a study refused before any server started (an invalid combination, such as chunked
prefill off with a token budget under the context: status ``rejected``) is listed under
``refused``, a label with nothing to measure.

Usage:
    python -m benchmarks.capacity_table runs/capacity-grid/r1 runs/capacity-grid/r2 \
        --out benchmarks/data/capacity_table_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from optimizer.capacity.search import StepOutcome, estimate_capacity
from optimizer.cli_support import load_study_dir
from optimizer.engine.stack import recorded_stack
from optimizer.guided import symptom_of
from optimizer.trial_view import TrialView

# Engine arguments the first tables' trials shared (the job's, and the grids' fixed block
# size), left out of the key of a configuration that set no params (the baseline).
_COMMON = ("enforce-eager", "load-format", "max-model-len", "block-size")


def config_key(args: dict[str, Any], params: dict[str, Any] | None = None) -> str:
    """A configuration's identity in the table: its grid params (the sampler's: a space's
    fixed arguments and the job's own are not among them), else (the baseline, which sets
    none) its engine arguments minus :data:`_COMMON`. The third grid varies the block size,
    which the first two fixed: keyed on the arguments its two block sizes would be one."""
    if params:
        return json.dumps(dict(sorted(params.items())), sort_keys=True)
    return json.dumps({k: v for k, v in sorted(args.items()) if k not in _COMMON}, sort_keys=True)


def _steps(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for step in doc.get("steps") or []:
        margins = [m for m in (step.get("margins") or {}).values()]
        deciding = math.inf if not margins or None in margins else max(margins)
        out.append(
            {
                "scale": float(step["scale"]),
                "passed": bool(step["passed"]),
                "stopped_early": bool(step.get("stopped_early")),
                "margin": deciding if math.isfinite(deciding) else None,
                "replay_s": float(step.get("replay_s") or 0.0),
            }
        )
    return out


def measurement(trial: FrozenTrial, noise: float) -> dict[str, Any] | None:
    """One trial as a measurement of its configuration (None: nothing was measured)."""
    view = TrialView(trial)
    doc = trial.user_attrs.get("capacity")
    if trial.state != TrialState.COMPLETE or not isinstance(doc, dict) or view.status != "complete":
        return None
    steps = _steps(doc)
    outcomes = [
        StepOutcome(
            s["scale"],
            {"deciding": s["margin"] if s["margin"] is not None else math.inf},
            stopped_early=s["stopped_early"],
        )
        for s in steps
    ]
    lo = float(doc.get("lo") or 0.0)
    hi = float(doc["hi"]) if doc.get("hi") is not None else math.inf
    est = estimate_capacity(outcomes, lo, hi, noise)
    first = next((s for s in doc.get("steps") or [] if s.get("offered_rps")), None)
    per_scale = float(first["offered_rps"]) / float(first["scale"]) if first else math.nan
    done, began = trial.datetime_complete, trial.datetime_start
    assert done is not None and began is not None  # a complete trial has both
    wall = (done - began).total_seconds()
    return {
        "trial": trial.number,
        "baseline": view.is_baseline,
        "capacity_scale": est.scale,
        "capacity_rps": est.scale * per_scale,
        "lo": lo,
        "hi": hi if math.isfinite(hi) else None,
        "method": est.method,
        "rps_per_scale": per_scale,
        "startup_s": float(trial.user_attrs.get("startup_s") or 0.0),
        "wall_s": wall,
        "attempts": int(trial.user_attrs.get("attempts") or 1),
        "steps": steps,
        "broke_first": doc.get("broke_first"),
        "symptom": symptom_of(trial),
    }


#: What a repeat's machine and stack must share with the others' to be one table.
_SAME_MACHINE = ("vllm", "torch", "hardware", "cpu", "cpu_isa")


def machine_mismatch(stacks: dict[str, dict[str, str]]) -> list[str]:
    """``folder: key value, where OTHER has other`` for every repeat whose recorded machine or
    stack differs, key by key, from the first folder that recorded that key (a key a folder
    did not record is not compared: older folders have no ``cpu_isa``)."""
    out = []
    for key in _SAME_MACHINE:
        first: tuple[str, str] | None = None
        for name, stack in stacks.items():
            if key not in stack:
                continue
            if first is None:
                first = (name, stack[key])
            elif stack[key] != first[1]:
                out.append(f"{name}: {key} {stack[key]!r}, where {first[0]} has {first[1]!r}")
    return out


def build(
    folders: list[Path],
    noise: float,
    *,
    mixed: bool = False,
    drop: Mapping[str, Iterable[int]] | None = None,
) -> dict[str, Any]:
    """The table: every configuration with its measurements, and how it was made.

    Repeats measured on different machines or stacks (say, one CPU with AVX-512 and one without)
    are not one configuration's noise: they are refused unless ``mixed``. ``drop``: per folder
    name, trial numbers left out (measured beside other work, say: its ``others.log``), listed
    in the table's ``made_with``."""
    dropped = {name: sorted(set(numbers)) for name, numbers in (drop or {}).items()}
    names = [folder.name for folder in folders]
    if len(set(names)) < len(names):
        raise SystemExit(f"two folders share a name ({', '.join(names)}): the table keys by name")
    unknown = set(dropped) - set(names)
    if unknown:
        raise SystemExit(f"--drop names folders not given: {', '.join(sorted(unknown))}")
    configs: dict[str, dict[str, Any]] = {}
    refused: dict[str, dict[str, Any]] = {}
    made: list[dict[str, Any]] = []
    loaded = [(folder, *load_study_dir(folder)) for folder in folders]
    stacks = {str(folder): recorded_stack(saved) for folder, saved, _ in loaded}
    mismatch = machine_mismatch(stacks)
    if mismatch and not mixed:
        raise SystemExit(
            "these repeats were measured on different machines or stacks, so their spread is "
            "not the table's noise (--mixed-machines to build it anyway):\n  "
            + "\n  ".join(mismatch)
        )
    for folder, saved, study in loaded:
        numbers = {t.number for t in study.get_trials(deepcopy=False)}
        absent = sorted(set(dropped.get(folder.name, ())) - numbers)
        if absent:
            raise SystemExit(
                f"--drop {folder.name}:{','.join(map(str, absent))}: no such trial in {folder}"
            )
        made.append(
            {
                "folder": folder.name,
                "study": saved.get("study"),
                "vllm": saved.get("vllm"),
                "hardware": saved.get("hardware"),
                "stack": stacks[str(folder)],
                "started_at": saved.get("started_at"),
                "trials": len(study.trials),
                "dropped": dropped.get(folder.name, []),
            }
        )
        for trial in study.get_trials(deepcopy=False):
            if trial.number in dropped.get(folder.name, ()):
                continue
            if trial.user_attrs.get("status") == "rejected" and trial.params:
                # Refused before any server started (an invalid combination): a grid label
                # with no configuration to measure, which a study is told 0 for at no cost.
                key = config_key({}, trial.params)
                refused.setdefault(
                    key,
                    {
                        "params": json.loads(key),
                        "message": str(trial.user_attrs.get("message") or ""),
                    },
                )
                continue
            m = measurement(trial, noise)
            if m is None:
                continue
            args = json.loads(trial.user_attrs["engine_args"])
            key = config_key(args, trial.params)
            entry = configs.setdefault(
                key, {"args": args, "params": json.loads(key), "measurements": []}
            )
            entry["measurements"].append({"folder": folder.name, **m})
    for entry in configs.values():
        caps = [m["capacity_rps"] for m in entry["measurements"]]
        entry["mean_rps"] = statistics.fmean(caps)
        entry["spread_rps"] = (max(caps) - min(caps)) if len(caps) > 1 else None
    return {
        "made_with": made,
        "noise": noise,
        "configs": configs,
        "refused": {k: v for k, v in refused.items() if k not in configs},
    }


def parse_drop(items: Iterable[str]) -> dict[str, list[int]]:
    """``["r1:127,129", "r2:3"]`` -> ``{"r1": [127, 129], "r2": [3]}``."""
    out: dict[str, list[int]] = {}
    for item in items:
        name, sep, numbers = item.partition(":")
        try:
            parsed = [int(n) for n in numbers.split(",") if n.strip()]
        except ValueError:
            parsed = []
        if not sep or not name or not parsed:
            raise SystemExit(f"--drop {item!r}: expected FOLDER:N[,N...], e.g. r1:127,129")
        out.setdefault(name, []).extend(parsed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--noise", type=float, default=0.05, help="margin noise for the estimate")
    ap.add_argument(
        "--mixed-machines",
        action="store_true",
        help="build from repeats whose machines or stacks differ (refused by default)",
    )
    ap.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="FOLDER:N,N",
        help="leave out these trials of the folder named FOLDER (say, measured beside other "
        "work); repeatable",
    )
    ns = ap.parse_args(argv)
    table = build(ns.folders, ns.noise, mixed=ns.mixed_machines, drop=parse_drop(ns.drop))
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    counts = [len(c["measurements"]) for c in table["configs"].values()]
    print(
        f"{len(counts)} configurations, {sum(counts)} measurements "
        f"(repeats: min {min(counts, default=0)}, max {max(counts, default=0)}), "
        f"{len(table['refused'])} labels refused before a server started -> {ns.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
