"""Progress of a running trial (issue 17, "Console"): run_trial with a FAKE engine writes its
phase and replay progress to progress.json in its folder, a few times per trial and never per
request, from the isolated client process too; the study driver reads the file and emits
``progress`` events; the lines say what a user wants to know."""

from __future__ import annotations

import json
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from optimizer import trial as trial_mod
from optimizer.capacity.search import StepOutcome
from optimizer.study_driver import StudyEvent
from optimizer.trial_io import TrialProgress, progress_line, read_progress
from optimizer.types import TrialSpec, TrialStatus
from optimizer.workload.replay import ReplayProgress
from tests.fakes.trials import FakeEngine, FakeHandle
from tests.unit.test_study_loop import FakeRunner, _driver
from tests.unit.test_trial_outcomes import _spec


def test_run_trial_writes_its_phases_and_replay_progress_but_not_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[dict[str, Any]] = []
    real = TrialProgress._write

    def spy(self: TrialProgress, *, force: bool = False) -> None:
        before = self._last
        real(self, force=force)
        if self._last != before:
            writes.append(json.loads(self.path.read_text()))

    monkeypatch.setattr(TrialProgress, "_write", spy)
    seen: list[ReplayProgress] = []
    spec = _spec(tmp_path, n=50, gap_s=0.06)  # 3 s of replay
    result = trial_mod.run_trial(spec, engine=FakeEngine(ttft_s=0.02), progress=seen.append)
    assert result.status is TrialStatus.COMPLETE, result.message
    phases = [w["phase"] for w in writes]
    assert phases[0] == "starting server" and phases[-1] == "stopping server"
    assert "replaying" in phases
    replay = [w for w in writes if "total" in w]
    last = replay[-1]
    assert (last["completed"], last["total"]) == (50, 50)
    assert last["p95_ttft_ms"] >= 20.0
    assert progress_line(last).startswith("replaying 50/50 done, p95 TTFT so far ")
    # The caller's display gets the replay's progress as before; the file a few writes only.
    assert len(seen) >= 10  # every 0.2 s of replay
    assert len(writes) <= 8, [w["phase"] for w in writes]
    assert read_progress(spec.workdir) == {**writes[-1]}


def test_the_isolated_client_process_reports_through_the_same_file(tmp_path: Path) -> None:
    reporter = TrialProgress(tmp_path, forward=print)
    copy = pickle.loads(pickle.dumps(reporter))
    assert copy.forward is None and copy.path == reporter.path  # a display stays at home

    spec = _spec(tmp_path, n=40, gap_s=0.1)  # 4 s of replay: a write every 2 s
    docs: list[dict[str, Any]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            doc = read_progress(spec.workdir)
            if doc is not None and doc not in docs:
                docs.append(doc)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        result = trial_mod.run_trial(spec, engine=FakeEngine(), isolate_client=True)
    finally:
        stop.set()
        poller.join(5)
    assert result.status is TrialStatus.COMPLETE, result.message
    from_client = [d for d in docs if d.get("phase") == "replaying" and d.get("total") == 40]
    assert from_client, [d.get("phase") for d in docs]
    # Only the client process sees the replay's counts: these came through the file.
    assert (read_progress(spec.workdir) or {}).get("phase") == "stopping server"


def test_progress_lines() -> None:
    assert progress_line({"phase": "starting server"}) == "starting server"
    doc = {"phase": "replaying", "completed": 120, "failed": 2, "total": 361, "p95_ttft_ms": 843.2}
    assert progress_line(doc) == "replaying 120/361 done (2 failed), p95 TTFT so far 843 ms"
    step = TrialProgress(Path("/nonexistent"))  # an unwritable folder is no error
    step.phase("capacity search")
    step.step(StepOutcome(scale=1.4, margins={"p95_ttft_ms<=500": -0.2}))
    step.step(StepOutcome(scale=2.0, margins={"p95_ttft_ms<=500": 0.3}, reason="p95 TTFT +30%"))
    # Between steps: only the previous step's verdict.
    assert progress_line(step.doc) == "capacity search: 2 steps done, previous x2: p95 TTFT +30%"
    # The next step names its own scale, and its counts are its own.
    step.step_started(1.7, "pre-roll of 12 requests first")
    assert progress_line(step.doc) == (
        "capacity search: replaying x1.7 (pre-roll of 12 requests first) | 2 steps done, "
        "previous x2: p95 TTFT +30%"
    )
    step.step_started(1.7)
    step(ReplayProgress(elapsed_s=3, total=361, sent=41, completed=40, failed=0, in_flight=1))
    assert progress_line(step.doc) == (
        "capacity search: replaying x1.7: 40/361 done | 2 steps done, previous x2: p95 TTFT +30%"
    )
    first = TrialProgress(Path("/nonexistent"))
    first.step_started(1.0)
    first(ReplayProgress(elapsed_s=1, total=104, sent=66, completed=66, failed=0, in_flight=0))
    assert progress_line(first.doc) == "capacity search: replaying x1: 66/104 done"


class _SlowRunner(FakeRunner):
    """FakeRunner's results, each after 2.5 s during which the trial reports progress."""

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        done = super().submit(spec, gpus)
        handle = FakeHandle(spec)

        def work() -> None:
            reporter = TrialProgress(spec.workdir, interval_s=0)
            Path(spec.workdir).mkdir(parents=True, exist_ok=True)
            reporter.phase("replaying")
            reporter(
                ReplayProgress(
                    elapsed_s=1.0,
                    total=10,
                    sent=5,
                    completed=4,
                    failed=0,
                    in_flight=1,
                    p95_ttft_ms=123.4,
                )
            )
            time.sleep(2.5)
            handle.future.set_result(done.future.result())

        threading.Thread(target=work, daemon=True).start()
        return handle


def test_the_driver_turns_progress_files_into_progress_events(tmp_path: Path) -> None:
    events: list[StudyEvent] = []
    fixed = {"max-num-seqs": 8, "max-num-batched-tokens": 4096, "enable-chunked-prefill": True}
    driver = _driver(tmp_path, _SlowRunner(), trials=2, enqueue=[fixed])
    driver.progress_interval_s = 0.5
    driver.on_event = events.append
    driver.run()
    progress = [e for e in events if e.kind == "progress"]
    assert {e.number for e in progress} == {0, 1}
    assert all(e.detail == "replaying 4/10 done, p95 TTFT so far 123 ms" for e in progress), (
        progress
    )
    # Only changes are reported: one event per trial here (its file was written once).
    assert len(progress) == 2
