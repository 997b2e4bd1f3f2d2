"""What ``nvidia-smi`` says about the GPUs and the processes on them: the GPU memory a server
uses (the stability sampler) and where a trial's server really runs (the runner's placement
record, issue 19: every server must see exactly its actor's GPUs).

Both work without a GPU: ``nvidia-smi`` missing or failing gives None, never an exception.
Inside a container, ``nvidia-smi`` may list the host's process ids (another PID namespace), so
a server's processes are not always found by pid; the placement record then says so and falls
back to the memory each visible GPU holds, which is the server's when no two trials share a GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ComputeApp",
    "Gpu",
    "compute_apps",
    "gpus",
    "placement",
    "server_gpu_mib",
    "smi_rows",
    "visible_gpus",
]


@dataclass(frozen=True)
class Gpu:
    """One GPU as ``nvidia-smi`` numbers it (its index is the physical one)."""

    index: int
    uuid: str
    memory_used_mib: float


@dataclass(frozen=True)
class ComputeApp:
    """A process holding GPU memory."""

    pid: int
    gpu_uuid: str
    used_mib: float


def smi_rows(query: str, fields: str) -> list[list[str]] | None:
    """``nvidia-smi --query-QUERY=FIELDS`` as rows of stripped fields (None: no ``nvidia-smi``,
    or it failed)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[p.strip() for p in line.split(",")] for line in out.splitlines() if line.strip()]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def gpus() -> list[Gpu] | None:
    """Every GPU of the machine (None: no ``nvidia-smi``)."""
    rows = smi_rows("gpu", "index,uuid,memory.used")
    if rows is None:
        return None
    found = []
    for row in rows:
        if len(row) == 3 and row[0].isdigit():
            found.append(Gpu(int(row[0]), row[1], _number(row[2]) or 0.0))
    return found


def compute_apps() -> list[ComputeApp] | None:
    """Every process holding GPU memory (None: no ``nvidia-smi``)."""
    rows = smi_rows("compute-apps", "pid,gpu_uuid,used_memory")
    if rows is None:
        return None
    found = []
    for row in rows:
        if len(row) == 3 and row[0].isdigit():
            found.append(ComputeApp(int(row[0]), row[1], _number(row[2]) or 0.0))
    return found


def visible_gpus(all_gpus: Iterable[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs a process with this ``CUDA_VISIBLE_DEVICES`` sees (indices or UUIDs; unset:
    all of them; empty: none)."""
    listed = list(all_gpus)
    if cuda_visible_devices is None:
        return listed
    wanted = [w.strip() for w in cuda_visible_devices.split(",") if w.strip()]
    seen = []
    for w in wanted:
        for g in listed:
            if (w.isdigit() and g.index == int(w)) or g.uuid == w or g.uuid.startswith(w):
                seen.append(g)
    return seen


def server_gpu_mib(pids: Iterable[int], cuda_visible_devices: str | None) -> float | None:
    """GPU memory (MiB) a server uses: its processes' by pid, or, when ``nvidia-smi`` names none
    of them (another PID namespace), what its visible GPUs hold. None without ``nvidia-smi``."""
    apps = compute_apps()
    if apps is None:
        return None
    pidset = set(pids)
    mine = [a.used_mib for a in apps if a.pid in pidset]
    if mine:
        return float(sum(mine))
    listed = gpus()
    if listed is None:
        return None
    return float(sum(g.memory_used_mib for g in visible_gpus(listed, cuda_visible_devices)))


def placement(
    pids: Iterable[int], env: Mapping[str, str | None], ray_gpu_ids: Iterable[object] = ()
) -> dict[str, Any]:
    """Where a server runs: the ``CUDA_VISIBLE_DEVICES`` it was given, the GPUs that names, the
    processes ``nvidia-smi`` lists on each GPU (the server's marked), and ``ok``: every
    process of the server found on a GPU is on one of its visible GPUs (None: nothing to
    check: no ``nvidia-smi``, or none of the server's pids listed)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    doc: dict[str, Any] = {
        "cuda_visible_devices": cvd,
        "ray_gpu_ids": [str(g) for g in ray_gpu_ids],
    }
    listed, apps = gpus(), compute_apps()
    if listed is None or apps is None:
        doc.update(nvidia_smi=False, ok=None)
        return doc
    visible = visible_gpus(listed, cvd)
    by_uuid = {g.uuid: g.index for g in listed}
    pidset = set(pids)
    procs = [
        {**asdict(a), "gpu_index": by_uuid.get(a.gpu_uuid), "server": a.pid in pidset} for a in apps
    ]
    ours = [p for p in procs if p["server"]]
    allowed = {g.uuid for g in visible}
    doc.update(
        nvidia_smi=True,
        visible=[asdict(g) for g in visible],
        gpus=[asdict(g) for g in listed],
        processes=procs,
        ok=all(p["gpu_uuid"] in allowed for p in ours) if ours else None,
    )
    if not ours:
        doc["note"] = (
            "nvidia-smi lists none of the server's processes (a container's PID namespace): "
            "the memory on each GPU above is the evidence"
        )
    return doc
