"""Report tables: placeholder values of unmeasured trials are never shown as measurements.

Seen on the H200 (benchmarks/RESULTS.md, GPU section): every trial of a study was stopped early by its
SLOs, and the front table printed the baseline's placeholder worst values (1,000,000,000 ms) as
if they had been measured.
"""

from __future__ import annotations

import json
import math

import optuna
from rich.console import Console

from optimizer.report import changed_args, front_rows, front_table, status_table

DIRECTIONS = ["minimize", "minimize", "maximize"]
WORST = [1e9, 1e9, 0.0]


def _study(baseline_status: str, baseline_values: list[float]) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=DIRECTIONS)
    study.set_metric_names(["p95_ttft_ms", "p95_tpot_ms", "output_throughput"])
    long_args = {f"flag-{i}": "x" * 12 for i in range(12)}
    for number, (status, values, margin, extra) in enumerate(
        [
            (baseline_status, baseline_values, 1.0 if baseline_status != "complete" else -0.1, {}),
            ("complete", [500.0, 20.0, 300.0], -0.5, {"max-num-seqs": 64, **long_args}),
        ]
    ):
        t = study.ask()
        if number == 0:
            t.set_user_attr("baseline", True)
        t.set_user_attr("status", status)
        t.set_user_attr("engine_args", json.dumps(extra))
        t.set_constraint("p95_ttft_ms<=1000", margin)
        study.tell(t, values)
    return study


def _render(table: object) -> str:
    console = Console(width=400, record=True)
    console.print(table)
    return console.export_text()


def test_early_stopped_baseline_shows_no_placeholder_values_or_gains() -> None:
    study = _study("infeasible", WORST)
    base, tuned = front_rows(study)
    assert base.baseline and not base.feasible
    assert all(math.isnan(v) for v in base.values)
    # Nothing to compare against: no gain is invented from the placeholders.
    assert tuned.values == (500.0, 20.0, 300.0)
    assert tuned.gains_pct == (None, None, None)
    text = _render(front_table(study))
    assert "1,000,000,000" not in text
    assert "0 (baseline) ✗SLO (infeasible)" in text


def test_measured_baseline_keeps_values_and_gains() -> None:
    study = _study("complete", [1000.0, 40.0, 200.0])
    base, tuned = front_rows(study)
    assert base.values == (1000.0, 40.0, 200.0)
    assert tuned.gains_pct == (50.0, 50.0, 50.0)
    assert "1,000.0" in _render(front_table(study))


def test_status_table_shows_every_engine_argument() -> None:
    study = _study("complete", [1000.0, 40.0, 200.0])
    text = _render(status_table(study))
    # All twelve long flags of trial 1 and the last one in full (no cut at 120 characters).
    assert "flag-11=xxxxxxxxxxxx" in text and "max-num-seqs=64" in text


def test_a_flag_set_to_what_the_baseline_engine_ran_with_is_no_change() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize"])
    base = study.ask()
    base.set_user_attr("engine_args", json.dumps({"max-model-len": 2048}))
    base.set_user_attr(
        "effective_config",
        {
            "enable_prefix_caching": "True",
            "enable_chunked_prefill": "True",
            "max_seq_len": "2048",
            "dtype": "torch.bfloat16",
            "gpu_memory_utilization": "0.9",
            "block_size": "128",
        },
    )
    study.tell(base, [1.0])
    tuned = study.ask()
    args = {
        "max-model-len": 2048,  # the baseline set it too: equal
        "enable-prefix-caching": True,  # vLLM's default on this build
        "dtype": "bfloat16",  # logged as torch.bfloat16
        "gpu-memory-utilization": 0.9,
        "enable-chunked-prefill": False,  # a real change
        "block-size": 64,  # a real change
        "max-num-seqs": 64,  # vLLM does not log its default: counted as a change
    }
    tuned.set_user_attr("engine_args", json.dumps(args))
    study.tell(tuned, [2.0])
    b, t = study.trials
    assert changed_args(t, b) == {
        "enable-chunked-prefill": False,
        "block-size": 64,
        "max-num-seqs": 64,
    }
    # Without the baseline's effective settings every unset flag counts, as before.
    study2 = optuna.create_study(directions=["maximize"])
    study2.add_trial(optuna.trial.create_trial(values=[1.0], user_attrs={"engine_args": "{}"}))
    assert changed_args(t, study2.trials[0]) == args
