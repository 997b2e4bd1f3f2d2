"""engine.cpus: the server pinned by its guard (a real guard and a FAKE server, a Python process
that reports its cores), the client kept off those cores, and the checks before a study."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from optimizer.config import EngineSection
from optimizer.engine.cpus import (
    OMP_BIND_ENV,
    SERVER_CPUS_ENV,
    client_pinned,
    cpus_problem,
    server_cpus_env,
)
from optimizer.engine.guard import process_start_time

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="core pinning is Linux's"
)

# A FAKE server: writes its own cores and a child's to the file named in argv[1].
_REPORT = (
    "import json, os, subprocess, sys\n"
    "child = subprocess.run([sys.executable, '-c', "
    "'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, text=True)\n"
    "open(sys.argv[1], 'w').write(json.dumps("
    "{'server': sorted(os.sched_getaffinity(0)), 'child': child.stdout.strip()}))\n"
)


def _run_guard(tmp_path: Path, cores: str) -> tuple[Path, Path]:
    report, exit_file = tmp_path / "report.json", tmp_path / "exit"
    argv = [
        sys.executable,
        "-m",
        "optimizer.engine.guard",
        str(os.getpid()),
        process_start_time(os.getpid()),
        "1",
        str(exit_file),
        "--",
        sys.executable,
        "-c",
        _REPORT,
        str(report),
    ]
    env = {**os.environ, SERVER_CPUS_ENV: cores}
    with open(tmp_path / "guard.log", "wb") as log:
        launcher = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        assert launcher.wait(timeout=60) == 0
    deadline = time.monotonic() + 60
    while not exit_file.exists():
        assert time.monotonic() < deadline, (tmp_path / "guard.log").read_text()
        time.sleep(0.05)
    return report, exit_file


def _two_cores() -> list[int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two cores")
    return mine


def test_the_guard_pins_the_server_and_what_it_starts(tmp_path: Path) -> None:
    last = _two_cores()[-1]
    report, exit_file = _run_guard(tmp_path, str(last))
    assert exit_file.read_text() == "0"
    seen = json.loads(report.read_text())
    assert seen == {"server": [last], "child": str([last])}


def test_the_guard_refuses_cores_the_kernel_refuses(tmp_path: Path) -> None:
    report, exit_file = _run_guard(tmp_path, str((os.cpu_count() or 1) + 64))
    assert exit_file.read_text() == "2"
    assert not report.exists()  # no server started
    assert "could not pin the server to its cores" in (tmp_path / "guard.log").read_text()


def test_the_client_keeps_off_the_servers_cores_and_gets_its_own_back() -> None:
    mine = _two_cores()
    before = set(os.sched_getaffinity(0))
    with client_pinned({SERVER_CPUS_ENV: str(mine[0])}) as client:
        assert client == before - {mine[0]}
        assert set(os.sched_getaffinity(0)) == client
        spawned = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert spawned.stdout.strip() == str(sorted(client))  # an isolated client inherits
    assert set(os.sched_getaffinity(0)) == before


def test_the_client_keeps_its_cores_where_the_server_is_not_pinned_or_has_them_all() -> None:
    before = set(os.sched_getaffinity(0))
    with client_pinned({}) as client:
        assert client is None and set(os.sched_getaffinity(0)) == before
    every = ",".join(str(c) for c in before)
    with client_pinned({SERVER_CPUS_ENV: every}) as client:
        assert client is None and set(os.sched_getaffinity(0)) == before


def test_the_servers_environment_names_its_cores_and_binds_one_openmp_core() -> None:
    env = server_cpus_env([3, 1], {"A": "1"}, cpu_build=True)
    assert env == {"A": "1", SERVER_CPUS_ENV: "1,3"}  # auto binding spreads over both
    env = server_cpus_env([2], {}, cpu_build=True)
    assert env == {SERVER_CPUS_ENV: "2", OMP_BIND_ENV: "2"}
    assert server_cpus_env([2], {OMP_BIND_ENV: "nobind"}, cpu_build=True)[OMP_BIND_ENV] == "nobind"
    assert OMP_BIND_ENV not in server_cpus_env([2], {}, cpu_build=False)
    assert server_cpus_env(None, {"A": "1"}, cpu_build=True) == {"A": "1"}


def test_cores_the_machine_lacks_or_that_leave_the_client_none_are_refused() -> None:
    total = os.cpu_count() or 1
    assert "this machine has cores" in (cpus_problem([total]) or "")
    assert "leaves the replay client no core" in (cpus_problem(os.sched_getaffinity(0)) or "")
    if len(os.sched_getaffinity(0)) > 1:
        assert cpus_problem([min(os.sched_getaffinity(0))]) is None


def test_the_job_key_is_a_set_of_core_ids() -> None:
    assert EngineSection(cpus=[3, 0]).cpus == [0, 3]
    for bad in ([], [-1], [0, 0]):
        with pytest.raises(ValidationError):
            EngineSection(cpus=bad)


def test_a_study_plans_every_server_on_the_jobs_cores(tmp_path: Path) -> None:
    from optimizer.config import load_job
    from optimizer.errors import ConfigError
    from optimizer.study import prepare
    from tests.unit.test_study_loop import _job

    core = _two_cores()[0]
    doc = _job(tmp_path, engine={"args": {"max-model-len": 2048}, "cpus": [core]})
    job, base = load_job(doc, base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    assert plan.engine.env[SERVER_CPUS_ENV] == str(core)
    assert plan.trial_spec(1, {"max-num-seqs": 8}, workdir=tmp_path / "t1", seed=1).engine.env[
        SERVER_CPUS_ENV
    ] == str(core)
    doc = _job(tmp_path, engine={"args": {"max-model-len": 2048}, "cpus": [4096]})
    job, base = load_job(doc, base=tmp_path)
    with pytest.raises(ConfigError, match="this machine has cores"):
        prepare(job, base, check_flags=False)


# --- the client's priority, and a client process that ends with its trial's ----------------

_SCHED = (
    "import os, subprocess, sys\n"
    "from optimizer.engine.cpus import raise_client_priority\n"
    "got = raise_client_priority(sys.argv[1])\n"
    "child = subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'],"
    " capture_output=True, text=True).stdout.strip()\n"
    "print(got, os.sched_getscheduler(0) & 0xff, child, os.getpriority(os.PRIO_PROCESS, 0))\n"
)


def _priority_in_a_process(mode: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _SCHED, mode], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


@pytest.mark.skipif(os.geteuid() != 0, reason="real-time scheduling needs root here")
def test_a_realtime_client_runs_first_and_nothing_it_starts_inherits_it() -> None:
    got, policy, child, _nice = _priority_in_a_process("realtime")
    assert got == "realtime"
    assert int(policy) == os.SCHED_FIFO
    assert int(child) == os.SCHED_OTHER  # reset on fork


@pytest.mark.skipif(os.geteuid() != 0, reason="a negative niceness needs root here")
def test_a_nice_client_is_niced_and_a_normal_one_is_left_alone() -> None:
    got, policy, _child, nice = _priority_in_a_process("nice")
    assert (got, int(policy), int(nice)) == ("nice", os.SCHED_OTHER, -10)
    got, policy, _child, nice = _priority_in_a_process("normal")
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert (got, int(policy), int(nice)) == ("normal", os.SCHED_OTHER, mine)


def test_an_unknown_priority_is_refused_by_the_job_and_the_function() -> None:
    from optimizer.config import TraceSection
    from optimizer.engine.cpus import raise_client_priority

    with pytest.raises(ValueError, match="choose one of"):
        raise_client_priority("fast")
    with pytest.raises(ValidationError):
        TraceSection(path="t.csv", client_priority="fast")
    assert TraceSection(path="t.csv").client_priority == "nice"


# A FAKE tuner: starts a client that asks to die with it, prints the client's pid, then waits.
_PARENT = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import sys, time; from optimizer.engine.cpus import die_with_parent; "
    'die_with_parent(int(sys.argv[1])); print("armed", flush=True); time.sleep(600)\', '
    "str(os.getpid())], stdout=subprocess.PIPE, text=True)\n"
    "assert child.stdout.readline().strip() == 'armed'\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_client_process_ends_when_its_tuner_is_killed() -> None:
    import signal

    import psutil

    tuner = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    assert tuner.stdout is not None
    client = int(tuner.stdout.readline())
    assert psutil.pid_exists(client)
    tuner.send_signal(signal.SIGKILL)
    tuner.wait(timeout=30)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(client) and psutil.Process(client).status() != "zombie":
        assert time.monotonic() < deadline, "the client outlived its tuner"
        time.sleep(0.05)
