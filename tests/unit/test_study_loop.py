"""The study loop with a FAKE runner (no vLLM): baseline, failures as data, retries,
rejections, budget, resume after a dead driver."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.config import load_job
from optimizer.errors import ConfigError, SearchSpaceError, TrialNodeLost
from optimizer.report import front_rows, study_status
from optimizer.sampling import KnowledgeSampler
from optimizer.study import prepare
from optimizer.study_driver import StudyDriver, is_baseline
from optimizer.trial_view import TrialView
from optimizer.types import FailureClass, TrialResult, TrialSpec, TrialStatus
from tests.fakes.trials import FakeHandle, ScriptedRunner

REPO = Path(__file__).resolve().parents[2]


class FakeRunner(ScriptedRunner):
    """Scores a configuration with a made-up but deterministic model of a server.

    More max-num-seqs: more throughput and more TPOT; a `kv-cache-memory-bytes` of 1 fails like a
    KV cache too small; `fail_replay_once` makes the first attempt of each trial invalid.
    """

    def __init__(self, fail_replay_once: bool = False) -> None:
        super().__init__()
        self.fail_replay_once = fail_replay_once

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        self.specs.append(spec)
        args = spec.engine.args
        if args.get("kv-cache-memory-bytes") == 1:
            return FakeHandle(
                spec,
                TrialResult(
                    number=spec.number,
                    status=TrialStatus.FAILED,
                    failure_class=FailureClass.KV_CACHE_TOO_SMALL,
                    message="kv too small",
                ),
            )
        if args.get("max-num-batched-tokens") == 1024:
            # Stopped early: TTFT far over its SLO in the partial window.
            return FakeHandle(
                spec,
                TrialResult(
                    number=spec.number,
                    status=TrialStatus.INFEASIBLE,
                    message="SLO out of reach",
                    summary={
                        "p95_ttft_ms": 1600.0,
                        "p95_tpot_ms": 5.0,
                        "output_throughput": 3.0,
                        "error_rate": 0.0,
                        "completed": 4,
                    },
                ),
            )
        if self.fail_replay_once and spec.workdir.endswith("attempt-0"):
            return FakeHandle(
                spec,
                TrialResult(number=spec.number, status=TrialStatus.INVALID_REPLAY, message="lag"),
            )
        seqs = float(args.get("max-num-seqs", 128))
        summary = {
            "p95_ttft_ms": 2000.0 / seqs**0.5 + 10,
            "p95_tpot_ms": 5.0 + seqs / 10.0,
            "output_throughput": 10.0 * seqs**0.5,
            "error_rate": 0.0,
            "completed": 10,
        }
        return FakeHandle(
            spec,
            TrialResult(
                number=spec.number,
                status=TrialStatus.COMPLETE,
                summary=summary,
                startup_s=1.0,
                replay_s=1.0,
            ),
        )


def _job(tmp_path: Path, **over: Any) -> dict[str, Any]:
    job = {
        "name": "fake",
        "model": {"path": str(tmp_path / "model"), "make": "tiny"},
        "engine": {"args": {"max-model-len": 2048}},
        "trace": {
            "path": str(REPO / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {"window_s": [0, 40], "max_model_len": 2048, "max_output_tokens": 32},
            "warmup_requests": 2,
        },
        "search_space": {
            "name": "t",
            "params": {
                "max-num-seqs": {"type": "int", "low": 1, "high": 256, "log": True},
                "max-num-batched-tokens": {"type": "categorical", "choices": [64, 4096]},
                "enable-chunked-prefill": {"type": "categorical", "choices": [True]},
            },
        },
        "objectives": {"preset": "default", "slos": ["p95_ttft_ms<=400"]},
        "sampler": {"name": "random", "seed": 1},
        "trials": 6,
        "out": str(tmp_path / "out"),
    }
    job.update(over)
    return job


def _driver(tmp_path: Path, runner: Any, **over: Any) -> StudyDriver:
    job, base = load_job(_job(tmp_path, **over), base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    return StudyDriver(plan, runner, heartbeat_interval_s=1, grace_period_s=2)


def test_baseline_first_then_tuned_trials_with_constraints(tmp_path: Path) -> None:
    runner = FakeRunner()
    study = _driver(tmp_path, runner).run()
    trials = study.get_trials()
    assert len(trials) == 6
    assert is_baseline(trials[0]) and not any(is_baseline(t) for t in trials[1:])
    # The baseline ran vLLM's CPU defaults, written down explicitly (DESIGN.md §7.5).
    base_args = runner.specs[0].engine.args
    assert base_args["max-num-seqs"] == 128 and base_args["max-num-batched-tokens"] == 2048
    for t in trials:
        assert t.state in (TrialState.COMPLETE,)
        assert "p95_ttft_ms<=400" in t.constraints
    # best_trials is the feasible front: every member meets the SLO.
    assert all(t.constraints["p95_ttft_ms<=400"] <= 0 for t in study.best_trials)
    rows = front_rows(study)
    assert rows[0].baseline and rows[0].number == 0
    # Prompts are fresh per trial.
    assert len({s.seed for s in runner.specs}) == len(runner.specs)


def test_invalid_combination_never_starts_an_engine(tmp_path: Path) -> None:
    runner = FakeRunner()
    space = {
        "name": "t",
        "params": {
            "max-num-seqs": {"type": "categorical", "choices": [128]},
            "max-num-batched-tokens": {"type": "categorical", "choices": [64]},
        },
    }
    study = _driver(tmp_path, runner, search_space=space, trials=3).run()
    rejected = [t for t in study.get_trials() if t.user_attrs.get("status") == "rejected"]
    assert len(rejected) == 2
    assert all("max-num-batched-tokens" in t.user_attrs["message"] for t in rejected)
    assert all(
        t.state == TrialState.COMPLETE and t.constraints["p95_ttft_ms<=400"] > 0 for t in rejected
    )
    assert len(runner.specs) == 1  # only the baseline started an engine


def test_engine_failure_is_a_result_with_its_failure_class(tmp_path: Path) -> None:
    runner = FakeRunner()
    space = {
        "name": "t",
        "params": {
            "kv-cache-memory-bytes": {"type": "categorical", "choices": [1]},
        },
    }
    study = _driver(tmp_path, runner, search_space=space, trials=2).run()
    failed = study.get_trials()[1]
    assert failed.state == TrialState.COMPLETE
    assert failed.user_attrs["status"] == "failed"
    assert failed.user_attrs["failure_class"] == "kv_cache_too_small"
    assert failed.values[0] >= 1e6 and failed.values[2] == 0.0  # worst TTFT, worst throughput
    assert failed.constraints["p95_ttft_ms<=400"] > 0
    assert failed not in study.best_trials


def test_invalid_replay_is_retried_not_scored(tmp_path: Path) -> None:
    runner = FakeRunner(fail_replay_once=True)
    study = _driver(tmp_path, runner, trials=2).run()
    trials = study.get_trials()
    assert len(trials) == 2 and all(t.state == TrialState.COMPLETE for t in trials)
    assert all(t.user_attrs["attempts"] == 2 for t in trials)
    assert [s.workdir.rsplit("/", 1)[-1] for s in runner.specs] == ["attempt-0", "attempt-1"] * 2


def test_invalid_replay_beyond_retries_fails_the_trial(tmp_path: Path) -> None:
    runner = FakeRunner(fail_replay_once=True)
    study = _driver(tmp_path, runner, trials=2, retries=0).run()
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.FAIL]


class NodeLosingRunner(FakeRunner):
    """FAKE: every tuned trial's first ``times`` attempts end as the Ray runner ends a trial
    whose node died under it (:class:`TrialNodeLost`); then it runs as FakeRunner scores it."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times
        self.losses: dict[int, int] = {}

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        if spec.number > 0 and self.losses.get(spec.number, 0) < self.times:
            self.specs.append(spec)
            self.losses[spec.number] = self.losses.get(spec.number, 0) + 1
            handle = FakeHandle(spec)
            handle.future.set_exception(TrialNodeLost("node 10.0.0.7 died", "n7"))
            return handle
        return super().submit(spec, gpus)


def test_a_trial_lost_with_its_node_runs_once_more_and_only_its_measurement_is_told(
    tmp_path: Path,
) -> None:
    """Issue 45, item 2: a trial whose node died is not a failure of its configuration: it
    runs once more (its second attempt) and is told what that attempt measured."""
    runner = NodeLosingRunner(times=1)
    study = _driver(tmp_path, runner, trials=3, retries=0).run()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert [TrialView(t).status for t in trials] == ["complete"] * 3
    assert [t.user_attrs.get("nodes_lost") for t in trials] == [None, ["n7"], ["n7"]]
    assert [t.user_attrs["attempts"] for t in trials] == [1, 2, 2]
    attempts = [(s.number, s.workdir.rsplit("/", 1)[-1]) for s in runner.specs]
    assert attempts == [
        (0, "attempt-0"),
        (1, "attempt-0"),
        (1, "attempt-1"),
        (2, "attempt-0"),
        (2, "attempt-1"),
    ]


def test_a_trial_lost_twice_is_lost_and_never_told_as_a_failure(tmp_path: Path) -> None:
    """Lost again on its second run: ``lost``, told to Optuna as FAIL (no values, no
    constraints: nothing for a sampler to learn), never as the worst-valued failure an engine
    crash is; not run a third time."""
    runner = NodeLosingRunner(times=5)
    study = _driver(tmp_path, runner, trials=3, retries=0).run()
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL]
    assert [TrialView(t).status for t in trials[1:]] == ["lost", "lost"]
    assert all(t.values is None and not t.system_attrs.get("constraints") for t in trials[1:])
    assert trials[1].user_attrs["nodes_lost"] == ["n7", "n7"]
    assert "node 10.0.0.7 died" in trials[1].user_attrs["message"]
    assert runner.losses == {1: 2, 2: 2}


class SlowRunner(FakeRunner):
    """FAKE: FakeRunner's results, each after ``delay_s`` (trials overlap in time)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        done = super().submit(spec, gpus).future.result()
        handle = FakeHandle(spec)
        threading.Timer(self.delay_s, handle.future.set_result, (done,)).start()
        return handle


def test_two_drivers_of_one_new_study_measure_one_baseline_and_no_configuration_twice(
    tmp_path: Path,
) -> None:
    """Issue 45, item 3: two drivers start one study at once on one storage (as on two
    nodes), with the same sampler seed, so both enqueue a baseline and propose the same
    configurations in the same order. Each configuration is measured once (the trial numbered
    first; the other is a duplicate), and there is one baseline."""
    drivers = [_driver(tmp_path, SlowRunner(0.3), trials=8) for _ in range(2)]
    threads = [threading.Thread(target=d.run) for d in drivers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    trials = drivers[0].study.get_trials()
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    measured = [t for t in trials if t.state == TrialState.COMPLETE]
    args = [TrialView(t).engine_args_key for t in measured]
    assert len(args) == len(set(args)), args
    assert sum(1 for t in measured if TrialView(t).is_baseline) == 1
    duplicates = [t for t in trials if TrialView(t).status == "duplicate"]
    assert duplicates, "the drivers never launched one configuration at once: no test"
    assert all(t.user_attrs["duplicate_of"] < t.number for t in duplicates)


def test_budget_stops_launching(tmp_path: Path) -> None:
    runner = FakeRunner()
    clock = {"t": datetime(2026, 1, 1, 22, 0)}

    def now() -> datetime:
        clock["t"] += timedelta(minutes=10)  # each look at the clock: 10 minutes later
        return clock["t"]

    job, base = load_job(_job(tmp_path, trials=None, budget="1h"), base=tmp_path)
    driver = StudyDriver(prepare(job, base, check_flags=False), runner, now=now)
    study = driver.run()
    assert 1 <= len(study.get_trials()) < 7
    assert driver.budget_left() == timedelta(0)


def test_resume_fails_dead_drivers_trials_and_requeues_their_configuration(tmp_path: Path) -> None:
    runner = FakeRunner()
    _driver(tmp_path, runner, trials=2).run()
    # Simulate a driver that asked trial 2 and died (a real process that exited).
    storage_url = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    study = optuna.load_study(study_name="fake", storage=storage_url)
    # The orphan's configuration is one the study does not hold, as the driver's sampler would
    # propose: drawn here by the loaded study's own (unseeded) sampler, it matched trial 1's at
    # times, and a re-queued duplicate is not measured again (3 trials complete, not 4).
    held = {t.params.get("max-num-seqs") for t in study.trials}
    seqs = next(n for n in (3, 5, 7, 11, 13) if n not in held)
    study.enqueue_trial(
        {"max-num-seqs": seqs, "max-num-batched-tokens": 4096, "enable-chunked-prefill": True}
    )
    orphan = study.ask()
    orphan.suggest_int("max-num-seqs", 1, 256, log=True)
    orphan.suggest_categorical("max-num-batched-tokens", [64, 4096])
    orphan.suggest_categorical("enable-chunked-prefill", [True])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import psutil

    study._storage.set_trial_system_attr(
        orphan._trial_id,
        "driver",
        {
            "host": __import__("socket").gethostname(),
            "pid": dead.pid,
            "create_time": psutil.Process().create_time(),
        },
    )
    lost_params = dict(orphan.params)

    runner2 = FakeRunner()
    study = _driver(tmp_path, runner2, trials=4).run()
    trials = study.get_trials()
    assert trials[2].state == TrialState.FAIL and trials[2].user_attrs["status"] == "driver_died"
    # The lost configuration ran again as a new trial; nothing double counted.
    retried = [t for t in trials if t.user_attrs.get("retry_of") == 2]
    assert len(retried) == 1 and retried[0].params == lost_params
    assert sum(1 for t in trials if t.state == TrialState.COMPLETE) == 4
    assert sum(1 for t in trials if is_baseline(t)) == 1
    st = study_status(study)
    assert st.done == 4 and st.running == 0
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["study"] == "fake"


def test_job_typos_name_the_key_and_the_fix(tmp_path: Path) -> None:
    from optimizer.errors import ConfigError

    bad = _job(tmp_path)
    bad["trace"] = {**bad["trace"], "warmup_request": 3}
    with pytest.raises(
        ConfigError, match=r"trace\.warmup_request: unknown key; did you mean 'warmup_requests'"
    ):
        load_job(bad, base=tmp_path)
    with pytest.raises(ConfigError, match="budget"):
        load_job(_job(tmp_path, budget="soon"), base=tmp_path)


def test_early_stopped_trial_tells_no_partial_figures_to_the_sampler(tmp_path: Path) -> None:
    space = {
        "name": "t",
        "params": {
            "max-num-batched-tokens": {"type": "categorical", "choices": [1024]},
        },
    }
    runner = FakeRunner()
    study = _driver(
        tmp_path,
        runner,
        search_space=space,
        trials=2,
        objectives={"preset": "default", "slos": ["p95_ttft_ms<=400", "p95_tpot_ms<=50"]},
    ).run()
    stopped = study.get_trials()[1]
    assert stopped.user_attrs["status"] == "infeasible"
    # Early stop is for tuned trials; the baseline always replays the whole trace.
    assert [s.early_stop for s in runner.specs] == [False, True]
    # The partial window said TTFT 1600 ms (3x over 400) and TPOT 5 ms (met): figures whose
    # value depends on when the stop came. The sampler is told every SLO violated (1.0) and
    # worst-case values, never the partial margins; the partial summary is kept for review.
    assert stopped.constraints["p95_ttft_ms<=400"] == pytest.approx(1.0)
    assert stopped.constraints["p95_tpot_ms<=50"] == pytest.approx(1.0)
    assert stopped.values[0] >= 1e6
    assert stopped.user_attrs["summary"]["p95_ttft_ms"] == 1600.0
    assert stopped not in study.best_trials


class _HangingRunner(FakeRunner):
    """Trial 0 (the baseline) finishes; later trials run until cancelled, and a cancelled
    trial's future fails the way a killed Ray actor's does."""

    def __init__(self) -> None:
        super().__init__()
        self.started = __import__("threading").Event()

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        if spec.number == 0:
            return super().submit(spec, gpus)
        self.specs.append(spec)
        handle = FakeHandle(spec)  # pending until cancelled
        self.started.set()
        return handle

    def cancel(self, handle: FakeHandle) -> None:
        if not handle.future.done():
            handle.future.set_exception(RuntimeError("the actor died unexpectedly"))


def test_cancelled_trial_is_not_told_as_an_engine_failure(tmp_path: Path) -> None:
    import threading

    runner = _HangingRunner()
    driver = _driver(tmp_path, runner, trials=3)
    done: dict[str, optuna.Study] = {}
    thread = threading.Thread(target=lambda: done.setdefault("study", driver.run()))
    thread.start()
    assert runner.started.wait(30)
    driver.cancel()
    thread.join(30)
    trials = done["study"].get_trials()
    cancelled = trials[1]
    # Not a result: the sampler never learns "this configuration fails" from a cancel.
    assert cancelled.state == TrialState.FAIL
    assert cancelled.user_attrs["status"] == "cancelled"
    assert cancelled.constraints == {}
    assert trials[0].state == TrialState.COMPLETE


def test_without_slos_every_told_trial_carries_the_same_constraint(tmp_path: Path) -> None:
    space = {
        "name": "t",
        "params": {
            "max-num-seqs": {"type": "int", "low": 1, "high": 256, "log": True},
            "kv-cache-memory-bytes": {"type": "categorical", "choices": [1, 2**30]},
        },
    }
    study = _driver(
        tmp_path,
        FakeRunner(),
        search_space=space,
        trials=8,
        objectives={"preset": "default", "slos": []},
    ).run()
    told = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    failed = [t for t in told if t.user_attrs["status"] == "failed"]
    measured = [t for t in told if t.user_attrs["status"] == "complete"]
    assert failed and measured
    # One constraint on every told trial (GPSampler refuses trials with different numbers of
    # constraints); measured ones meet it, so the feasibility filter keeps them.
    assert {frozenset(t.constraints) for t in told} == {frozenset({"engine_served"})}
    assert all(t.constraints["engine_served"] <= 0 for t in measured)
    assert all(t.constraints["engine_served"] > 0 for t in failed)
    assert study.best_trials and all(t in measured for t in study.best_trials)


def test_resumed_seeded_study_never_reruns_a_measured_configuration(tmp_path: Path) -> None:
    _driver(tmp_path, FakeRunner(), trials=2).run()
    runner = FakeRunner()
    study = _driver(tmp_path, runner, trials=5).run()
    tuned = [json.dumps(s.engine.args, sort_keys=True) for s in runner.specs if s.number != 0]
    first = json.loads(study.get_trials()[1].user_attrs["engine_args"])
    # The resumed driver (same seed) starts no engine for trial 1's configuration again.
    assert json.dumps(first, sort_keys=True) not in tuned
    measured = [
        t.user_attrs["engine_args"]
        for t in study.get_trials()
        if t.user_attrs.get("status") == "complete"
    ]
    assert len(measured) == len(set(measured))


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin", "model.pt"])
def test_a_model_folder_with_weights_is_never_served_dummy_weights(
    tmp_path: Path, weights: str
) -> None:
    from optimizer.engine.models import make_model

    make_model(str(tmp_path / "model"), "tiny", max_model_len=2048)
    (tmp_path / "model" / weights).write_bytes(b"\0")
    job, base = load_job(_job(tmp_path), base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    assert "load-format" not in plan.engine.args
    assert "load-format" not in plan.baseline_args


def test_a_model_folder_without_weights_is_served_dummy_weights(tmp_path: Path) -> None:
    job, base = load_job(_job(tmp_path), base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    assert plan.engine.args["load-format"] == "dummy"


def test_enqueue_in_the_job_is_honoured_when_the_study_resumes(tmp_path: Path) -> None:
    _driver(tmp_path, FakeRunner(), trials=2).run()
    new = {"max-num-seqs": 200, "max-num-batched-tokens": 4096, "enable-chunked-prefill": True}
    events: list[Any] = []
    driver = _driver(tmp_path, FakeRunner(), trials=4, enqueue=[new])
    driver.on_event = events.append
    study = driver.run()
    trials = study.get_trials()
    assert len(trials) == 4
    assert trials[2].params["max-num-seqs"] == 200 and trials[2].user_attrs.get("enqueued")
    assert [e.number for e in events if e.kind == "enqueued"] == [2]
    # Resumed again with the same job: a configuration the study holds is not run twice.
    driver = _driver(tmp_path, FakeRunner(), trials=5, enqueue=[new])
    study = driver.run()
    assert sum(1 for t in study.get_trials() if t.params.get("max-num-seqs") == 200) == 1
    # The trial count already reached: said, not dropped silently.
    other = {**new, "max-num-seqs": 201}
    events.clear()
    driver = _driver(tmp_path, FakeRunner(), trials=5, enqueue=[other])
    driver.on_event = events.append
    study = driver.run()
    refused = [e for e in events if e.kind == "enqueue_refused"]
    assert len(refused) == 1 and '"max-num-seqs": 201' in refused[0].detail
    assert "--trials" in refused[0].detail and len(study.get_trials()) == 5


_GRID_SPACE = {
    "name": "g",
    "params": {
        "max-num-seqs": {"type": "categorical", "choices": [4, 16, 64]},
        "max-num-batched-tokens": {"type": "int", "low": 512, "high": 1024, "step": 512},
    },
}


def test_grid_sampler_measures_every_point_once_then_stops_and_resumes(tmp_path: Path) -> None:
    """6 grid points and the baseline; a driver stopped after 4 trials resumes where it was."""
    over = {"search_space": _GRID_SPACE, "sampler": {"name": "grid", "seed": 3}}
    _driver(tmp_path, FakeRunner(), trials=4, **over).run()
    runner = FakeRunner()
    study = _driver(tmp_path, runner, trials=20, **over).run()
    trials = study.get_trials()
    # The grid is exhausted after 7 trials although 20 were allowed; no point twice.
    assert len(trials) == 7 and is_baseline(trials[0])
    grid = {
        (
            json.loads(t.user_attrs["engine_args"])["max-num-seqs"],
            json.loads(t.user_attrs["engine_args"])["max-num-batched-tokens"],
        )
        for t in trials[1:]
    }
    assert grid == {(s, b) for s in (4, 16, 64) for b in (512, 1024)}
    assert len(runner.specs) == 3  # the resumed driver measured only what was left


def test_grid_sampler_resumed_with_another_seed_and_an_enqueued_point_measures_each_once(
    tmp_path: Path,
) -> None:
    """Optuna numbers the grid in a seed-shuffled order: resumed with another seed, its measured
    points would be read as others (seen: a 36-point grid study measured 9 points twice and left
    8 out). Here the numbering is the seed's no more, and an enqueued point counts as taken."""
    grid = {"name": "grid", "seed": 0}
    point = {"max-num-seqs": 16, "max-num-batched-tokens": 1024}
    _driver(tmp_path, FakeRunner(), trials=3, search_space=_GRID_SPACE, sampler=grid).run()
    runner = FakeRunner()
    study = _driver(
        tmp_path,
        runner,
        trials=20,
        search_space=_GRID_SPACE,
        sampler={**grid, "seed": 7},
        enqueue=[point],
    ).run()
    trials = study.get_trials()
    measured = [
        (
            json.loads(t.user_attrs["engine_args"])["max-num-seqs"],
            json.loads(t.user_attrs["engine_args"])["max-num-batched-tokens"],
        )
        for t in trials[1:]
    ]
    assert sorted(measured) == sorted({(s, b) for s in (4, 16, 64) for b in (512, 1024)})
    assert all(t.state == TrialState.COMPLETE for t in trials)  # no duplicate was even proposed
    assert len(trials) == 7 and len(runner.specs) == 4


def test_grid_sampler_refuses_a_continuous_param_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(SearchSpaceError, match=r"max-num-seqs.*categorical.*step"):
        _driver(tmp_path, FakeRunner(), sampler={"name": "grid"})


def test_warm_start_enqueues_the_best_of_an_earlier_study_after_the_baseline(
    tmp_path: Path,
) -> None:
    from optimizer.analysis.documents import warm_start_section

    loose = {"preset": "default", "slos": ["p95_ttft_ms<=1000"]}
    earlier = _driver(
        tmp_path / "a", FakeRunner(), out=str(tmp_path / "a" / "out"), objectives=loose
    ).run()
    feasible = [
        t for t in earlier.get_trials() if t.number and all(v <= 0 for v in t.constraints.values())
    ]
    assert feasible, "the earlier (fake) study needs feasible trials"
    warm = {"studies": [str(tmp_path / "a" / "out")], "top": 2}
    runner = FakeRunner()
    study = _driver(
        tmp_path / "b",
        runner,
        out=str(tmp_path / "b" / "out"),
        warm_start=warm,
        trials=4,
        sampler={"name": "tpe", "seed": 1},
        objectives=loose,  # the same objectives and SLOs: the earlier trials are priors here
    ).run()
    trials = study.get_trials()
    assert is_baseline(trials[0])
    sources = [t.user_attrs.get("warm_start_from") for t in trials[1:3]]
    assert all(s and s.startswith(str(tmp_path / "a" / "out") + " trial ") for s in sources)
    # Each warm-start trial ran its earlier configuration's flags of this space.
    for t in trials[1:3]:
        number = int(t.user_attrs["warm_start_from"].rsplit(" ", 1)[1])
        before = json.loads(earlier.get_trials()[number].user_attrs["engine_args"])
        now = json.loads(t.user_attrs["engine_args"])
        assert now["max-num-seqs"] == before["max-num-seqs"]
        assert now["max-num-batched-tokens"] == before["max-num-batched-tokens"]
        assert all(v <= 0 for v in earlier.get_trials()[number].constraints.values())
    plan = json.loads((tmp_path / "b" / "out" / "plan.json").read_text())
    assert [w["trial"] for w in plan["warm_start"]] == [int(s.rsplit(" ", 1)[1]) for s in sources]
    section = "\n".join(warm_start_section(study, plan))
    assert "## Warm start" in section and "trial 1 here" in section
    # The sampler was also given the earlier study's told trials (not its baseline) as prior
    # observations, rebuilt on this space; this study holds none of them.
    told = [t for t in earlier.get_trials() if t.number and t.state == TrialState.COMPLETE]
    assert plan["warm_start_priors"]["trials"] == len(told) == 5
    sampler = study.sampler
    assert isinstance(sampler, KnowledgeSampler)
    assert [p.user_attrs["prior_from"].rsplit(" ", 1)[1] for p in sampler.priors] == [
        str(t.number) for t in told
    ]
    for prior, t in zip(sampler.priors, told, strict=True):
        assert prior.values == t.values and prior.params == {
            k: v for k, v in t.params.items() if k in prior.params
        }
        assert set(prior.distributions) == set(prior.params) and prior.number < 0
    assert all(t.number >= 0 for t in study.get_trials())
    assert "The tpe sampler was given 5 told trials" in section
    # A plan that does not name its sampler ran the default: the line names that one.
    from optimizer.analysis.documents import _priors_line

    unnamed = {"job": {"sampler": {"seed": 1}}}
    assert _priors_line(unnamed, plan["warm_start_priors"]).startswith("The rf sampler was given 5")


def test_warm_start_priors_only_from_studies_with_the_same_objectives(tmp_path: Path) -> None:
    loose = {"preset": "default", "slos": ["p95_ttft_ms<=1000"]}
    _driver(tmp_path / "a", FakeRunner(), out=str(tmp_path / "a" / "out"), objectives=loose).run()
    warm = {"studies": [str(tmp_path / "a" / "out")], "top": 1}

    def warm_driver(name: str, **over: Any) -> StudyDriver:
        job = {"warm_start": warm, "objectives": loose, "sampler": {"name": "tpe", "seed": 1}}
        return _driver(
            tmp_path / name, FakeRunner(), out=str(tmp_path / name / "out"), **{**job, **over}
        )

    other = warm_driver("b", objectives={"preset": "latency", "slos": ["p95_ttft_ms<=1000"]})
    assert other.plan.priors.trials == ()
    assert any("no prior trials for the sampler: its objectives" in n for n in other.plan.notes)
    tighter = warm_driver("e", objectives={"preset": "default", "slos": ["p95_ttft_ms<=500"]})
    assert tighter.plan.priors.trials == ()
    assert any("no prior trials for the sampler: its SLOs" in n for n in tighter.plan.notes)
    # A sampler that learns nothing from trials gets none, and the plan says so.
    rnd = warm_driver("c", sampler={"name": "random", "seed": 0})
    assert rnd.plan.priors.trials == ()
    assert any("the random sampler does not learn" in n for n in rnd.plan.notes)
    off = warm_driver("d", warm_start={**warm, "priors": False})
    assert off.plan.priors.trials == () and len(off.plan.warm_start) == 1
    assert len(warm_driver("f").plan.priors.trials) == 5
    # The forest learns from them too, and auto as the model it picks past the grid's size.
    assert len(warm_driver("g", sampler={"name": "rf", "seed": 0}).plan.priors.trials) == 5
    assert len(warm_driver("h", sampler={"name": "auto", "seed": 0}).plan.priors.trials) == 5


def test_the_random_forest_learns_from_a_warm_starts_priors(tmp_path: Path) -> None:
    # The default sampler takes the earlier study's told trials as observations: with 5 priors
    # (at least its 4 startup trials) its first own proposal is the forest's, not a startup draw.
    from optimizer.rf_sampler import RFSampler
    from optimizer.sampling import ORIGIN_ATTR

    loose = {"preset": "default", "slos": ["p95_ttft_ms<=1000"]}
    _driver(tmp_path / "a", FakeRunner(), out=str(tmp_path / "a" / "out"), objectives=loose).run()
    warm = {"studies": [str(tmp_path / "a" / "out")], "top": 1}
    study = _driver(
        tmp_path / "b",
        FakeRunner(),
        out=str(tmp_path / "b" / "out"),
        warm_start=warm,
        trials=3,
        objectives=loose,
        sampler={"name": "rf", "seed": 1},
    ).run()
    sampler = study.sampler
    assert isinstance(sampler, RFSampler) and len(sampler.priors) == 5
    assert all(p.number < 0 for p in sampler.priors)
    origins = [t.system_attrs.get(ORIGIN_ATTR) for t in study.get_trials()]
    assert origins[1:] == ["enqueued", "model"], origins


def test_warm_start_from_a_folder_that_is_no_study_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigError, match=r"warm_start\.studies\[0\]: .* is not a study folder \(no plan\.json\)"
    ):
        _driver(tmp_path, FakeRunner(), warm_start={"studies": [str(tmp_path / "empty")]})


_SPEC_SPACE = {
    "name": "spec",
    "params": {
        "max-num-seqs": {"type": "categorical", "choices": [4, 16]},
        "speculative-config.method": {"type": "categorical", "choices": ["ngram"]},
        "speculative-config.num_speculative_tokens": {"type": "categorical", "choices": [1, 3]},
    },
}


def test_speculation_on_random_weights_is_refused_without_a_stated_acceptance(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"random weights.*acceptance_length: 2\.5"):
        _driver(tmp_path, FakeRunner(), search_space=_SPEC_SPACE)
    assert not (tmp_path / "out").exists()  # nothing written for a refused job


def test_trials_with_speculation_run_the_synthetic_sampler_at_the_stated_acceptance(
    tmp_path: Path,
) -> None:
    runner = FakeRunner()
    engine = {"args": {"max-model-len": 2048}, "speculation": {"acceptance_length": 2.5}}
    study = _driver(
        tmp_path,
        runner,
        engine=engine,
        search_space=_SPEC_SPACE,
        sampler={"name": "grid", "seed": 0},
        trials=5,
    ).run()
    by_tokens: dict[int, list[Any]] = {}
    for t in study.get_trials()[1:]:
        spec = json.loads(t.user_attrs["engine_args"])["speculative-config"]
        by_tokens.setdefault(spec["num_speculative_tokens"], []).append((t, spec))
    # 3 tokens: the assumption reaches the server (and the trial's record).
    for t, spec in by_tokens[3]:
        assert spec["rejection_sample_method"] == "synthetic"
        assert spec["synthetic_acceptance_length"] == 2.5
        assert t.state == TrialState.COMPLETE
    # 1 token: a mean acceptance of 2.5 cannot happen (at most 2): refused before a server.
    for t, _ in by_tokens[1]:
        assert t.user_attrs["status"] == TrialStatus.REJECTED.value
        assert "cannot happen with num_speculative_tokens 1" in t.user_attrs["message"]
    started = [s.engine.args.get("speculative-config") for s in runner.specs]
    assert all(s is None or s["num_speculative_tokens"] == 3 for s in started)
    assert len(by_tokens[1]) == 2 and len(by_tokens[3]) == 2
    # The baseline has no speculation: untouched.
    assert "speculative-config" not in runner.specs[0].engine.args


def test_a_stated_acceptance_must_be_one_of_length_and_rates(tmp_path: Path) -> None:
    both = {"acceptance_length": 2.0, "acceptance_rates": [0.5]}
    with pytest.raises(ConfigError, match="exactly one of acceptance_length"):
        load_job(_job(tmp_path, engine={"speculation": both}), base=tmp_path)
    rising = {"acceptance_rates": [0.5, 0.9]}
    with pytest.raises(ConfigError, match="not increase"):
        load_job(_job(tmp_path, engine={"speculation": rising}), base=tmp_path)


def test_a_budget_study_stops_once_its_small_space_is_measured_through(tmp_path: Path) -> None:
    """No trial count, a long budget, a 2-point space: TPE proposes no measured configuration
    while one is free; then every proposal is a duplicate, and after MAX_REPEATS in a row the
    study stops launching instead of refusing duplicates until the budget ends."""
    from optimizer.study_driver import MAX_REPEATS
    from optimizer.trial_view import TrialView

    space = {"name": "two", "params": {"max-num-seqs": {"type": "categorical", "choices": [4, 16]}}}
    runner = FakeRunner()
    driver = _driver(
        tmp_path,
        runner,
        search_space=space,
        trials=None,
        budget="8h",
        sampler={"name": "tpe", "seed": 0},
    )
    events: list[Any] = []
    driver.on_event = events.append
    study = driver.run()
    assert len(runner.specs) == 3  # the baseline and both configurations, each once
    statuses = [TrialView(t).status for t in study.get_trials()]
    assert statuses.count("duplicate") == MAX_REPEATS
    assert [e.kind for e in events if e.kind == "exhausted"] == ["exhausted"]


def test_a_gp_study_warm_started_with_prior_trials_runs(tmp_path: Path) -> None:
    """GP reads constraints: the priors carry the SLO margins they were told, so the mix of
    prior and own trials is one kind of trial (without them GP raised at its first model)."""
    loose = {"preset": "default", "slos": ["p95_ttft_ms<=1000"]}
    _driver(tmp_path / "a", FakeRunner(), out=str(tmp_path / "a" / "out"), objectives=loose).run()
    runner = FakeRunner()
    driver = _driver(
        tmp_path / "b",
        runner,
        out=str(tmp_path / "b" / "out"),
        objectives=loose,
        warm_start={"studies": [str(tmp_path / "a" / "out")], "top": 1},
        sampler={"name": "gp", "seed": 0, "n_startup_trials": 2},
        trials=6,
    )
    assert driver.plan.priors.trials and all(p.constraints for p in driver.plan.priors.trials)
    study = driver.run()
    statuses = [TrialView(t).status for t in study.get_trials()]
    assert len(statuses) == 6 and set(statuses) <= {"complete", "rejected"}, statuses
    assert len(runner.specs) == statuses.count("complete")


def test_a_prior_off_the_spaces_step_grid_is_left_out() -> None:
    from optimizer.warm_start import _on_space
    from search_spaces import load_space

    space = load_space(
        {
            "name": "s",
            "params": {
                "gpu-memory-utilization": {"type": "float", "low": 0.8, "high": 0.94, "step": 0.02}
            },
        }
    )
    assert _on_space(space, {"gpu-memory-utilization": 0.84}) is not None
    assert _on_space(space, {"gpu-memory-utilization": 0.85}) is None


def test_repeats_of_one_job_replay_other_requests_in_every_trial(tmp_path: Path) -> None:
    # Repeats of a table's job (--seed 1, 2, 3) are three measurements of each configuration:
    # the baseline (trial 0 in every repeat) must not replay the same requests in each.
    seeds = []
    for repeat in (1, 2):
        runner = FakeRunner()
        _driver(
            tmp_path / f"r{repeat}", runner, trials=2, sampler={"name": "random", "seed": repeat}
        ).run()
        seeds.append({s.number: s.seed for s in runner.specs})
    assert seeds[0][0] != seeds[1][0]
    assert seeds[0][1] != seeds[1][1]


@pytest.mark.parametrize("sampler", [{"name": "guided"}, {"name": "tpe", "startup": "guided"}])
def test_a_guided_study_moves_one_parameter_at_a_time_from_the_baseline(
    tmp_path: Path, sampler: dict[str, Any]
) -> None:
    from optimizer.guided import MOVE_ATTR
    from optimizer.sampling import ORIGIN_ATTR

    space = {
        "name": "t",
        "params": {
            "max-num-seqs": {"type": "categorical", "choices": [16, 64, 256]},
            "max-num-batched-tokens": {"type": "categorical", "choices": [512, 2048, 8192]},
        },
    }
    runner = FakeRunner()
    study = _driver(
        tmp_path, runner, trials=5, search_space=space, sampler={**sampler, "seed": 0}
    ).run()
    trials = study.get_trials()
    guided = [t for t in trials if t.system_attrs.get(ORIGIN_ATTR) == "guided"]
    assert len(guided) >= 3
    for t in guided:
        parent = trials[t.system_attrs[MOVE_ATTR]["from"]]
        base = {"max-num-seqs": 64, "max-num-batched-tokens": 2048}  # nearest the defaults
        before = parent.params or base
        assert sum(before[k] != t.params[k] for k in base) == 1
    measured = [json.dumps(t.params, sort_keys=True) for t in trials[1:]]
    assert len(measured) == len(set(measured))


def test_auto_picks_the_grid_where_the_budget_covers_the_space(tmp_path: Path) -> None:
    from optimizer.study_sampler import StudyGridSampler, job_sampler

    space = {
        "name": "t",
        "params": {
            "max-num-seqs": {"type": "categorical", "choices": [16, 64]},
            "max-num-batched-tokens": {"type": "categorical", "choices": [512, 2048]},
        },
    }
    from optimizer.rf_sampler import RFSampler

    for trials, kind in ((5, StudyGridSampler), (4, RFSampler)):
        job, base = load_job(
            _job(tmp_path, trials=trials, search_space=space, sampler={"name": "auto"}),
            base=tmp_path,
        )
        plan = prepare(job, base, check_flags=False)
        assert isinstance(job_sampler(plan.job, plan.space), kind), trials


def test_a_job_without_a_sampler_gets_the_verdicts_default_the_random_forest(
    tmp_path: Path,
) -> None:
    # benchmarks/RESULTS.md, "Search strategies": the forest with racing is the best measured
    # search with no loss on either table; a job that names no sampler runs it, and TPE's
    # acquisition wrapper is not what it gets.
    from optimizer.config import CapacitySection
    from optimizer.guided import GuidedSampler
    from optimizer.rf_sampler import RFSampler
    from optimizer.study_sampler import job_sampler

    raw = _job(tmp_path, trials=4)
    raw.pop("sampler")
    job, base = load_job(raw, base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    assert plan.job.sampler.name == "rf" and CapacitySection().racing
    sampler = job_sampler(plan.job, plan.space)
    assert isinstance(sampler, RFSampler) and not isinstance(sampler, KnowledgeSampler)
    startup = plan.job.sampler.model_copy(update={"startup": "guided"})
    guided = job_sampler(plan.job.model_copy(update={"sampler": startup}), plan.space)
    assert isinstance(guided, GuidedSampler) and isinstance(guided.fallback, RFSampler)


def test_an_rf_study_runs_with_smacs_random_forest(tmp_path: Path) -> None:
    from optimizer.rf_sampler import RFSampler
    from optimizer.sampling import ORIGIN_ATTR

    runner = FakeRunner()
    driver = _driver(tmp_path, runner, trials=7, sampler={"name": "rf", "seed": 0})
    study = driver.run()
    assert isinstance(study.sampler, RFSampler)
    origins = [t.system_attrs.get(ORIGIN_ATTR) for t in study.get_trials()[1:]]
    assert "model" in origins, origins
    measured = [json.dumps(t.params, sort_keys=True) for t in study.get_trials()[1:]]
    assert len(measured) == len(set(measured))


class _NodeCannotSeeRunner(FakeRunner):
    """A FAKE runner whose second trial lands on a node that cannot see the study's paths."""

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        if spec.number == 1:
            from optimizer.errors import ConfigError

            self.specs.append(spec)
            handle = FakeHandle(spec)
            handle.future.set_exception(ConfigError(f"node n1 cannot see {spec.workdir}"))
            return handle
        return super().submit(spec, gpus)


def test_a_node_that_cannot_run_a_trial_stops_the_study_and_teaches_the_sampler_nothing(
    tmp_path: Path,
) -> None:
    from optimizer.errors import ConfigError

    driver = _driver(tmp_path, _NodeCannotSeeRunner(), trials=4)
    with pytest.raises(ConfigError, match="node n1 cannot see"):
        driver.run()
    trial = driver.study.trials[1]
    assert trial.state == optuna.trial.TrialState.FAIL  # not a configuration's worst values
    assert TrialView(trial).status == "cancelled"
    assert TrialView(trial).message.startswith("not run: node n1 cannot see")
    assert len(driver.study.trials) == 2  # nothing launched after it


def test_a_driver_left_a_zombie_counts_as_dead_and_a_running_one_does_not() -> None:
    """A driver killed with its Ray node can stay a zombie where no init reaps orphans (seen
    in CI: the next driver left its trial RUNNING); a live driver is never judged dead."""
    import socket
    import time

    import psutil

    from optimizer.study_driver import _driver_dead

    def ident(pid: int) -> dict[str, Any]:
        return {
            "host": socket.gethostname(),
            "pid": pid,
            "create_time": psutil.Process(pid).create_time(),
        }

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        live_ident, zombie_ident = ident(live.pid), ident(zombie.pid)
        deadline = time.monotonic() + 30
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _driver_dead(zombie_ident)  # exited, not yet reaped
        assert not _driver_dead(live_ident)
        assert _driver_dead({**live_ident, "create_time": live_ident["create_time"] - 60})
        assert not _driver_dead({**zombie_ident, "host": "another-host"})  # heartbeat's call
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_a_running_driver_recovers_a_trial_whose_driver_dies_after_it_started(
    tmp_path: Path,
) -> None:
    """A driver on another host dies while this one runs: its trial's heartbeat expires only
    after this driver's start, and this driver fails and re-runs it while it runs (before,
    only a later start did, and the study ended with the trial RUNNING)."""
    import time

    class SlowRunner(FakeRunner):
        def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
            time.sleep(0.5)  # a trial takes time: the driver's loop goes round meanwhile
            return super().submit(spec, gpus)

    _driver(tmp_path, FakeRunner(), trials=2).run()
    storage_url = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    storage = optuna.storages.RDBStorage(storage_url, heartbeat_interval=1, grace_period=2)
    study = optuna.load_study(study_name="fake", storage=storage)
    orphan = study.ask()
    orphan.suggest_int("max-num-seqs", 1, 256, log=True)
    orphan.suggest_categorical("max-num-batched-tokens", [64, 4096])
    orphan.suggest_categorical("enable-chunked-prefill", [True])
    storage.set_trial_system_attr(
        orphan._trial_id, "driver", {"host": "another-host", "pid": 1, "create_time": 0.0}
    )
    storage.record_heartbeat(orphan._trial_id)  # alive when the next driver starts
    lost = orphan.number

    # 10 trials to run, 0.5 s each: the orphan's heartbeat (2 s grace) expires mid-run
    study = _driver(tmp_path, SlowRunner(), trials=12).run()
    trials = study.get_trials()
    assert trials[lost].state == TrialState.FAIL
    retried = [t for t in trials if t.user_attrs.get("retry_of") == lost]
    assert len(retried) == 1 and retried[0].params == orphan.params
    assert retried[0].state == TrialState.COMPLETE
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]


def test_a_driver_busy_past_the_grace_period_keeps_its_trials_alive(tmp_path: Path) -> None:
    """The heartbeats beat apart from the loop: a driver held for longer than the grace
    period (here in a trial's submission) never has its trial failed as stale by another
    driver's recovery (before, heartbeats were recorded by the loop, between its waits)."""
    import time

    release = threading.Event()
    held: list[int] = []

    class HeldRunner(FakeRunner):
        def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
            if spec.number == 1:
                held.append(spec.number)
                release.wait(20)
            return super().submit(spec, gpus)

    driver = _driver(tmp_path, HeldRunner(), trials=3)
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(driver.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not held:
        assert time.monotonic() < deadline, "trial 1 never reached its submission"
        time.sleep(0.05)
    time.sleep(3.5)  # the grace period is 2 s
    storage_url = f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    other = optuna.storages.RDBStorage(storage_url, heartbeat_interval=1, grace_period=2)
    study = optuna.load_study(study_name="fake", storage=other)
    optuna.storages.fail_stale_trials(study)  # what another driver's recovery runs
    assert study.get_trials()[1].state == TrialState.RUNNING
    release.set()
    thread.join(60)
    assert done and done[0].get_trials()[1].state == TrialState.COMPLETE
