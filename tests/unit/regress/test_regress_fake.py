"""`regress` on a study folder made with a FAKE runner (no vLLM): the figures a plan names,
the recorded runs (the study's and export's re-validations), the command's table, exit codes
and regress.json, the installed stack recorded at the study and now, bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from optimizer import cli_support
from optimizer.cli import main
from optimizer.errors import ConfigError
from optimizer.regress import workflow
from optimizer.regress.workflow import figures_of, recorded_summaries
from optimizer.trial_view import TrialView
from optimizer.types import TrialResult, TrialSpec, TrialStatus
from tests.fakes.trials import FakeHandle
from tests.unit.test_study_loop import FakeRunner, _driver


class SlowerRunner(FakeRunner):
    """The fake server after a bad upgrade: a third less throughput, TTFT half again."""

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        handle = super().submit(spec, gpus)
        result = handle.future.result()
        summary = dict(result.summary)
        if summary:
            summary["output_throughput"] *= 0.66
            summary["p95_ttft_ms"] *= 1.5
        return FakeHandle(spec, replace(result, summary=summary))


@pytest.fixture
def study_dir(tmp_path: Path) -> Path:
    """Four trials; the baseline serves 4 sequences, so export picks another configuration."""
    _driver(
        tmp_path,
        FakeRunner(),
        trials=4,
        engine={"args": {"max-model-len": 2048}, "baseline_args": {"max-num-seqs": 4}},
        objectives={"preset": "default", "slos": ["p95_ttft_ms<=2000"]},
    ).run()
    return tmp_path / "out"


@pytest.fixture(autouse=True)
def _no_vllm_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tier: no vLLM to ask for its flags; every configuration's flags are accepted."""
    monkeypatch.setattr(workflow, "_flag_problems", lambda plan, configs: {})


def _use(monkeypatch: pytest.MonkeyPatch, runner: Any) -> list[Any]:
    made: list[Any] = []

    def make(kind: str, plan: Any, address: Any) -> Any:
        made.append(runner)
        return runner

    monkeypatch.setattr(cli_support, "make_runner", make)
    return made


def test_figures_of_a_fixed_load_and_a_capacity_plan() -> None:
    fixed = {"objectives": ["maximize:output_throughput", "minimize:p95_ttft_ms"],
             "slos": ["p95_ttft_ms<=400", "error_rate<=0.01"]}  # fmt: skip
    assert figures_of(fixed) == [
        ("output_throughput", "maximize"),
        ("p95_ttft_ms", "minimize"),
        ("error_rate", "minimize"),
    ]
    capacity = {"objectives": ["maximize:capacity_rps"], "slos": ["p95_tpot_ms<=250"]}
    assert [f for f, _ in figures_of(capacity)] == [
        "capacity_rps",
        "nominal_p95_ttft_ms",
        "nominal_p95_tpot_ms",
        "p95_tpot_ms",
    ]
    with pytest.raises(ConfigError, match="names no objective"):
        figures_of({"objectives": []})
    with pytest.raises(ConfigError, match="DIRECTION:METRIC"):
        figures_of({"objectives": ["up:capacity_rps"]})


def test_a_new_study_records_what_is_installed(study_dir: Path) -> None:
    saved = json.loads((study_dir / "plan.json").read_text())
    env = saved["environment"]
    assert env["python"].count(".") == 2 and env["hardware"] and env["cpu"]


def test_nothing_moved_exits_0_and_writes_regress_json(
    study_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = FakeRunner(fail_replay_once=True)  # every first attempt an invalid replay
    _use(monkeypatch, runner)
    assert main(["regress", str(study_dir), "--runs", "2", "--runner", "local"]) == 0
    out = capsys.readouterr().out
    assert "no figure moved beyond the noise for the worse" in out
    assert "at the study" in out and "recorded vs now" in out
    doc = json.loads((study_dir / "regress.json").read_text())
    assert doc["regressed"] is False and doc["worse"] == []
    assert set(doc["configurations"]) == {"chosen", "baseline"}
    assert doc["baseline_trial"] == 0 and doc["policy"] == "max-throughput"
    # Two runs each, alternating, the invalid replays re-run with fresh prompts.
    labels = [Path(s.workdir).parent.name for s in runner.specs]
    assert labels == [f"{x}-{k}" for k in (0, 1) for x in ("chosen", "baseline") for _ in (1, 2)]
    assert [Path(s.workdir).name for s in runner.specs] == ["attempt-0", "attempt-1"] * 4
    assert len({s.seed for s in runner.specs}) == len(runner.specs) == 8
    assert all(not s.early_stop for s in runner.specs)
    chosen = doc["configurations"]["chosen"]
    rows = {r["figure"]: r for r in chosen["figures"]}
    assert set(rows) == {"output_throughput", "p95_ttft_ms", "p95_tpot_ms"}
    assert all(r["moved"] == "within noise" and r["change_pct"] == 0 for r in rows.values())
    assert chosen["slos"] == {"recorded": True, "now": [True, True], "moved": "within noise"}
    assert (
        doc["installed"]["study"]
        == json.loads((study_dir / "plan.json").read_text())["environment"]
    )
    assert doc["installed_changes"] == []
    assert doc["runs_dir"].startswith("regress/")
    gains = {g["figure"]: g for g in doc["gain_vs_baseline"]}
    assert gains["output_throughput"]["recorded_pct"] == gains["output_throughput"]["now_pct"]


def test_a_slower_server_is_a_regression_exit_4(
    study_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _use(monkeypatch, SlowerRunner())
    assert main(["regress", str(study_dir), "--runs", "1", "--no-baseline"]) == 4
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "yes, worse" in out
    doc = json.loads((study_dir / "regress.json").read_text())
    assert set(doc["configurations"]) == {"chosen"} and doc["gain_vs_baseline"] == []
    worse = "\n".join(doc["worse"])
    assert "chosen output_throughput" in worse and "chosen p95_ttft_ms" in worse
    assert "p95_tpot_ms" not in worse


def test_refused_flags_are_a_configuration_that_no_longer_runs(
    study_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = FakeRunner()
    _use(monkeypatch, runner)
    monkeypatch.setattr(
        workflow,
        "_flag_problems",
        lambda plan, configs: {"chosen": "the installed vLLM refuses its flags: unknown --x"},
    )
    assert main(["regress", str(study_dir), "--runs", "1"]) == 4
    doc = json.loads((study_dir / "regress.json").read_text())
    assert doc["worse"][0].startswith("chosen: no run served now (run 1: failed: the installed")
    assert all(Path(s.workdir).parent.name.startswith("baseline") for s in runner.specs)


def test_export_re_validations_count_as_recorded_runs(study_dir: Path) -> None:
    _saved, study = cli_support.load_study_dir(study_dir)
    view = TrialView(study.trials[0])
    for i, (args, status) in enumerate(
        [(view.engine_args, "complete"), ({"other": 1}, "complete"), (view.engine_args, "failed")]
    ):
        run = study_dir / "validation" / "trial-0-1" / f"baseline-{i}"
        run.mkdir(parents=True)
        doc = {"status": status, "engine_args": args, "summary": {"p95_ttft_ms": 100.0 + i}}
        (run / "result.json").write_text(json.dumps(doc))
    runs = recorded_summaries(study_dir, view)
    assert [s.get("p95_ttft_ms") for s in runs] == [view.summary["p95_ttft_ms"], 100.0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--runs", "0"], "--runs 0: give 1 or more"),
        (["--min-change", "-1"], "--min-change -1.0"),
        (["--trial", "99"], "--trial 99: no such trial"),
    ],
)
def test_bad_input_is_a_clear_error(
    study_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    made = _use(monkeypatch, FakeRunner())
    assert main(["regress", str(study_dir), *argv]) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")
    assert made == []  # nothing started


def test_not_a_study_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["regress", str(tmp_path)]) == 2
    assert "no plan.json here" in capsys.readouterr().err


class LaggingClient(FakeRunner):
    """Every replay of the chosen configuration misses its schedule (a busy client)."""

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        if "chosen" in spec.workdir:
            self.specs.append(spec)
            lag = TrialResult(number=spec.number, status=TrialStatus.INVALID_REPLAY, message="lag")
            return FakeHandle(spec, lag)
        return super().submit(spec, gpus)


def test_a_check_that_measured_nothing_exits_3(
    study_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = LaggingClient()
    _use(monkeypatch, runner)
    assert main(["regress", str(study_dir), "--runs", "1"]) == 3
    assert "NOT MEASURED" in capsys.readouterr().out
    doc = json.loads((study_dir / "regress.json").read_text())
    assert doc["measured"] is False and doc["regressed"] is False
    chosen = doc["configurations"]["chosen"]
    assert chosen["unscored"] == ["run 1: invalid_replay: lag"] and chosen["failures"] == []
    assert sum("chosen" in s.workdir for s in runner.specs) == 3  # retried twice
