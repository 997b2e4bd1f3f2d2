"""A trial actor ends once the raylet that started it is gone (issue 45, item 2), tested on a
FAKE raylet: a process that names itself ``raylet`` (its comm, as Ray's raylet's) and starts a
child that arms :func:`optimizer.runners._exit_when_raylet_dies` and then sleeps, as a trial
actor busy replaying would. The fake raylet is killed: the child must exit within seconds, and
a child whose parent is not a raylet never arms the watch."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

#: The fake raylet: names itself, starts the child, prints its pid, waits to be killed.
PARENT = r"""
import ctypes, subprocess, sys, time
if sys.argv[1] == "raylet":
    ctypes.CDLL(None).prctl(15, b"raylet", 0, 0, 0)  # PR_SET_NAME
child = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
print(child.pid, flush=True)
time.sleep(600)
"""
#: The child: the watch armed (fast polling), then a long sleep.
CHILD = r"""
import time
from optimizer.runners import _exit_when_raylet_dies
_exit_when_raylet_dies(poll_s=0.1)
time.sleep(600)
"""


def _child_after_parent_killed(parent_name: str) -> tuple[float | None, int]:
    """Start the fake parent named ``parent_name`` and its child, kill the parent, and return
    how long the child lived on (None: still alive after 5 s) and its pid."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, parent_name, CHILD],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    time.sleep(2.0)  # the child's imports and its watch armed
    assert psutil.pid_exists(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5.0:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - t0, child
        except psutil.NoSuchProcess:
            return time.monotonic() - t0, child
        time.sleep(0.05)
    return None, child


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "prctl"), reason="needs Linux prctl")
def test_a_trial_actor_exits_once_its_raylet_is_gone() -> None:
    lived, child = _child_after_parent_killed("raylet")
    if lived is None:
        os.kill(child, signal.SIGKILL)
    assert lived is not None and lived < 2.0, lived


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "prctl"), reason="needs Linux prctl")
def test_a_process_whose_parent_is_no_raylet_keeps_its_own_lifetime() -> None:
    lived, child = _child_after_parent_killed("notray")
    try:
        assert lived is None
    finally:
        os.kill(child, signal.SIGKILL)
