"""What else ran on the machine while a grid study measured: the CPU that processes outside the
study took, every 10 s, and per trial how much of it there was.

A capacity grid needs a quiet machine: anything else running slows the server it measures. The
capacity-grid folders keep an ``others.log`` beside their study (one line per sample: epoch
seconds, then the CPU of the other processes in % of one core); ``report`` reads it against the
study's trials and names those measured beside other work, for ``capacity_table.py --drop``.

A process is the study's when it is the study's driver or one of its descendants, or a vLLM
server's (its command line names vllm, or it is a multiprocessing child or the engine's guard,
which run in sessions of their own). This monitor counts itself out.

Usage:
    python -m benchmarks.others_cpu watch $(cat grid.pid) runs/capacity-grid-v3/r1-others.log &
    python -m benchmarks.others_cpu report runs/capacity-grid-v3/r1 \\
        runs/capacity-grid-v3/r1-others.log --from-trial 120
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_STUDY_MARKS = ("vllm", "VLLM", "spawn_main", "optimizer.engine.guard")


def _is_study(pid: int, cmdline: Sequence[str], tree: set[int]) -> bool:
    cmd = " ".join(cmdline)
    return pid in tree or any(mark in cmd for mark in _STUDY_MARKS)


def watch(study_pid: int, log: Path, interval_s: float = 10.0) -> None:
    """Append ``epoch percent`` to ``log`` every ``interval_s`` until the study's driver ends."""
    import psutil

    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    with log.open("a", buffering=1) as out:
        while True:
            try:
                tree = {study_pid} | {
                    c.pid for c in psutil.Process(study_pid).children(recursive=True)
                }
            except psutil.NoSuchProcess:
                return
            total = 0.0
            for proc in psutil.process_iter(["pid", "cmdline"]):
                pid = proc.info["pid"]
                if pid == me:
                    continue
                if pid not in seen:  # its first sample only starts the count
                    seen[pid] = proc
                    with contextlib.suppress(psutil.Error):
                        proc.cpu_percent(None)
                    continue
                if not _is_study(pid, proc.info["cmdline"] or [], tree):
                    with contextlib.suppress(psutil.Error):
                        total += seen[pid].cpu_percent(None)
            out.write(f"{time.time():.0f} {total:.0f}\n")
            time.sleep(interval_s)


def read_log(lines: Iterable[str]) -> list[tuple[float, float]]:
    """``others.log``'s samples as (epoch seconds, % of one core); malformed lines skipped."""
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            try:
                out.append((float(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return out


@dataclass(frozen=True)
class TrialLoad:
    """The other processes' CPU while one trial ran."""

    number: int
    status: str
    seconds: float
    samples: int
    busy: int  # samples at or above the threshold
    peak: float


def trial_loads(
    trials: Iterable[tuple[int, str, float, float]],
    samples: Sequence[tuple[float, float]],
    threshold: float,
) -> list[TrialLoad]:
    """Per trial (number, status, start epoch, end epoch): its samples, busy ones, the peak."""
    out = []
    for number, status, start, end in trials:
        inside = [v for t, v in samples if start <= t <= end]
        out.append(
            TrialLoad(
                number=number,
                status=status,
                seconds=end - start,
                samples=len(inside),
                busy=sum(v >= threshold for v in inside),
                peak=max(inside, default=0.0),
            )
        )
    return out


def _study_trials(folder: Path, first: int) -> list[tuple[int, str, float, float]]:
    from optimizer.cli_support import load_study_dir

    _plan, study = load_study_dir(folder)
    out = []
    for t in study.get_trials(deepcopy=False):
        if t.number < first or t.datetime_start is None:
            continue
        end = t.datetime_complete.timestamp() if t.datetime_complete else time.time()
        status = str(t.user_attrs.get("status") or t.state.name.lower())
        out.append((t.number, status, t.datetime_start.timestamp(), end))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch", help="sample the other processes' CPU until the study ends")
    w.add_argument("pid", type=int, help="the study driver's process id")
    w.add_argument("log", type=Path)
    w.add_argument("--interval", type=float, default=10.0)
    r = sub.add_parser("report", help="per trial: the other processes' CPU while it ran")
    r.add_argument("folder", type=Path, help="the study folder")
    r.add_argument("log", type=Path, help="its others.log")
    r.add_argument("--from-trial", type=int, default=0)
    r.add_argument("--threshold", type=float, default=20.0, help="%% of a core that is busy")
    ns = ap.parse_args(argv)
    if ns.command == "watch":
        watch(ns.pid, ns.log, ns.interval)
        return 0
    if not ns.log.is_file():
        raise SystemExit(f"{ns.log}: no such file")
    samples = read_log(ns.log.read_text().splitlines())
    loads = trial_loads(_study_trials(ns.folder, ns.from_trial), samples, ns.threshold)
    print(f"{'trial':>5} {'status':>12} {'s':>6} {'samples':>7} {'busy':>4} {'peak %':>6}")
    for x in loads:
        print(
            f"{x.number:5d} {x.status:>12} {x.seconds:6.0f} {x.samples:7d} {x.busy:4d} "
            f"{x.peak:6.0f}"
        )
    flagged = [x.number for x in loads if x.busy and x.status == "complete"]
    print(
        f"measured beside other work (a sample at {ns.threshold:g} % of a core or more): "
        + (",".join(map(str, flagged)) if flagged else "none")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
