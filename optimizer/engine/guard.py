"""Supervisor that keeps a vLLM server from outliving the process that started it.

``EngineProcess`` does not start the server directly: it starts this guard as the leader of a
new process group. The guard forks once and the launcher exits, so the guard is no longer a
child of the owner: a runtime that kills its workers' children (Ray does, with SIGKILL, when an
actor dies) cannot take the guard down and leave the server orphaned. The guard starts the
server as its child in the same group and writes the server's exit code to a file when it ends.
When the owning process disappears (even by SIGKILL, where no cleanup code of the owner can
run), the guard terminates the whole group: first SIGTERM, then SIGKILL. vLLM's ``EngineCore``
and workers inherit the group, so nothing is left holding memory (vllm#55510). Stdlib only, so
it starts in milliseconds.

Usage: ``python -m optimizer.engine.guard OWNER_PID OWNER_START GRACE_S EXIT_FILE -- COMMAND...``
where OWNER_START is the owner's start time (field 22 of /proc/PID/stat), so a recycled pid is
never mistaken for the owner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from optimizer.engine.cpus import pin_self

__all__ = ["main", "process_start_time"]

_POLL_S = 0.2


def process_start_time(pid: int) -> str:
    """The kernel's start time of ``pid`` ("" when it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may contain spaces; fields after it are fixed.
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _kill_group(child: subprocess.Popen[bytes], grace_s: float) -> None:
    pgid = os.getpgrp()
    # The guard survives the group's SIGTERM so it can escalate; the final SIGKILL ends the
    # guard too, together with any grandchild (EngineCore, workers) that ignored SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(_POLL_S)
    os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """Run the guard; returns the server's exit code (the launcher returns 0 at once)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 6 or args[4] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    owner, owner_start = int(args[0]), args[1]
    grace_s = float(args[2])
    exit_file = Path(args[3])
    if os.fork() > 0:
        os._exit(0)  # the launcher: the owner reaps it; the guard lives on, reparented
    try:
        # engine.cpus: the guard takes the server's cores first; the server inherits them.
        pin_self()
    except (OSError, ValueError) as exc:
        print(f"vllm-autotune guard: could not pin the server to its cores: {exc}", file=sys.stderr)
        exit_file.write_text("2")
        return 2
    child = subprocess.Popen(args[5:])

    def _forward(signum: int, _frame: object) -> None:
        # A SIGTERM to the guard alone (not the group) still stops the server.
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    while True:
        code = child.poll()
        if code is not None:
            exit_file.write_text(str(code))
            return code
        if process_start_time(owner) != owner_start:
            exit_file.write_text("owner-died")
            _kill_group(child, grace_s)
            return 137
        time.sleep(_POLL_S)


if __name__ == "__main__":
    sys.exit(main())
