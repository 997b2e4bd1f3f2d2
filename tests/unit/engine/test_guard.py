"""optimizer.engine_guard and the group teardown, with a FAKE server (a sleeping process tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from optimizer.engine import _kill_group_and_wait, group_alive_pids

# A fake "server": a parent that forks a grandchild ignoring SIGTERM (like a stuck EngineCore).
FAKE_SERVER = (
    "import os, signal, time\n"
    "if os.fork() == 0:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    time.sleep(600)\n"
    "time.sleep(600)\n"
)


def _spawn_guard(owner_pid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "optimizer.engine_guard", str(owner_pid), "1", "--",
         sys.executable, "-c", FAKE_SERVER],
        start_new_session=True,
    )


def _wait_members(pgid: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(group_alive_pids(pgid)) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_guard_kills_group_when_owner_dies() -> None:
    # The owner is an intermediate process we SIGKILL; the guard is its child.
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"p = subprocess.Popen([sys.executable, '-m', 'optimizer.engine_guard', str(__import__('os').getpid()), '1', '--', sys.executable, '-c', {FAKE_SERVER!r}], start_new_session=True)\n"
         "print(p.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True,
    )
    assert owner.stdout is not None
    pgid = int(owner.stdout.readline())
    _wait_members(pgid, 3)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 15
    while group_alive_pids(pgid):
        assert time.monotonic() < deadline, group_alive_pids(pgid)
        time.sleep(0.1)


def test_teardown_escalates_to_sigkill_and_waits_for_empty_group() -> None:
    guard = _spawn_guard(os.getpid())
    _wait_members(guard.pid, 3)
    t0 = time.monotonic()
    assert _kill_group_and_wait(guard.pid, grace_s=1.0)
    guard.wait(timeout=5)
    assert group_alive_pids(guard.pid) == []
    # The grandchild ignored SIGTERM, so only SIGKILL after the grace ended it.
    assert time.monotonic() - t0 >= 1.0


def test_guard_returns_the_server_exit_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "optimizer.engine_guard", str(os.getpid()), "1", "--",
         sys.executable, "-c", "raise SystemExit(7)"],
        timeout=30,
    )
    assert proc.returncode == 7
