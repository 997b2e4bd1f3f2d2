"""The grid's quiet-machine record: which trials were measured beside other work."""

from __future__ import annotations

from benchmarks.others_cpu import read_log, study_pids, trial_loads


def test_the_log_is_read_and_each_trial_gets_the_samples_that_cover_it() -> None:
    samples = read_log(["100 1", "110 0", "garbage", "120 144", "130 3", "", "140 66", "150 x"])
    assert samples == [(100, 1), (110, 0), (120, 144), (130, 3), (140, 66)]
    # A sample at t covers (t - 10, t]: trial 1 ran 95-125, so samples 100 to 130 cover it.
    trials = [(1, "complete", 95, 125), (2, "rejected", 126, 126), (3, "complete", 131, 145)]
    loads = trial_loads(trials, samples, threshold=20)
    assert [(x.number, x.samples, x.busy, x.peak) for x in loads] == [
        (1, 4, 1, 144),
        (2, 1, 0, 3),
        (3, 1, 1, 66),
    ]
    assert [x.busy for x in trial_loads(trials, samples, threshold=100)] == [1, 0, 0]
    # No sample at all: the monitor was not running (unknown, reported apart).
    assert trial_loads([(4, "complete", 500, 600)], samples, threshold=20)[0].samples == 0


def test_the_study_is_its_driver_its_engine_guards_and_their_descendants() -> None:
    guard = ["python", "-m", "optimizer.engine.guard", "10", "5347987", "15.0", "log"]
    other_guard = ["python", "-m", "optimizer.engine.guard", "77", "1", "15.0", "log"]
    table = [
        (10, 1, ["python", "-m", "optimizer.cli", "tune", "job.yaml"]),
        (11, 10, ["python", "-c", "spawn_main"]),
        (20, 1, guard),  # the server's guard runs in a session of its own
        (21, 20, ["python", "-m", "vllm.entrypoints.openai.api_server"]),
        (22, 21, ["VLLM::EngineCore"]),
        (23, 22, ["VLLM::Worker"]),
        (30, 1, other_guard),  # another study's server: not this one's
        (31, 30, ["python", "-m", "vllm.entrypoints.openai.api_server"]),
        (40, 1, ["/x/vllm-autotune/.venv/bin/python", "-m", "pytest"]),
    ]
    assert study_pids(10, table) == {10, 11, 20, 21, 22, 23}


def test_watch_counts_other_processes_cpu_not_the_studys_and_ends_with_the_driver(
    tmp_path,
) -> None:
    """Real processes: a driver whose child spins (the study's: not counted), and an outside
    process that spins (counted); the monitor stops when the driver ends."""
    import subprocess
    import sys
    import threading
    import time

    from benchmarks.others_cpu import watch

    spin = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin.format(s=2.5)!r}])",
        ]
    )
    log = tmp_path / "study" / "others.log"  # the study's folder is not made yet
    outsider = None
    try:
        threading.Thread(target=driver.wait, daemon=True).start()  # reaped as it ends
        time.sleep(0.3)  # the driver's child has started
        outsider = subprocess.Popen([sys.executable, "-c", spin.format(s=1.2)])
        watch(driver.pid, log, interval_s=0.5)
        assert driver.poll() is not None  # watch returned: the driver had ended
    finally:
        for p in (driver, outsider):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    samples = read_log(log.read_text().splitlines())
    assert len(samples) >= 3
    # The outsider's second of spinning shows; the study's child spins throughout, and the
    # samples after the outsider ended stay well under one core (counted, it would be ~100).
    assert max(v for _t, v in samples) >= 50
    assert min(v for _t, v in samples[-2:]) < 60
