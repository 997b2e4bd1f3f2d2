"""MLflow tracking with a FAKE runner (no vLLM) against a local SQLite MLflow store: one parent
run per study, one child per trial, Pareto tags exactly on the feasible front, idempotent
mlflow-sync, and an unreachable tracking server that never holds the study up."""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from optimizer import tracking
from optimizer.config import load_job
from optimizer.study import prepare
from optimizer.study_driver import StudyDriver, is_baseline
from optimizer.tracking.target import target_for_dir
from optimizer.trial import write_records
from optimizer.types import (
    FailureClass,
    MemoryAccount,
    RequestRecord,
    TrialResult,
    TrialSpec,
    TrialStatus,
)
from tests.fakes.trials import FakeHandle, ScriptedRunner

REPO = Path(__file__).resolve().parents[2]


def _records(n: int, seqs: float) -> tuple[RequestRecord, ...]:
    out = []
    for i in range(n):
        sent = i * 0.1
        first = sent + 0.02 + 0.001 * seqs**0.5
        chunks = tuple(first + k * 0.005 * (1 + seqs / 100) for k in range(8))
        out.append(
            RequestRecord(
                index=i,
                scheduled_s=sent,
                sent_s=sent,
                first_token_s=first,
                chunk_times_s=chunks,
                end_s=chunks[-1],
                input_tokens=100,
                output_tokens=8,
                warmup=i < 2,
            )
        )
    return tuple(out)


class FakeRunner(ScriptedRunner):
    """A made-up, deterministic server: more max-num-seqs, more throughput and more TPOT; a
    max-num-batched-tokens of 64 doubles TTFT (so it is dominated); a kv-cache-memory-bytes of
    1 fails like a KV cache too small. Writes the files a real trial writes."""

    def __init__(self) -> None:
        super().__init__()

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        self.specs.append(spec)
        workdir = Path(spec.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "engine.log").write_text(f"fake engine for trial {spec.number}\n")
        args = spec.engine.args
        if args.get("kv-cache-memory-bytes") == 1:
            result = TrialResult(
                number=spec.number,
                status=TrialStatus.FAILED,
                failure_class=FailureClass.KV_CACHE_TOO_SMALL,
                message="kv too small",
                log_path=str(workdir / "engine.log"),
            )
            return FakeHandle(spec, result)
        seqs = float(args.get("max-num-seqs", 128))
        slow = 2.0 if args.get("max-num-batched-tokens") == 64 else 1.0
        summary = {
            "p95_ttft_ms": (2000.0 / seqs**0.5 + 10) * slow,
            "median_ttft_ms": 1000.0 / seqs**0.5,
            "p95_tpot_ms": 5.0 + seqs / 10.0,
            "p95_e2el_ms": 900.0,
            "mean_e2el_ms": 700.0,
            "output_throughput": 10.0 * seqs**0.5,
            "request_throughput": 2.0,
            "total_input_tokens": 1000.0,
            "total_output_tokens": 80.0,
            "error_rate": 0.0,
            "completed": 10,
            "p99_itl_ms": math.nan,  # NaN is skipped, never logged
        }
        records = _records(12, seqs)
        write_records(records, workdir / "records.jsonl.gz")
        (workdir / "result.json").write_text(json.dumps({"number": spec.number}))
        result = TrialResult(
            number=spec.number,
            status=TrialStatus.COMPLETE,
            summary=summary,
            records=records,
            startup_s=1.5,
            replay_s=2.5,
            memory=MemoryAccount(kv_cache_gib=0.25, kv_cache_tokens=4096, max_concurrency=2.0),
            server_metrics={"vllm:num_preemptions_total": 3.0},
            log_path=str(workdir / "engine.log"),
        )
        return FakeHandle(spec, result)


SPACE = {
    "name": "t",
    "params": {
        "max-num-seqs": {"type": "int", "low": 8, "high": 256, "log": True},
        "max-num-batched-tokens": {"type": "categorical", "choices": [64, 4096]},
        "kv-cache-memory-bytes": {"type": "categorical", "choices": [268435456, 1]},
    },
}
# Trial 1 is on the front until trial 2 (same, but faster prefill) dominates it.
DOMINATED = {"max-num-seqs": 32, "max-num-batched-tokens": 64, "kv-cache-memory-bytes": 268435456}
DOMINATING = {**DOMINATED, "max-num-batched-tokens": 4096}


def _job(tmp_path: Path, **over: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "name": "fake-mlflow",
        "model": {"path": str(tmp_path / "model"), "make": "tiny"},
        "engine": {"args": {"max-model-len": 2048}, "env": {"HF_TOKEN": "secret-value"}},
        "trace": {
            "path": str(REPO / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {"window_s": [0, 40], "max_model_len": 2048, "max_output_tokens": 32},
            "warmup_requests": 2,
        },
        "search_space": SPACE,
        "objectives": {"preset": "default", "slos": ["p95_ttft_ms<=1000"]},
        "sampler": {"name": "random", "seed": 1},
        "trials": 7,
        "enqueue": [DOMINATED, DOMINATING],
        "out": str(tmp_path / "out"),
    }
    job.update(over)
    return job


def _run(tmp_path: Path, **over: Any) -> tuple[optuna.Study, tracking.Tracker, float]:
    job, base = load_job(_job(tmp_path, **over), base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    tracker = tracking.tracker_for_plan(
        plan, base_backoff_s=0.1, max_backoff_s=0.5, close_timeout_s=60
    )
    assert tracker is not None
    t0 = time.monotonic()
    study = StudyDriver(plan, FakeRunner(), on_event=tracker.on_event).run()
    took = time.monotonic() - t0
    return study, tracker, took


def _runs(uri: str, experiment: str = "fake-mlflow") -> tuple[Any, list[Any]]:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("vllm_autotune.role") == "study"]
    children = [r for r in runs if r.data.tags.get("vllm_autotune.role") == "trial"]
    assert len(parents) == 1
    return parents[0], children


def _by_trial(children: list[Any]) -> dict[int, Any]:
    out = {int(r.data.tags["vllm_autotune.trial"]): r for r in children}
    assert len(out) == len(children), "one child run per trial"
    return out


def _front(study: optuna.Study) -> set[int]:
    return {t.number for t in study.best_trials if all(v <= 0 for v in t.constraints.values())}


def test_parent_and_one_child_per_trial_with_params_metrics_tags_and_artifacts(
    tmp_path: Path,
) -> None:
    study, tracker, _ = _run(tmp_path)
    assert tracker.finish(study) is True
    uri = tracking.local_tracking_uri(tmp_path / "out")
    assert (tmp_path / "out" / "mlflow.db").exists()
    parent, children = _runs(uri)
    trials = study.get_trials()
    runs = _by_trial(children)
    assert set(runs) == {t.number for t in trials}
    assert parent.info.status == "FINISHED"
    front = _front(study)
    assert front and 1 not in front and 2 in front  # trial 1 was dominated by trial 2
    statuses = set()
    for t in trials:
        run = runs[t.number]
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["vllm_autotune.study"] == "fake-mlflow"
        # Pareto tags sit exactly on the feasible front; baseline only on trial 0.
        assert tags["pareto"] == ("true" if t.number in front else "false")
        assert tags["baseline"] == ("true" if is_baseline(t) else "false")
        assert tags["state"] == t.user_attrs["status"]
        statuses.add(tags["state"])
        assert params["trial_number"] == str(t.number) and params["sampler"] == "random"
        args = json.loads(t.user_attrs["engine_args"])
        assert params["max-num-seqs"] == str(args["max-num-seqs"])
        if t.user_attrs["status"] == "complete":
            assert tags["slo_met"] == "true"
            assert metrics["p95_ttft_ms"] == pytest.approx(t.user_attrs["summary"]["p95_ttft_ms"])
            assert metrics["kv_cache_tokens"] == 4096 and metrics["max_concurrency"] == 2.0
            assert metrics["server.num_preemptions_total"] == 3.0
            assert metrics["startup_s"] == 1.5 and "p99_itl_ms" not in metrics
            assert run.info.status == "FINISHED"
            files = {a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)}
            assert {"records.jsonl.gz", "engine.log", "result.json", "plots"} <= files
            plots = MlflowClient(uri).list_artifacts(run.info.run_id, "plots")
            assert [a.path for a in plots] == ["plots/latency_cdf.png"]
            assert "preemptions" in tags["mlflow.note.content"]
        elif t.user_attrs["status"] == "failed":
            assert tags["failure_class"] == "kv_cache_too_small"
            assert tags["slo_met"] == "false" and run.info.status == "FAILED"
    assert {"complete", "failed"} <= statuses

    # The parent: inputs, front table and plots, importances, report, hypervolume per trial.
    client = MlflowClient(uri)
    files = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"inputs", "pareto", "report.md", "importance.json", "plan.json"} <= files
    pareto = {a.path for a in client.list_artifacts(parent.info.run_id, "pareto")}
    assert {"pareto/front.json", "pareto/front.csv"} <= pareto
    assert any(p.endswith(".png") for p in pareto)
    assert "pareto/pareto_front.html" in pareto  # Optuna's interactive plot (plotly)
    inputs = {a.path for a in client.list_artifacts(parent.info.run_id, "inputs")}
    assert inputs == {"inputs/job.yaml", "inputs/search_space.yaml", "inputs/trace.json"}
    job_yaml = Path(client.download_artifacts(parent.info.run_id, "inputs/job.yaml", str(tmp_path)))
    assert "secret-value" not in job_yaml.read_text()
    front_doc = json.loads(
        Path(
            client.download_artifacts(parent.info.run_id, "pareto/front.json", str(tmp_path))
        ).read_text()
    )
    assert front_doc[0]["baseline"] is True
    assert {r["trial"] for r in front_doc if not r["baseline"]} == front - {0}
    report = Path(
        client.download_artifacts(parent.info.run_id, "report.md", str(tmp_path))
    ).read_text()
    assert "Baseline vs the Pareto front" in report and "What the winners changed" in report
    assert "Engine failed" in report
    hv = client.get_metric_history(parent.info.run_id, "hypervolume")
    complete = {t.number for t in trials if t.state == TrialState.COMPLETE}
    assert {m.step for m in hv} == complete
    assert min(m.value for m in hv if m.step == 0) == pytest.approx(1.0)  # baseline alone
    assert max(m.value for m in hv) >= 1.0
    assert parent.data.tags["pareto_trials"] == ",".join(str(n) for n in sorted(front))


def test_mlflow_sync_is_idempotent_and_retags_when_the_front_moves(tmp_path: Path) -> None:
    # First run: baseline and the configuration trial 2 will dominate later.
    study, tracker, _ = _run(tmp_path, trials=2)
    assert tracker.finish(study)
    uri = tracking.local_tracking_uri(tmp_path / "out")
    _, children = _runs(uri)
    assert _by_trial(children)[1].data.tags["pareto"] == "true"

    # Resume with more trials: trial 1 leaves the front; its existing run is re-tagged.
    study, tracker, _ = _run(tmp_path, trials=4)
    assert tracker.finish(study)
    parent, children = _runs(uri)
    runs = _by_trial(children)
    assert len(runs) == 4 and runs[1].data.tags["pareto"] == "false"
    assert runs[2].data.tags["pareto"] == "true"

    # mlflow-sync twice: nothing created, nothing duplicated, same view.
    for _ in range(2):
        summary = tracking.sync_study(tmp_path / "out")
        assert summary.created == 0 and summary.duplicates_deleted == 0
        assert summary.updated == 4 and summary.parent_run_id == parent.info.run_id
        assert set(summary.front) == _front(study)
    parent2, children2 = _runs(uri)
    assert parent2.info.run_id == parent.info.run_id
    assert {r.info.run_id for r in children2} == {r.info.run_id for r in children}
    hv = MlflowClient(uri).get_metric_history(parent.info.run_id, "trials_done")
    assert sorted(m.step for m in hv) == [0, 1, 2, 3]  # one point per trial, never repeated


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mlflow_down_never_holds_the_study_and_sync_rebuilds_it(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{_closed_port()}"
    study, tracker, took = _run(
        tmp_path, trials=5, mlflow={"tracking_uri": down, "experiment": "team"}
    )
    assert took < 30, f"the driver waited for MLflow ({took:.1f} s)"
    assert len(study.get_trials()) == 5
    t0 = time.monotonic()
    assert tracker.finish(study) is False  # nothing could be logged ...
    assert time.monotonic() - t0 < 30  # ... and close() gave up in bounded time
    assert tracker.last_error

    # The Optuna storage had everything: mlflow-sync into a working store rebuilds it all.
    working = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    summary = tracking.sync_study(tmp_path / "out", tracking_uri=working)
    assert summary.created == 5 and summary.trials == 5
    parent, children = _runs(working, experiment="team")
    assert parent.info.status == "FINISHED"
    runs = _by_trial(children)
    assert set(runs) == {t.number for t in study.get_trials()}
    front = _front(study)
    assert {n for n, r in runs.items() if r.data.tags["pareto"] == "true"} == front
    assert runs[0].data.tags["baseline"] == "true"
    again = tracking.sync_study(tmp_path / "out", tracking_uri=working)
    assert again.created == 0 and again.updated == 5


def test_disabled_tracking_gives_no_tracker(tmp_path: Path) -> None:
    job, base = load_job(_job(tmp_path, mlflow={"enabled": False}), base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    assert tracking.tracker_for_plan(plan) is None
    job, base = load_job(_job(tmp_path), base=tmp_path)
    assert tracking.tracker_for_plan(prepare(job, base, check_flags=False), enabled=False) is None


def test_runs_are_keyed_by_the_stored_study_and_a_teams_experiment_by_its_prefix(
    tmp_path: Path,
) -> None:
    """Issue 42: the study is the one the storage holds (a service study's ``TEAM/ID``, not
    the job's name); a team's experiment is behind its prefix whatever the job names, and
    review/mlflow.json (what mlflow-sync reads) records both."""
    job, base = load_job(_job(tmp_path, mlflow={"experiment": "alpha/theirs"}), base=tmp_path)
    plan = dataclasses.replace(prepare(job, base, check_flags=False), study_name="beta/0123ab")
    assert tracking.experiment_name(plan) == "alpha/theirs"  # `tune`: as the job says
    tracker = tracking.tracker_for_plan(plan, team="beta", close_timeout_s=5)
    assert tracker is not None
    assert (tracker.target.study, tracker.target.experiment) == ("beta/0123ab", "beta/alpha/theirs")
    tracker.close(0)
    meta = json.loads((tmp_path / "out" / "review" / "mlflow.json").read_text())
    assert (meta["study"], meta["experiment"]) == ("beta/0123ab", "beta/alpha/theirs")
    job, base = load_job(_job(tmp_path), base=tmp_path)
    target = tracking.tracker_for_plan(prepare(job, base, check_flags=False), close_timeout_s=5)
    assert target is not None and target.target.study == "fake-mlflow"  # `tune`: the job's name
    assert target.target.experiment == "fake-mlflow"
    target.close(0)


def test_ui_command_points_at_the_local_store(tmp_path: Path) -> None:
    target = tracking.TrackingTarget(
        study="s",
        storage_url="sqlite:///x",
        out=tmp_path,
        tracking_uri=tracking.local_tracking_uri(tmp_path),
        experiment="s",
        artifact_root=tmp_path / "mlartifacts",
    )
    cmd = tracking.ui_command(target)
    assert cmd.startswith("mlflow ui --backend-store-uri sqlite:///")
    assert cmd.endswith("mlflow.db --default-artifact-root " + str(tmp_path / "mlartifacts"))


def test_a_copied_study_folder_logs_to_its_own_mlflow_store(tmp_path: Path) -> None:
    import shutil

    study, tracker, _ = _run(tmp_path, trials=2)
    assert tracker.finish(study)
    meta = json.loads((tmp_path / "out" / "review" / "mlflow.json").read_text())
    assert str(tmp_path / "out") not in json.dumps(meta)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(tmp_path / "out", copy)
    target = target_for_dir(copy, None, None)
    assert target.tracking_uri == tracking.local_tracking_uri(copy)
    assert target.storage_url == f"sqlite:///{(copy / 'study.db').resolve()}"
    assert target.artifact_root == (copy / "mlartifacts").resolve()


def test_logging_from_a_copied_study_folder_never_writes_into_the_original(
    tmp_path: Path,
) -> None:
    """The copied mlflow.db still names the original's artifact folder (MLflow keeps absolute
    locations): the copy's experiment and runs are pointed at the copy's own artifacts. The
    copy is exported in a process of its own, as a user would (MLflow caches a run's artifact
    folder by run id within a process, and the copy's runs have the original's ids)."""
    import shutil
    import subprocess
    import sys

    study, tracker, _ = _run(tmp_path, trials=2)
    assert tracker.finish(study)
    original = tmp_path / "out"
    before = sorted((original / "mlartifacts").rglob("*"))
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(original, copy)
    argv = ["export", str(copy), "--format", "vllm-config", "--no-validate", "--trial", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "optimizer.cli", *argv, "--out", str(copy / "x.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "logged to the study's MLflow parent run" in proc.stdout
    assert sorted((original / "mlartifacts").rglob("*")) == before
    client = MlflowClient(tracking.local_tracking_uri(copy))
    parent, children = _runs(tracking.local_tracking_uri(copy))
    for run in [parent, *children]:
        uri = client.get_run(run.info.run_id).info.artifact_uri
        assert uri.startswith((copy / "mlartifacts").resolve().as_uri()), uri
    assert list((copy / "mlartifacts").rglob("exports/x.yaml"))


# --- issue 17: what a reviewer sees first -------------------------------------------------------

REJECTED = {"max-num-seqs": 128, "max-num-batched-tokens": 64, "kv-cache-memory-bytes": 268435456}
FAILING = {**DOMINATING, "kv-cache-memory-bytes": 1}


def test_experiment_opens_on_the_runs_table_not_the_genai_pages(tmp_path: Path) -> None:
    study, tracker, _ = _run(tmp_path, trials=2)
    assert tracker.finish(study)
    uri = tracking.local_tracking_uri(tmp_path / "out")
    exp = MlflowClient(uri).get_experiment_by_name("fake-mlflow")
    assert exp is not None
    # MLflow 3 shows traces (GenAI) unless the experiment says it develops models ...
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # ... and its UI with the GenAI / ML switch reads the switch from the URL.
    assert tracker.experiment_id == exp.experiment_id
    summary = tracking.sync_study(tmp_path / "out")
    assert summary.runs_url == (
        f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs"
        "?workflowType=machine_learning&viewStateShareKey=vllm-autotune"
    )
    # MLflow has no default columns: the URL opens a view saved on the experiment that shows
    # the objectives, their gains over the baseline (parent run) and each trial's class.
    view = json.loads(exp.tags["mlflow.sharedViewState.vllm-autotune"])
    assert view["name"] == "vllm-autotune review"
    columns = json.loads(view["state"])["selectedColumns"]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    for objective in plan["objectives"]:
        name = objective.rsplit(":", 1)[-1]
        assert f"metrics.`{name}`" in columns
        assert f"metrics.`gain_pct.{name}`" in columns
    assert "tags.`class`" in columns
    # A view a reviewer changed and saved under the same name is left as it is.
    key = "mlflow.sharedViewState.vllm-autotune"
    MlflowClient(uri).set_experiment_tag(exp.experiment_id, key, "edited")
    tracking.sync_study(tmp_path / "out")
    assert MlflowClient(uri).get_experiment(exp.experiment_id).tags[key] == "edited"
    # An experiment a user already marked otherwise keeps the user's choice.
    MlflowClient(uri).set_experiment_tag(exp.experiment_id, "mlflow.experimentKind", "x")
    tracking.sync_study(tmp_path / "out")
    exp = MlflowClient(uri).get_experiment(exp.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "x"


def test_bad_trials_look_different_in_the_runs_list(tmp_path: Path) -> None:
    study, tracker, _ = _run(tmp_path, trials=4, enqueue=[DOMINATING, REJECTED, FAILING])
    assert tracker.finish(study)
    _, children = _runs(tracking.local_tracking_uri(tmp_path / "out"))
    runs = _by_trial(children)
    statuses = {t.number: t.user_attrs["status"] for t in study.get_trials()}
    assert statuses == {0: "complete", 1: "complete", 2: "rejected", 3: "failed"}
    seen = {
        n: (r.info.status, r.data.tags["mlflow.runName"], r.data.tags["class"])
        for n, r in runs.items()
    }
    assert seen[0][:2] == ("FINISHED", "baseline")
    assert seen[1][:2] == ("FINISHED", "trial-0001")
    assert seen[2] == ("KILLED", "trial-0002 rejected", "rejected")
    assert seen[3] == ("FAILED", "trial-0003 failed", "failed")
    assert runs[2].info.run_name == "trial-0002 rejected"  # what the runs list shows


def test_a_trial_that_missed_its_slos_is_named_so(tmp_path: Path) -> None:
    # p95_ttft_ms of max-num-seqs 8 is 2000/sqrt(8)+10 = 717 ms: over a 500 ms SLO.
    slow = {"max-num-seqs": 8, "max-num-batched-tokens": 4096, "kv-cache-memory-bytes": 268435456}
    study, tracker, _ = _run(
        tmp_path,
        trials=2,
        enqueue=[slow],
        objectives={"preset": "default", "slos": ["p95_ttft_ms<=500"]},
    )
    assert tracker.finish(study)
    _, children = _runs(tracking.local_tracking_uri(tmp_path / "out"))
    run = _by_trial(children)[1]
    assert run.data.tags["mlflow.runName"] == "trial-0001 slo missed"
    assert run.data.tags["slo_met"] == "false" and run.info.status == "FINISHED"


def test_pareto_html_is_small_and_draws_only_measured_trials(tmp_path: Path) -> None:
    study, tracker, _ = _run(tmp_path, trials=4, enqueue=[DOMINATING, REJECTED, FAILING])
    assert tracker.finish(study)
    uri = tracking.local_tracking_uri(tmp_path / "out")
    parent, _ = _runs(uri)
    html = Path(
        MlflowClient(uri).download_artifacts(
            parent.info.run_id, "pareto/pareto_front.html", str(tmp_path)
        )
    )
    text = html.read_text()
    assert html.stat().st_size < 100_000, "plotly.js must come from the CDN, not inline"
    assert "cdn.plot.ly" in text
    # Trials 2 (rejected) and 3 (failed) carry 1e9 placeholders: never drawn.
    assert "1000000000" not in text and "1e+09" not in text and "1e9" not in text

    def drawn(n: int) -> bool:  # hover texts, "<" as plotly's JSON escapes it
        return f"trial {n}\\u003cbr" in text or f"trial {n}<br>" in text

    assert drawn(0) and drawn(1) and not drawn(2) and not drawn(3)


def test_parent_run_holds_the_gain_over_the_baseline_and_the_report_up_front(
    tmp_path: Path,
) -> None:
    study, tracker, _ = _run(tmp_path, trials=2, enqueue=[DOMINATING])
    assert tracker.finish(study)
    uri = tracking.local_tracking_uri(tmp_path / "out")
    parent, _ = _runs(uri)
    base, best = study.get_trials()[0], study.get_trials()[1]
    assert 1 in _front(study)
    metrics = parent.data.metrics
    ttft_gain = (1 - best.values[0] / base.values[0]) * 100  # minimized: lower is a gain
    assert metrics["gain_pct.p95_ttft_ms"] == pytest.approx(ttft_gain)
    assert metrics["gain_trial.p95_ttft_ms"] == 1
    assert {k for k in metrics if k.startswith("gain_pct.")} == {
        f"gain_pct.{n}" for n in study.metric_names or []
    }
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("**Best gain over the baseline**")
    assert f"- p95_ttft_ms: {ttft_gain:+.1f}% (trial 1)" in note
    assert "# Study `fake-mlflow`" in note  # the report follows the headline


def test_the_headline_says_why_there_is_no_percentage() -> None:
    from optimizer.analysis.documents import headline_md
    from optimizer.analysis.front import best_gains

    base = {"trial": 0, "baseline": True, "gain_pct": {"capacity_rps": None}}
    best = {"trial": 3, "baseline": False, "gain_pct": {"capacity_rps": None}}
    # A capacity study whose baseline carried nothing: a front, but no percentage.
    text = headline_md([base, best], best_gains([base, best]))
    assert "not a percentage: the baseline measured 0" in text and "[3]" in text
    assert "no feasible configuration beyond the baseline yet" in headline_md([base], {})
    gained = {**best, "gain_pct": {"capacity_rps": 40.0}}
    assert "- capacity_rps: +40.0% (trial 3)" in headline_md([base, gained], best_gains([gained]))


def test_a_refused_configuration_is_named_with_its_numbers_in_mlflow(tmp_path: Path) -> None:
    from optimizer.quality.check import Comparison, Verdict
    from optimizer.quality.stage import record_verdict

    study, tracker, _ = _run(tmp_path, trials=2)
    moved, floor = Comparison(64, 0.875, 0.25, 1.5), Comparison(64, 1.0, 0.0, 0.0)
    verdict = Verdict("fail", "logprob drift 0.2500 over the floor > 0.1 nats", {}, moved, floor)
    record_verdict(study, study.trials[1], verdict)
    assert tracker.finish(study)
    _, children = _runs(tracking.local_tracking_uri(tmp_path / "out"))
    run = _by_trial(children)[1]
    assert run.data.tags["quality"] == "fail"
    assert run.data.tags["quality.reason"].startswith("logprob drift 0.2500")
    assert run.data.metrics["quality.top1_agreement"] == 0.875
    assert run.data.metrics["quality.logprob_drift"] == 0.25
    assert run.data.metrics["quality.floor_drift"] == 0.0
    assert "quality" not in _by_trial(children)[0].data.tags
