"""The grid's quiet-machine record: which trials were measured beside other work."""

from __future__ import annotations

from benchmarks.others_cpu import _is_study, read_log, trial_loads


def test_the_log_is_read_and_each_trial_gets_its_samples() -> None:
    samples = read_log(["100 1", "110 0", "garbage", "120 144", "130 3", "", "140 66", "150 x"])
    assert samples == [(100, 1), (110, 0), (120, 144), (130, 3), (140, 66)]
    trials = [(1, "complete", 95, 125), (2, "rejected", 126, 126), (3, "complete", 126, 145)]
    loads = trial_loads(trials, samples, threshold=20)
    assert [(x.number, x.samples, x.busy, x.peak) for x in loads] == [
        (1, 3, 1, 144),
        (2, 0, 0, 0),
        (3, 2, 1, 66),
    ]
    assert [x.busy for x in trial_loads(trials, samples, threshold=100)] == [1, 0, 0]


def test_the_studys_own_processes_are_not_counted_as_others() -> None:
    tree = {10, 11}
    assert _is_study(11, ["python", "-m", "optimizer.cli", "tune"], tree)
    assert _is_study(99, ["python", "-m", "vllm.entrypoints.openai.api_server"], tree)
    assert _is_study(98, ["VLLM::EngineCore"], tree)
    assert _is_study(97, ["python", "-m", "optimizer.engine.guard", "10"], tree)
    assert not _is_study(96, ["python", "-m", "pytest", "tests/unit"], tree)
