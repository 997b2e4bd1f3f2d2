"""Server startup time: launch to healthy (``EngineProcess.startup_s``) on the CPU build.

Starts the ``tiny`` make-model model (``--load-format dummy``, ``max-model-len 2048``, vLLM's
defaults otherwise, ``VLLM_CPU_KVCACHE_SPACE=1``) ``--runs`` times per variant, stopping each
server fully (the whole process group) before the next start:

* ``default``: torch.compile on, as a trial runs by default;
* ``enforce-eager``: the same plus ``--enforce-eager`` (torch.compile skipped).

The variants alternate (default, eager, default, eager, ...) so a noisy neighbour hits both
alike. vLLM caches compiled graphs under ``VLLM_CACHE_ROOT``; by default a fresh cache folder
is used for the whole benchmark, so the first ``default`` start compiles from scratch (cold) and
the later ones could load the cache (warm). ``--shared-cache`` keeps the user's cache instead.

Besides launch-to-healthy, each server log gives two facts that are less sensitive to a noisy
machine: vLLM's own "init engine (profile, create kv cache, warmup model) took X s" (where
torch.compile runs) and whether the compile cache failed to load ("Compiling model again due
to a load failure").

Usage::

    python -m benchmarks.startup_time [--runs 5] [--python PATH] [--shared-cache]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from optimizer.engine.models import make_model
from optimizer.engine.process import EngineProcess, cpu_engine_env
from optimizer.types import EngineConfig

VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "enforce-eager": {"enforce-eager": True},
}
BASE_ARGS: dict[str, object] = {"load-format": "dummy", "max-model-len": 2048}
_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
_CACHE_FAIL = "Compiling model again due to a load failure"


def vllm_version(python: str) -> str:
    """The vLLM version the interpreter imports (or why it cannot)."""
    probe = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = probe.stdout.strip().splitlines()
    return lines[-1] if probe.returncode == 0 and lines else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="starts per variant")
    parser.add_argument("--python", default=sys.executable, help="interpreter with vllm-cpu")
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument(
        "--shared-cache", action="store_true", help="use the user's VLLM_CACHE_ROOT (warm)"
    )
    args = parser.parse_args()

    console = Console(width=150)
    work = Path(tempfile.mkdtemp(prefix="startup-time-"))
    model = make_model(work / "tiny", "tiny")
    env = cpu_engine_env(args.kv_cache_gib)
    if not args.shared_cache:
        env["VLLM_CACHE_ROOT"] = str(work / "vllm-cache")
    version = vllm_version(args.python)
    console.print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}, vLLM {version} ({args.python})"
    )
    console.print(f"engine args: {BASE_ARGS} (+ variant), env: {env}; logs in {work}")

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    inits: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cache_failures: dict[str, int] = dict.fromkeys(VARIANTS, 0)
    for run in range(args.runs):
        for name, extra in VARIANTS.items():
            config = EngineConfig(model=str(model), args={**BASE_ARGS, **extra}, env=env)
            log = work / f"{name}-{run}.log"
            with EngineProcess(config, log_path=log, python=args.python) as engine:
                assert engine.startup_s is not None
                times[name].append(engine.startup_s)
                text = engine.log_text()
            init = _INIT.search(text)
            inits[name].append(float(init.group(1)) if init else float("nan"))
            cache_failures[name] += _CACHE_FAIL in text
            console.print(
                f"run {run + 1} {name:>13}: {times[name][-1]:6.1f} s "
                f"(init engine {inits[name][-1]:.2f} s)",
                highlight=False,
            )

    table = Table(title=f"Startup time, launch to /health 200 (s), {args.runs} starts each")
    columns = ("variant", "median", "min", "max", "runs (in order)", "init engine median")
    for column in (*columns, "compile-cache load failures"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, values in times.items():
        table.add_row(
            name,
            f"{statistics.median(values):.1f}",
            f"{min(values):.1f}",
            f"{max(values):.1f}",
            " ".join(f"{v:.1f}" for v in values),
            f"{statistics.median(inits[name]):.2f}",
            f"{cache_failures[name]} of {len(values)}",
        )
    console.print(table)
    ratio = statistics.median(times["default"]) / statistics.median(times["enforce-eager"])
    console.print(f"median default / median enforce-eager: {ratio:.2f}")


if __name__ == "__main__":
    main()
