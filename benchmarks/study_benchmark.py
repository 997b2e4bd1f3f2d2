"""What a study buys and what it costs, measured on a finished study folder.

1. Best feasible configuration vs the baseline: both re-run ``--runs`` times, alternating, with
   fresh prompts (the export's re-validation); medians and ranges per objective.
2. Where a trial's time goes: engine startup vs replay, per trial of the study.
3. Early stop: one configuration with an SLO it cannot meet, replayed with and without early
   stop; wall time of each and how many requests were sent.

Usage: ``python -m benchmarks.study_benchmark runs/cpu-demo [--runs 3]``
(run ``vllm-autotune tune examples/cpu-demo.yaml`` first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import optuna
from rich.console import Console
from rich.table import Table

from optimizer import export as ex
from optimizer.config import load_job
from optimizer.study import create_storage, prepare
from optimizer.trial import run_trial
from optimizer.trial_view import TrialView, baseline_of
from optimizer.types import TrialSpec

console = Console(width=140)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study_dir")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--policy", default="min-ttft")
    ap.add_argument("--skip-validation", action="store_true")
    ns = ap.parse_args()
    folder = Path(ns.study_dir)
    saved = json.loads((folder / "plan.json").read_text())
    study = optuna.load_study(study_name=saved["study"], storage=create_storage(saved["storage"]))
    job, base = load_job(saved["job"], base=folder)
    plan = prepare(job, base)
    console.print(
        f"study {saved['study']}: {len(study.trials)} trials; {plan.vllm}; {saved.get('hardware')}"
    )

    # 2. time per trial
    t = Table(title="time per trial: engine startup vs replay (s)")
    for c in ("trial", "status", "startup_s", "replay_s", "startup share"):
        t.add_column(c, justify="right")
    shares = []
    for tr in map(TrialView, study.trials):
        s, r = tr.startup_s, tr.replay_s
        share = s / (s + r) if s and r else None
        if share is not None:
            shares.append(share)
        t.add_row(
            str(tr.number),
            tr.status,
            f"{s or 0:.1f}",
            f"{r or 0:.1f}",
            f"{share:.0%}" if share is not None else "-",
        )
    console.print(t)
    if shares:
        console.print(f"median startup share of a trial: {statistics.median(shares):.0%}")

    out = plan.out / "benchmark" / str(int(time.time()))

    def spec(label: str, args: dict[str, Any], k: int, **over: Any) -> TrialSpec:
        base_spec = plan.trial_spec(
            0,
            args,
            workdir=out / f"{label}-{k}",
            seed=700_000 + 10 * k + len(label),
            early_stop=False,
        )
        return dataclasses.replace(base_spec, **over)

    baseline = baseline_of(study)
    if baseline is None:
        raise SystemExit(f"{folder}: the study has no baseline trial")
    base_args = TrialView(baseline).engine_args

    # 1. best vs baseline: the export's re-validation, with trials run here (no Ray)
    if not ns.skip_validation:
        choice = ex.choose(study, ns.policy)
        number = choice.chosen.number
        console.print(
            f"{ns.policy}: trial {number}; re-running it and the baseline {ns.runs}x each"
        )
        val = ex.revalidate(
            plan,
            study,
            choice,
            lambda s, _gpus: run_trial(s, isolate_client=True),
            workdir=out / "validation",
            runs=ns.runs,
            progress=lambda line: console.print(f"  {line}"),
        )
        t = Table(title=f"best ({ns.policy}, trial {number}) vs baseline, {ns.runs} runs each")
        for c in ("objective", "baseline median [range]", "best median [range]", "gain [range]"):
            t.add_column(c, justify="right")
        for row in val.table():
            t.add_row(
                row["metric"],
                "{:,.1f} [{:,.1f}-{:,.1f}]".format(row["baseline_median"], *row["baseline_range"]),
                "{:,.1f} [{:,.1f}-{:,.1f}]".format(row["chosen_median"], *row["chosen_range"]),
                "{:+.1f}% [{:+.1f}%..{:+.1f}%]".format(row["gain_pct"], *row["gain_range_pct"]),
            )
        console.print(t)

    # 3. early stop: the baseline under an SLO it cannot meet
    tight = ("p95_ttft_ms<=5",)
    t = Table(title="early stop: baseline under p95_ttft_ms<=5 (unreachable)")
    for c in ("early stop", "status", "replay_s", "requests sent", "trial wall s"):
        t.add_column(c, justify="right")
    for early in (False, True):
        t0 = time.monotonic()
        res = run_trial(
            spec(f"early-{early}", base_args, 0, slos=tight, early_stop=early), isolate_client=True
        )
        wall = time.monotonic() - t0
        sent = sum(1 for r in res.records if not (r.error or "").startswith("not sent"))
        t.add_row(
            str(early),
            res.status.value,
            f"{res.replay_s or 0:.1f}",
            f"{sent}/{len(res.records)}",
            f"{wall:.1f}",
        )
    console.print(t)


if __name__ == "__main__":
    main()
