"""optimizer.engine.guard and the group teardown, with a FAKE server (a sleeping process tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optimizer.engine.guard import process_start_time
from optimizer.engine.process import _kill_group_and_wait, group_alive_pids

# A fake "server": a parent that forks a grandchild ignoring SIGTERM (like a stuck EngineCore).
FAKE_SERVER = (
    "import os, signal, time\n"
    "if os.fork() == 0:\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    open(os.environ.get('FAKE_SERVER_READY', os.devnull), 'w').close()\n"
    "    time.sleep(600)\n"
    "time.sleep(600)\n"
)


def _guard_argv(owner: int, exit_file: Path, server: str = FAKE_SERVER) -> list[str]:
    return [
        sys.executable,
        "-m",
        "optimizer.engine.guard",
        str(owner),
        process_start_time(owner),
        "1",
        str(exit_file),
        "--",
        sys.executable,
        "-c",
        server,
    ]


# Upper bounds only: a process tree starts and ends in well under a second here, but CI's two
# cores can be busy with real vLLM servers (interpreters then take seconds to start).
_PATIENCE_S = 60.0


def _wait_members(pgid: int, n: int) -> None:
    deadline = time.monotonic() + _PATIENCE_S
    while len(group_alive_pids(pgid)) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _wait_empty(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_alive_pids(pgid):
        assert time.monotonic() < deadline, group_alive_pids(pgid)
        time.sleep(0.1)


def test_launcher_returns_at_once_and_the_guard_is_not_its_owners_child(tmp_path: Path) -> None:
    launcher = subprocess.Popen(_guard_argv(os.getpid(), tmp_path / "x"), start_new_session=True)
    assert launcher.wait(timeout=_PATIENCE_S) == 0
    pgid = launcher.pid
    _wait_members(pgid, 3)  # guard, fake server, its grandchild
    import psutil

    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert not children & set(group_alive_pids(pgid))
    assert _kill_group_and_wait(pgid, grace_s=0.5)


def test_guard_kills_group_when_owner_dies(tmp_path: Path) -> None:
    # The owner is an intermediate process we SIGKILL.
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "from optimizer.engine.guard import process_start_time\n"
            f"argv = [sys.executable, '-m', 'optimizer.engine.guard', str(os.getpid()), process_start_time(os.getpid()), '1', {str(tmp_path / 'x')!r}, '--', sys.executable, '-c', {FAKE_SERVER!r}]\n"
            "p = subprocess.Popen(argv, start_new_session=True)\n"
            "p.wait()\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    pgid = int(owner.stdout.readline())
    _wait_members(pgid, 3)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    _wait_empty(pgid, _PATIENCE_S)
    assert (tmp_path / "x").read_text() == "owner-died"


def test_teardown_escalates_to_sigkill_and_waits_for_empty_group(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    launcher = subprocess.Popen(
        _guard_argv(os.getpid(), tmp_path / "x"),
        start_new_session=True,
        env={**os.environ, "FAKE_SERVER_READY": str(ready)},
    )
    launcher.wait(timeout=_PATIENCE_S)
    _wait_members(launcher.pid, 3)
    # The grandchild is a member as soon as it is forked, before it ignores SIGTERM: a
    # teardown in between would end it at SIGTERM (seen under load). Wait until it ignores it.
    deadline = time.monotonic() + _PATIENCE_S
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    assert _kill_group_and_wait(launcher.pid, grace_s=1.0)
    assert group_alive_pids(launcher.pid) == []
    # The grandchild ignored SIGTERM, so only SIGKILL after the grace ended it.
    assert time.monotonic() - t0 >= 1.0


def test_guard_records_the_server_exit_code(tmp_path: Path) -> None:
    exit_file = tmp_path / "code"
    launcher = subprocess.Popen(
        _guard_argv(os.getpid(), exit_file, "raise SystemExit(7)"), start_new_session=True
    )
    launcher.wait(timeout=_PATIENCE_S)
    deadline = time.monotonic() + _PATIENCE_S
    while not exit_file.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert exit_file.read_text() == "7"


def test_start_time_tells_a_recycled_pid_apart() -> None:
    assert process_start_time(os.getpid()) != ""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert process_start_time(dead.pid) == ""


def test_the_guard_is_imported_from_this_source_tree() -> None:
    """The server's guard runs as `python -m optimizer.engine.guard` with SOURCE_ROOT first on
    its PYTHONPATH (a Ray worker's cwd or another install must not decide which code runs)."""
    import subprocess
    import sys

    from optimizer.engine.process import SOURCE_ROOT

    root = Path(SOURCE_ROOT)
    assert (root / "optimizer" / "engine" / "guard.py").is_file()
    out = subprocess.run(
        [sys.executable, "-c", "import optimizer.engine.guard as g; print(g.__file__)"],
        env={"PYTHONPATH": SOURCE_ROOT, "PATH": ""},
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(out) == root / "optimizer" / "engine" / "guard.py"


def test_a_dead_servers_socket_folder_goes_with_its_registry_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server killed together with its guard left its vat-rpc-* folder behind: the reaper
    # removed the registry entry but not the folder (noticed in issue 34's sessions).
    import json
    import tempfile

    from optimizer.engine.process import reap_orphans

    monkeypatch.setenv("VLLM_AUTOTUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where servers' folders are made
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # a real owner that has exited
    gone.wait()
    registry = tmp_path / "cache" / "engines"
    registry.mkdir(parents=True)
    sockets = tmp_path / "vat-rpc-abc"
    sockets.mkdir()
    (sockets / "some-uuid").write_text("")
    kept = tmp_path / "not-ours"  # a folder this module did not make is never removed
    kept.mkdir()
    elsewhere = tmp_path / "cache" / "vat-rpc-elsewhere"  # nor one outside the temporary folder
    elsewhere.mkdir(parents=True)
    for name, folder in (("1", sockets), ("2", kept), ("3", elsewhere)):
        (registry / f"{name}.json").write_text(
            json.dumps(
                {
                    "pgid": gone.pid,  # no live process in it carries the engine id
                    "engine_id": f"dead-{name}",
                    "owner_pid": gone.pid,
                    "owner_create_time": 0.0,
                    "log": "x",
                    "rpc_dir": str(folder),
                }
            )
        )
    assert reap_orphans() == []  # nothing alive to kill ...
    assert not sockets.exists()  # ... but its socket folder is removed
    assert kept.exists() and elsewhere.exists()
    assert list(registry.iterdir()) == []
