"""Cores apart: the server under test on its cores, the replay client on the others (Linux).

On a CPU host the server saturates every core it may use; a replay client that shares them
misses its schedule (send lag over ``trace.max_send_lag_ms``: the replay is retried, never
scored), and the busiest configurations cannot be measured at all. ``engine.cpus`` names the
server's cores: the guard (:mod:`.guard`) pins itself before it starts the server, so the
server and every process it starts inherit the mask; the client side of a trial keeps to the
tuner's other cores (:func:`client_pinned`).

The cores travel to the guard in :data:`SERVER_CPUS_ENV` (the server's environment), so a
trial's ``EngineConfig`` carries them wherever it runs. Standard library only: the guard
imports this module.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping

__all__ = [
    "OMP_BIND_ENV",
    "SERVER_CPUS_ENV",
    "client_pinned",
    "cpus_problem",
    "format_cpus",
    "parse_cpus",
    "pin_self",
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
