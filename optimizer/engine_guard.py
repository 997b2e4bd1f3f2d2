"""Supervisor that keeps a vLLM server from outliving the process that started it.

``EngineProcess`` does not start the server directly: it starts this guard as the leader of a
new process group, and the guard starts the server as its child in the same group. The guard
exits with the server's exit code, and when the owning process disappears (even by SIGKILL,
where no cleanup code of the owner can run) it terminates the whole group: first SIGTERM, then
SIGKILL. vLLM's ``EngineCore`` and workers inherit the group, so nothing is left holding memory
(vllm#55510). Stdlib only, so it starts in milliseconds.

Usage: ``python -m optimizer.engine_guard OWNER_PID GRACE_S -- COMMAND...``
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["main"]

_POLL_S = 0.2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    """Run the guard; returns the server's exit code."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 4 or args[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    owner = int(args[0])
    grace_s = float(args[1])
    child = subprocess.Popen(args[3:])

    def _forward(signum: int, _frame: object) -> None:
        # A SIGTERM to the guard alone (not the group) still stops the server.
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    while True:
        code = child.poll()
        if code is not None:
            return code
        # Reparenting away from the owner catches pid reuse that _alive alone would miss.
        if os.getppid() != owner or not _alive(owner):
            _kill_group(child, grace_s)
            return 137
        time.sleep(_POLL_S)


if __name__ == "__main__":
    sys.exit(main())
