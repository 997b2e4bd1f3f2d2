"""Report tables: placeholder values of unmeasured trials are never shown as measurements.

Seen on the H200 (benchmarks/records/studies.md, GPU section): every trial of a study was stopped early by its
SLOs, and the front table printed the baseline's placeholder worst values (1,000,000,000 ms) as
if they had been measured.
"""

from __future__ import annotations

import json
import math

import optuna
import pytest
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
    assert "0 (baseline) ✗SLO missed: p95_ttft_ms<=1000 (infeasible)" in text
    # What the gains mean, and the SLOs themselves, are on the table.
    assert "SLOs: p95_ttft_ms<=1000" in text and "(+x%) better than the baseline" in text


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


def _trial(
    study: optuna.Study, status: str, values: list[float], margin: float, **attrs: object
) -> None:
    t = study.ask()
    t.set_user_attr("status", status)
    t.set_user_attr("engine_args", json.dumps({"max-num-seqs": 8}))
    for k, v in attrs.items():
        t.set_user_attr(k, v)
    t.set_constraint("p95_ttft_ms<=400", margin)
    t.set_constraint("p95_tpot_ms<=50", margin)
    study.tell(t, values)


def test_show_says_which_slo_a_trial_missed_or_stopped_it_and_what_was_measured() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=DIRECTIONS)
    study.set_metric_names(["p95_ttft_ms", "p95_tpot_ms", "output_throughput"])
    _trial(study, "complete", [300.0, 20.0, 100.0], -0.1)  # 0: met
    t = study.ask()  # 1: TTFT met, TPOT missed
    t.set_user_attr("status", "complete")
    t.set_constraint("p95_ttft_ms<=400", -0.2)
    t.set_constraint("p95_tpot_ms<=50", 0.3)
    study.tell(t, [320.0, 65.0, 120.0])
    _trial(study, "rejected", WORST, 1.0, message="max-num-batched-tokens < max-num-seqs")  # 2
    _trial(  # 3: stopped early, partial figures kept in its summary
        study,
        "infeasible",
        WORST,
        1.0,
        message="SLO out of reach: p95_ttft_ms<=400 can no longer be met: 9 of at most 30 ...",
        summary={"p95_ttft_ms": 1600.0, "p95_tpot_ms": 5.0, "output_throughput": 3.0, "partial": 1},
    )
    rows = {
        line.split("│")[1].strip(): line
        for line in _render(status_table(study)).splitlines()
        if line.count("│") > 3
    }
    assert "met" in rows["0"] and "missed" not in rows["0"]
    assert "missed: p95_tpot_ms<=50" in rows["1"] and "p95_ttft_ms<=400" not in rows["1"]
    assert "not measured" in rows["2"] and "missed" not in rows["2"]
    assert "stopped by p95_ttft_ms<=400" in rows["3"]
    assert "1,600.0*" in rows["3"] and "1,000,000,000" not in rows["3"]
    text = _render(status_table(study))
    assert "SLOs: p95_ttft_ms<=400, p95_tpot_ms<=50" in text and "* partial" in text
    # The tune console's line for a finished trial names the missed SLO too.
    from optimizer import cli_study as cli

    trials = study.get_trials()
    assert "✗SLO missed: p95_tpot_ms<=50" in cli._slo_note(trials[1])
    assert "SLOs met" in cli._slo_note(trials[0]) and cli._slo_note(trials[2]) == ""


def test_foreign_noise_is_kept_off_the_study_output(
    tmp_path: object, capfd: pytest.CaptureFixture[str]
) -> None:
    import logging
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from optimizer import cli

    cli._quiet_libraries()
    optuna.create_study()  # analysis code makes in-memory studies
    study = optuna.create_study(directions=DIRECTIONS)
    study.set_metric_names(["p95_ttft_ms", "p95_tpot_ms", "output_throughput"])
    _trial(study, "complete", [300.0, 20.0, 100.0], 0.5)  # nothing feasible
    optuna.visualization.plot_pareto_front(study, constraints_func=None)
    MlflowClient(f"sqlite:///{Path(str(tmp_path)) / 'mlflow.db'}").search_experiments()
    logging.getLogger("optuna.visualization._pareto_front").warning("noise")
    err = capfd.readouterr().err
    assert "A new study created in memory" not in err
    assert "does not have any" not in err and "noise" not in err
    assert "Creating initial MLflow database tables" not in err


def test_a_gain_over_a_zero_baseline_is_not_a_percentage() -> None:
    """The export console printed "+nan%" for a capacity gain over a baseline of 0."""
    from optimizer.export.command import _gain_cell

    assert _gain_cell(float("nan"), float("nan"), float("nan"), 0.0) == "from 0 (no ratio)"
    assert _gain_cell(14.0, 9.06, 18.24, 2.0) == "+14.0% [+9.1% .. +18.2%]"
