"""What else ran on the machine while a grid study measured: the CPU that processes outside the
study took, every 10 s, and per trial how much of it there was.

A capacity grid needs a quiet machine: anything else running slows the server it measures. The
capacity-grid folders keep an ``others.log`` beside their study (one line per sample: epoch
seconds, then the CPU of the other processes in % of one core); ``report`` reads it against the
study's trials and names those measured beside other work, for ``capacity_table.py --drop``.

A process is the study's when it is the study's driver or one of its descendants, or runs under
one of the driver's engine guards (``optimizer.engine.guard PID``: a vLLM server and its engine
processes, in a session of their own) or descends from one, or was the study's at an earlier
sample (a stopping server's processes are orphaned for a moment once its guard has ended).
This monitor counts itself out. A process first seen at a sample is counted from its start
where it started within the interval; one that starts and ends between two samples is missed.
Optuna records trial times in the local time of the machine that ran the study: run ``report``
in that machine's time zone (the kept grids ran in UTC: ``TZ=UTC``).

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


def study_pids(study_pid: int, table: Iterable[tuple[int, int, Sequence[str]]]) -> set[int]:
    """The study's processes in a process table of (pid, parent pid, command line): the driver,
    its engine guards (``optimizer.engine.guard STUDY_PID ...``) and every descendant of them."""
    rows = list(table)
    roots = {study_pid}
    for pid, _ppid, cmdline in rows:
        args = list(cmdline)
        if "optimizer.engine.guard" in args:
            at = args.index("optimizer.engine.guard")
            if at + 1 < len(args) and args[at + 1] == str(study_pid):
                roots.add(pid)
    children: dict[int, list[int]] = {}
    for pid, ppid, _cmdline in rows:
        children.setdefault(ppid, []).append(pid)
    out, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid not in out:
            out.add(pid)
            stack.extend(children.get(pid, ()))
    return out


def watch(study_pid: int, log: Path, interval_s: float = 10.0) -> None:
    """Append ``epoch percent`` to ``log`` every ``interval_s`` until the study's driver ends."""
    import psutil

    me = os.getpid()
    seen: dict[int, psutil.Process] = {}
    ever: set[int] = set()  # the study's processes so far: an ending server's are orphaned
    last = time.time()
    # Started beside the study, the monitor may come before the study has made its folder.
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", buffering=1) as out:
        while psutil.pid_exists(study_pid):
            procs = list(psutil.process_iter(["pid", "ppid", "cmdline", "create_time"]))
            mine = ever | study_pids(
                study_pid, ((p.info["pid"], p.info["ppid"], p.info["cmdline"] or []) for p in procs)
            )
            ever |= mine
            now, total = time.time(), 0.0
            for proc in procs:
                pid = proc.info["pid"]
                if pid == me:
                    continue
                counted = pid not in mine
                if pid not in seen:
                    seen[pid] = proc
                    with contextlib.suppress(psutil.Error):
                        proc.cpu_percent(None)  # starts its count for the next sample
                        started = proc.info["create_time"] or 0.0
                        if counted and started > last:  # new since the last sample
                            times = proc.cpu_times()
                            total += 100.0 * (times.user + times.system) / max(now - last, 1e-3)
                    continue
                if counted:
                    with contextlib.suppress(psutil.Error):
                        total += seen[pid].cpu_percent(None)
            out.write(f"{now:.0f} {total:.0f}\n")
            last = now
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
    samples: int  # 0: the monitor was not running (unknown, not quiet)
    busy: int  # samples at or above the threshold
    peak: float


def trial_loads(
    trials: Iterable[tuple[int, str, float, float]],
    samples: Sequence[tuple[float, float]],
    threshold: float,
    interval_s: float = 10.0,
) -> list[TrialLoad]:
    """Per trial (number, status, start epoch, end epoch): the samples that cover some of it (a
    sample at t covers the interval before t), the busy ones, the peak."""
    out = []
    for number, status, start, end in trials:
        inside = [v for t, v in samples if start < t <= end + interval_s]
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
    r.add_argument("--interval", type=float, default=10.0, help="the log's sampling interval")
    ns = ap.parse_args(argv)
    if ns.command == "watch":
        watch(ns.pid, ns.log, ns.interval)
        return 0
    if not ns.log.is_file():
        raise SystemExit(f"{ns.log}: no such file")
    samples = read_log(ns.log.read_text().splitlines())
    loads = trial_loads(_study_trials(ns.folder, ns.from_trial), samples, ns.threshold, ns.interval)
    print(f"{'trial':>5} {'status':>12} {'s':>6} {'samples':>7} {'busy':>4} {'peak %':>6}")
    for x in loads:
        print(
            f"{x.number:5d} {x.status:>12} {x.seconds:6.0f} {x.samples:7d} {x.busy:4d} "
            f"{x.peak:6.0f}"
        )
    measured = [x for x in loads if x.status == "complete"]
    flagged = [x.number for x in measured if x.busy]
    unwatched = [x.number for x in measured if not x.samples]
    print(
        f"measured beside other work (a sample at {ns.threshold:g} % of a core or more): "
        + (",".join(map(str, flagged)) if flagged else "none")
    )
    if unwatched:
        print("measured with no monitor running (unknown): " + ",".join(map(str, unwatched)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
