"""Trials of different GPU counts packed onto one machine by the real Ray runner (issue 19's
CPU part, and issue 16's kept actors): Ray started with 4 LOGICAL GPUs on this CPU machine,
trials of 1 and 2 GPUs run 3 at a time through :class:`optimizer.runners.RayRunner`, each
trial's engine a FAKE (tests/fakes/trials.py) that notes the GPUs its process was given. No
two trials that ran at the same time share a GPU, a trial sees exactly as many GPUs as it
asked for, a 2-GPU trial waits for two free GPUs instead of failing, and a finished trial's
actor serves the next trial of its size."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from optimizer.runners import RayRunner
from optimizer.types import EngineConfig, Trace, TraceRequest, TrialSpec, TrialStatus
from tests.fakes.trials import gpu_recording_engine

SIZES = [1, 2, 1, 2, 1, 1, 2, 1]


@pytest.fixture
def ray_with_logical_gpus() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=4,
        num_gpus=4,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
        object_store_memory=128 * 1024**2,
    )
    try:
        yield
    finally:
        ray.shutdown()


def _spec(tmp_path: Path, number: int) -> TrialSpec:
    trace = Trace(
        requests=tuple(
            TraceRequest(arrival_s=0.1 * i, input_tokens=8, output_tokens=4) for i in range(15)
        )
    )
    return TrialSpec(
        number=number,
        engine=EngineConfig(model="fake-model", args={}),
        trace=trace,
        workdir=str(tmp_path / f"trial-{number}"),
        token_range=(1000, 2000),
        seed=number + 1,
        warmup_requests=1,
        max_send_lag_ms=1000.0,
    )


def _drive(runner: RayRunner, tmp_path: Path, sizes: list[int], first: int) -> dict[int, Any]:
    """Run trials of these GPU counts as the study driver does (at most ``capacity`` at once,
    each released when it ends); what each trial's engine noted, by trial number."""
    running: list[tuple[int, int, Any]] = []
    pending = [(first + k, gpus) for k, gpus in enumerate(sizes)]
    done: list[tuple[int, int, Any]] = []
    deadline = time.monotonic() + 300
    while pending or running:
        assert time.monotonic() < deadline, f"stuck: running {running}, pending {pending}"
        while pending and len(running) < runner.capacity:
            number, gpus = pending.pop(0)
            running.append((number, gpus, runner.submit(_spec(tmp_path, number), gpus)))
        finished = next((r for r in running if r[2].future.done()), None)
        if finished is None:
            time.sleep(0.05)
            continue
        running.remove(finished)
        runner.release(finished[2])
        done.append(finished)
    notes = {}
    for number, gpus, handle in done:
        result = handle.future.result()
        assert result.status is TrialStatus.COMPLETE, result.message
        note = json.loads((tmp_path / f"trial-{number}" / "gpus.json").read_text())
        ids = [g for g in note["cuda_visible_devices"].split(",") if g]
        # The trial's process saw exactly the GPUs it asked for, distinct ones.
        assert len(ids) == gpus == len(set(ids)), (number, note)
        # The runner's placement record (issue 19) names the same GPUs: Ray's ids for the actor
        # and the CUDA_VISIBLE_DEVICES its server inherits (no nvidia-smi here: nothing more).
        placed = json.loads((tmp_path / f"trial-{number}" / "placement.json").read_text())
        assert placed["cuda_visible_devices"] == note["cuda_visible_devices"], placed
        assert set(placed["ray_gpu_ids"]) == set(ids), placed
        notes[number] = {**note, "ids": set(ids), "gpus": gpus}
    assert sorted(notes) == [first + k for k in range(len(sizes))]
    return notes


@pytest.mark.timeout(600)
def test_trials_of_one_and_two_gpus_never_share_a_gpu(
    tmp_path: Path, ray_with_logical_gpus: None
) -> None:
    runner = RayRunner(capacity=3, cpus_per_trial=0.5, engine_factory=gpu_recording_engine)
    try:
        notes = _drive(runner, tmp_path, SIZES, 0)
    finally:
        runner.close()
    # No two trials that overlapped in time held a common GPU.
    for a in notes.values():
        for b in notes.values():
            overlap = a is not b and a["start"] < b["stop"] and b["start"] < a["stop"]
            assert not (overlap and a["ids"] & b["ids"]), (a, b)
    # Never more GPUs in use than the machine has, and trials did run side by side.
    starts = sorted(n["start"] for n in notes.values())
    busy = [sum(n["gpus"] for n in notes.values() if n["start"] <= t < n["stop"]) for t in starts]
    assert max(busy) <= 4 and max(busy) >= 3, busy
    # No process served trials of two sizes.
    by_pid: dict[int, set[int]] = {}
    for n in notes.values():
        by_pid.setdefault(n["pid"], set()).add(n["gpus"])
    assert all(len(sizes) == 1 for sizes in by_pid.values())

    # One trial at a time (a one-GPU study's case): a finished trial's actor serves the next
    # trial of its size; a trial of another size gets a new actor.
    runner = RayRunner(capacity=1, cpus_per_trial=0.5, engine_factory=gpu_recording_engine)
    try:
        seq = _drive(runner, tmp_path, [1, 1, 2, 2, 1], 100)
    finally:
        runner.close()
    pid = {n: seq[n]["pid"] for n in seq}
    assert pid[100] == pid[101] and pid[102] == pid[103]
    assert len({pid[101], pid[102], pid[104]}) == 3
