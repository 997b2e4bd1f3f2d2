"""The replay client's share of the CPU: cores apart, priority first, gone with its tuner.

**Cores apart** (Linux).
On a CPU host the server saturates every core it may use; a replay client that shares them
misses its schedule (send lag over ``trace.max_send_lag_ms``: the replay is retried, never
scored), and the busiest configurations cannot be measured at all. ``engine.cpus`` names the
server's cores: the guard (:mod:`.guard`) pins itself before it starts the server, so the
server and every process it starts inherit the mask; the client side of a trial keeps to the
tuner's other cores (:func:`client_pinned`).

The cores travel to the guard in :data:`SERVER_CPUS_ENV` (the server's environment), so a
trial's ``EngineConfig`` carries them wherever it runs.

**Priority** (``trace.client_priority``, :func:`raise_client_priority`): where client and server
share cores, the client's event loop must run the moment a send is due or a chunk arrives.
``nice`` (-10) is not enough against a saturating CPU server: on a 2-core AVX-512 Xeon (Linux
6.18) a client at nice -10 beside vLLM's worker, engine core and API server missed its
schedule by 600 ms at x1 and slowed the chunk times it measures; ``realtime`` (SCHED_FIFO, reset
on fork so nothing it starts inherits it) kept it on schedule. Each needs root or CAP_SYS_NICE;
without it the client runs as it is, and its send lag is still measured and judged.

**Gone with its tuner** (:func:`die_with_parent`): a client process of its own ends when the
process that started it does, even by SIGKILL.

Standard library only: the guard imports this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Iterable, Iterator, Mapping

__all__ = [
    "CLIENT_PRIORITIES",
    "OMP_BIND_ENV",
    "SERVER_CPUS_ENV",
    "client_pinned",
    "cpus_problem",
    "die_with_parent",
    "format_cpus",
    "lower_client_priority",
    "parse_cpus",
    "pin_self",
    "raise_client_priority",
    "server_cpus_env",
]

#: The server's cores, as ``0,2,3``: read by the guard, and by the client side of a trial.
SERVER_CPUS_ENV = "VLLM_AUTOTUNE_SERVER_CPUS"
#: The CPU build's OpenMP binding (``auto`` reserves a core for the front end: with one core
#: allowed there is none left to bind, so a single core is named explicitly).
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def format_cpus(cpus: Iterable[int]) -> str:
    """``[3, 0, 2]`` -> ``"0,2,3"``."""
    return ",".join(str(c) for c in sorted(set(cpus)))


def parse_cpus(text: str) -> set[int]:
    """``"0,2,3"`` -> ``{0, 2, 3}``; raises ValueError on anything else."""
    cores = {int(part) for part in text.split(",") if part.strip()}
    if not cores or min(cores) < 0:
        raise ValueError(f"not a list of core ids: {text!r}")
    return cores


def available_cpus() -> set[int]:
    """The cores this process may run on (all of the machine's where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cpus_problem(cpus: Iterable[int]) -> str | None:
    """What is wrong with pinning the server to ``cpus`` here, or None.

    The cores must exist on this machine, and the tuner must keep at least one core the
    server does not have (its replay client's).
    """
    wanted = set(cpus)
    if not hasattr(os, "sched_setaffinity"):
        return "engine.cpus needs Linux (sched_setaffinity); remove it on this platform"
    total = os.cpu_count() or 1
    missing = sorted(c for c in wanted if c >= total)
    if missing:
        return (
            f"engine.cpus names cores {missing}, but this machine has cores 0-{total - 1}; "
            "name cores it has"
        )
    if not available_cpus() - wanted:
        return (
            f"engine.cpus [{format_cpus(wanted)}] leaves the replay client no core of its own "
            f"(the tuner may use [{format_cpus(available_cpus())}]); give the server fewer "
            "cores, or start the tuner on others (taskset -c)"
        )
    return None


def server_cpus_env(
    cpus: Iterable[int] | None, env: Mapping[str, str], *, cpu_build: bool
) -> dict[str, str]:
    """The server's environment with its cores, and on the CPU build one bound OpenMP core.

    ``env`` wins where it already binds OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``).
    """
    out = dict(env)
    if not cpus:
        return out
    cores = sorted(set(cpus))
    out[SERVER_CPUS_ENV] = format_cpus(cores)
    if cpu_build and len(cores) == 1 and OMP_BIND_ENV not in env:
        out[OMP_BIND_ENV] = str(cores[0])
    return out


def pin_self(env: Mapping[str, str] | None = None) -> set[int] | None:
    """Pin this process to the cores ``env`` names (default: ``os.environ``); the guard's part.

    Returns the cores, or None where none are named. Raises OSError or ValueError when the
    kernel refuses them or the value is not a list of cores.
    """
    text = (os.environ if env is None else env).get(SERVER_CPUS_ENV)
    if not text:
        return None
    cores = parse_cpus(text)
    os.sched_setaffinity(0, cores)
    return cores


@contextlib.contextmanager
def client_pinned(server_env: Mapping[str, str]) -> Iterator[set[int] | None]:
    """Inside: this thread (and threads and processes it starts) off the server's cores.

    Yields the client's cores, or None where the server is not pinned (or no core would be
    left: the client then keeps its cores, and its send lag is still measured and judged).
    """
    text = server_env.get(SERVER_CPUS_ENV)
    if not text or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = set(os.sched_getaffinity(0))
    rest = before - parse_cpus(text)
    if not rest:
        yield None
        return
    os.sched_setaffinity(0, rest)
    try:
        yield rest
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, before)


#: ``trace.client_priority``'s choices, strongest first.
CLIENT_PRIORITIES = ("realtime", "nice", "normal")
_RT_PRIORITY = 10  # above every SCHED_OTHER task; far below the kernel's own threads
_NICENESS = -10


def raise_client_priority(mode: str = "nice") -> str:
    """Give this thread (the client's event loop) priority over the server under test.

    Args:
        mode: ``realtime`` (SCHED_FIFO, falling back to nice), ``nice`` (-10) or ``normal``.

    Returns:
        What the OS granted: ``realtime``, ``nice`` or ``normal``.
    """
    if mode not in CLIENT_PRIORITIES:
        raise ValueError(f"client priority {mode!r}: choose one of {', '.join(CLIENT_PRIORITIES)}")
    if mode == "realtime" and hasattr(os, "sched_setscheduler"):
        try:
            policy = os.SCHED_FIFO | getattr(os, "SCHED_RESET_ON_FORK", 0)
            os.sched_setscheduler(0, policy, os.sched_param(_RT_PRIORITY))
            return "realtime"
        except OSError:
            pass
    if mode in ("realtime", "nice"):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, _NICENESS)
            return "nice"
        except OSError:
            pass
    return "normal"


def lower_client_priority(niceness: int = 0) -> None:
    """Undo :func:`raise_client_priority` on this thread (a client that ran in place)."""
    if hasattr(os, "sched_setscheduler"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, niceness)


def die_with_parent(parent: int) -> bool:
    """Have the kernel end this process when ``parent`` (its starter) ends (Linux); True if set.

    Ends at once where ``parent`` is already gone.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent ended before the request took hold
        os._exit(1)
    return bool(ok)
