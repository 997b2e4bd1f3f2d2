"""run_trial: engine up -> replay (warm-up first) -> summarize -> engine down.

One trial is one vLLM configuration measured on one shaped trace. Failures are data: an engine
that does not start (or dies mid-replay) yields a ``failed`` result carrying its failure class
and log lines; a replay whose client could not keep the schedule yields ``invalid_replay`` so
the study retries instead of scoring a distorted measurement. The engine is always stopped,
with its whole process group, before this function returns.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from objectives import Slo, parse_slo, summarize
from objectives.early_stop import EarlyStopper, Observations
from optimizer.engine import EngineProcess
from optimizer.errors import EngineError
from optimizer.types import (
    FailureClass,
    RequestRecord,
    TrialResult,
    TrialSpec,
    TrialStatus,
)
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayProgress, ReplayResult, ReplaySnapshot, run_replay

__all__ = ["SERVER_METRICS", "boost_priority", "read_records", "run_trial", "write_records"]

# /metrics samples worth keeping per trial (counters are read after the replay).
SERVER_METRICS = (
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def write_records(records: tuple[RequestRecord, ...] | list[RequestRecord], path: Path) -> None:
    """Per-request records as gzip-compressed JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for r in records:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    """Read records written by :func:`write_records`."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            d = json.loads(line)
            d["chunk_times_s"] = tuple(d["chunk_times_s"])
            out.append(RequestRecord(**d))
    return out


def boost_priority(niceness: int = -10) -> bool:
    """Give this process priority over the server under test; True if the OS allowed it.

    The load generator must keep its schedule even when the server saturates the machine (on
    a GPU host the server's CPU threads, on a CPU host everything): the same reason load
    generators run on machines of their own. Raising priority needs CAP_SYS_NICE (root);
    without it nothing changes and send lag is still measured and judged.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        return False
    return True


def _replay(
    spec: TrialSpec,
    url: str,
    progress: Callable[[ReplayProgress], None] | None,
    boost: bool = False,
) -> ReplayResult:
    if boost:
        boost_priority()
    slos = [parse_slo(s) for s in spec.slos]
    return run_replay(
        spec.trace,
        url,
        spec.engine.model,
        vocab=TokenRange(*spec.token_range),
        seed=spec.seed,
        warmup_requests=spec.warmup_requests,
        max_duration_s=spec.max_duration_s,
        progress=progress,
        max_send_lag_ms=spec.max_send_lag_ms,
        stop_check=_early_stop(spec, slos) if spec.early_stop else None,
    )


def run_trial(
    spec: TrialSpec,
    *,
    progress: Callable[[ReplayProgress], None] | None = None,
    on_engine_ready: Callable[[EngineProcess], None] | None = None,
    isolate_client: bool = False,
) -> TrialResult:
    """Run one trial to completion; never raises for engine or replay failures.

    Args:
        spec: The trial.
        progress: Replay progress callback (not with ``isolate_client``).
        on_engine_ready: Called with the healthy engine before the replay (runners use it to
            record the server's process group).
        isolate_client: Run the replay client in a fresh process of its own. Inside a Ray actor
            the worker's background threads compete for the GIL with the client's event loop
            and add tens of milliseconds of send lag; a clean interpreter keeps the schedule.

    Returns:
        The result; ``records.jsonl.gz`` and ``result.json`` are also written to
        ``spec.workdir``.
    """
    workdir = Path(spec.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    slos = [parse_slo(s) for s in spec.slos]
    engine = EngineProcess(
        spec.engine,
        log_path=workdir / "engine.log",
        python=spec.python,
        startup_timeout_s=spec.startup_timeout_s,
    )
    try:
        try:
            engine.start()
        except EngineError as exc:
            return _finish(
                spec,
                TrialResult(
                    number=spec.number,
                    status=TrialStatus.FAILED,
                    failure_class=exc.failure_class,
                    message=exc.explanation,
                    log_path=exc.log_path,
                    log_lines=exc.log_lines,
                    memory=engine.memory_account(),
                ),
            )
        if on_engine_ready is not None:
            on_engine_ready(engine)
        memory = engine.memory_account()
        effective = engine.effective_config()
        t0 = time.monotonic()
        if isolate_client:
            with concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn")
            ) as pool:
                replay = pool.submit(_replay, spec, engine.url, None, True).result()
        else:
            # Boost only now: the server, started above, keeps its normal priority.
            before = os.getpriority(os.PRIO_PROCESS, 0)
            try:
                replay = _replay(spec, engine.url, progress, True)
            finally:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, 0, before)
        replay_s = time.monotonic() - t0
        server_metrics = _scrape(engine)
        try:
            engine.check_alive()
        except EngineError as exc:
            return _finish(
                spec,
                TrialResult(
                    number=spec.number,
                    status=TrialStatus.FAILED,
                    failure_class=exc.failure_class,
                    message="the engine died during the replay: " + exc.explanation,
                    records=replay.records,
                    summary=summarize(replay.records, slos=slos),
                    startup_s=engine.startup_s,
                    replay_s=replay_s,
                    memory=memory,
                    log_path=exc.log_path,
                    log_lines=exc.log_lines,
                    effective_config=effective,
                ),
            )
        summary = dict(summarize(replay.records, slos=slos))
        summary["p99_send_lag_ms"] = replay.p99_send_lag_ms
        message = replay.message
        if not replay.schedule_kept:
            status = TrialStatus.INVALID_REPLAY
        elif replay.stopped_early and replay.stop_reason.startswith(_EARLY):
            # Partial evidence is kept; the summary covers what was measured before the stop.
            status = TrialStatus.INFEASIBLE
            message = replay.stop_reason
        else:
            status = TrialStatus.COMPLETE
        return _finish(
            spec,
            TrialResult(
                number=spec.number,
                status=status,
                summary=summary,
                records=replay.records,
                message=message,
                startup_s=engine.startup_s,
                replay_s=replay_s,
                memory=memory,
                server_metrics=server_metrics,
                log_path=str(engine.log_path),
                effective_config=effective,
            ),
        )
    finally:
        engine.stop()


_EARLY = "SLO out of reach: "


def _early_stop(spec: TrialSpec, slos: list[Slo]) -> Callable[[ReplaySnapshot], str | None] | None:
    """A replay stop check that fires once the trial's SLOs can no longer be met."""
    expected = max(0, len(spec.trace) - spec.warmup_requests)
    stopper = EarlyStopper(slos, expected)
    if not stopper.active():
        return None

    def check(snap: ReplaySnapshot) -> str | None:
        obs = Observations.from_records(
            snap.finished,
            now_s=snap.now_s,
            in_flight_sent_s=snap.streaming_sent_s,
            waiting_sent_s=snap.waiting_sent_s,
        )
        reason = stopper.check(obs)
        return _EARLY + reason if reason else None

    return check


def _scrape(engine: EngineProcess) -> dict[str, float]:
    try:
        metrics = engine.scrape_metrics()
    except Exception:
        return {}
    return {k: metrics[k] for k in SERVER_METRICS if k in metrics}


def _finish(spec: TrialSpec, result: TrialResult) -> TrialResult:
    workdir = Path(spec.workdir)
    if result.records:
        write_records(result.records, workdir / "records.jsonl.gz")
    doc: dict[str, Any] = {
        "number": result.number,
        "status": result.status.value,
        "failure_class": result.failure_class.value if result.failure_class else None,
        "message": result.message,
        "startup_s": result.startup_s,
        "replay_s": result.replay_s,
        "memory": asdict(result.memory) if result.memory else None,
        "summary": dict(result.summary),
        "server_metrics": dict(result.server_metrics),
        "engine_args": dict(spec.engine.args),
        "log_path": result.log_path,
        "log_lines": list(result.log_lines),
        "effective_config": dict(result.effective_config),
    }
    (workdir / "result.json").write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    return result


def _jsonable(value: object) -> object:
    if isinstance(value, FailureClass | TrialStatus):
        return value.value
    return str(value)
