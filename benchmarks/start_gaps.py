"""Where a server's start waits: one start of a job's baseline with vLLM's DEBUG logging, then
the longest silences in its log, each with the line before and after it.

The phases of :mod:`optimizer.engine.startup` say how long each part of a start took; this says
what the server was doing (or waiting for) inside a long phase, e.g. the engine-core start.
Log lines carry whole seconds, so each gap is the time between two lines' timestamps as the tuner
saw them appear (read every 0.2 s), not vLLM's own clock.

Usage:
    python -m benchmarks.start_gaps JOB.yaml [--preload] [--env K=V] [--out DIR] [--top 8]
    python -m benchmarks.start_gaps --log ENGINE_LOG [--top 8]    (a log written before)
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from pathlib import Path

_STAMP = re.compile(r"^\((?P<who>[^)]*)\)\s+\w+\s+\d\d-\d\d (?P<t>\d\d:\d\d:\d\d)")


def _seconds(stamp: str) -> int:
    h, m, s = (int(x) for x in stamp.split(":"))
    return h * 3600 + m * 60 + s


def gaps(lines: list[str], top: int) -> list[tuple[int, str, str]]:
    """The ``top`` longest silences between two stamped lines: (seconds, before, after)."""
    stamped = [(m.group("t"), line) for line in lines if (m := _STAMP.match(line))]
    found = []
    for (t0, a), (t1, b) in itertools.pairwise(stamped):
        found.append(((_seconds(t1) - _seconds(t0)) % 86_400, a, b))
    return sorted(found, key=lambda g: -g[0])[:top]


def _start(job: str, out: Path, preload: bool, extra_env: dict[str, str]) -> Path:
    from optimizer.config import load_job
    from optimizer.engine.process import EngineProcess
    from optimizer.study import prepare
    from optimizer.types import EngineConfig

    config, base = load_job(job)
    plan = prepare(config, base)
    spec = plan.trial_spec(0, dict(plan.baseline_args), workdir=out / "start", seed=1)
    engine_cfg = EngineConfig(
        model=spec.engine.model,
        args=spec.engine.args,
        env={**spec.engine.env, **extra_env, "VLLM_LOGGING_LEVEL": "DEBUG"},
    )
    log = out / "start" / "engine.log"
    engine = EngineProcess(
        engine_cfg, log_path=log, startup_timeout_s=spec.startup_timeout_s, preload=preload
    )
    try:
        if preload:
            engine.prepare()
            ready = log.parent / (log.name + ".go.ready")
            while not ready.exists():
                time.sleep(0.1)  # stands for the previous trial's replay
        t0 = time.monotonic()
        engine.start()
        print(f"healthy after {time.monotonic() - t0:.1f} s; phases:")
        for name, s in engine.startup_phases.get("phases", {}).items():
            print(f"  {name:<18} {s:7.2f} s")
    finally:
        engine.stop()
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", nargs="?")
    ap.add_argument("--log", help="read this engine log instead of starting a server")
    ap.add_argument("--preload", action="store_true", help="start from a preloaded interpreter")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    ap.add_argument("--out", default="runs/start-gaps")
    ap.add_argument("--top", type=int, default=8)
    ns = ap.parse_args()
    if (ns.job is None) == (ns.log is None):
        ap.error("give a JOB file or --log ENGINE_LOG")
    extra = dict(kv.split("=", 1) for kv in ns.env)
    log = Path(ns.log) if ns.log else _start(ns.job, Path(ns.out), ns.preload, extra)
    lines = log.read_text(errors="replace").splitlines()
    print(f"longest silences in {log} ({len(lines)} lines):")
    for s, before, after in gaps(lines, ns.top):
        print(f"{s:4d} s  after: {before[:160]}")
        print(f"        next:  {after[:160]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
