"""run_trial: engine up -> replay (warm-up first) -> summarize -> engine down.

One trial is one vLLM configuration measured on one shaped trace. Failures are data: an engine
that does not start (or dies mid-replay) yields a ``failed`` result carrying its failure class
and log lines; a replay whose client could not keep the schedule yields ``invalid_replay`` so
the study retries instead of scoring a distorted measurement. The engine is always stopped,
with its whole process group, before this function returns.

Every figure of the summary is :func:`objectives.summarize`'s over the records it describes,
send lag included (one definition: ``sent_s - scheduled_s`` per measured request); the
replayer's own P99, which judges whether the schedule was kept, is quoted in its message.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from objectives import parse_slo, summarize
from optimizer.capacity.measure import EARLY_STOP_PREFIX, early_stop_check, measured_records
from optimizer.capacity.trial import CapacityOutcome, run_capacity
from optimizer.engine.cpus import (
    client_pinned,
    die_with_parent,
    lower_client_priority,
    raise_client_priority,
)
from optimizer.engine.defaults import memory_param_problem
from optimizer.engine.process import EngineProcess
from optimizer.errors import EngineError
from optimizer.trial_io import TrialProgress, read_records, write_records
from optimizer.types import (
    FailureClass,
    MemoryAccount,
    TrialResult,
    TrialSpec,
    TrialStatus,
)
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayProgress, ReplayResult, run_replay
from optimizer.workload.shaping import preroll_left_out, preroll_trace

_T = TypeVar("_T")
logger = logging.getLogger(__name__)

__all__ = [
    "SERVER_METRICS",
    "Engine",
    "boost_priority",
    "engine_for",
    "read_records",
    "run_trial",
    "write_records",
]

# /metrics samples worth keeping per trial (counters are read after the replay).
SERVER_METRICS = (
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def boost_priority(niceness: int = -10) -> bool:
    """Give this process priority over the server under test; True if the OS allowed it.

    The load generator must keep its schedule even when the server saturates the machine (on
    a GPU host the server's CPU threads, on a CPU host everything): the same reason load
    generators run on machines of their own. Raising priority needs CAP_SYS_NICE (root);
    without it nothing changes and send lag is still measured and judged.
    """
    del niceness  # the one niceness of raise_client_priority's "nice"
    return raise_client_priority("nice") != "normal"


def _replay(
    spec: TrialSpec,
    url: str,
    progress: Callable[[ReplayProgress], None] | None,
    boost: bool = False,
) -> ReplayResult:
    if boost:
        raise_client_priority(spec.client_priority)
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
        stop_check=(
            early_stop_check(slos, max(0, len(spec.trace) - spec.warmup_requests))
            if spec.early_stop
            else None
        ),
    )


class Engine(Protocol):
    """What a trial needs of its server (:class:`~optimizer.engine.process.EngineProcess`, or
    a fake in tests)."""

    @property
    def url(self) -> str: ...
    @property
    def log_path(self) -> Path: ...
    @property
    def startup_s(self) -> float | None: ...
    @property
    def startup_phases(self) -> dict[str, dict[str, float]]: ...

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def check_alive(self) -> None: ...
    def memory_account(self) -> MemoryAccount | None: ...
    def effective_config(self) -> dict[str, str]: ...
    def scrape_metrics(self) -> dict[str, float]: ...


def engine_for(spec: TrialSpec) -> EngineProcess:
    """The real server of a trial: its engine config, its log in the trial's folder."""
    return EngineProcess(
        spec.engine,
        log_path=Path(spec.workdir) / "engine.log",
        python=spec.python,
        startup_timeout_s=spec.startup_timeout_s,
    )


def run_trial(
    spec: TrialSpec,
    *,
    progress: Callable[[ReplayProgress], None] | None = None,
    on_engine_ready: Callable[[Any], None] | None = None,
    isolate_client: bool = False,
    engine: Engine | None = None,
) -> TrialResult:
    """Run one trial to completion; never raises for engine or replay failures.

    Args:
        spec: The trial.
        progress: Replay progress callback (not with ``isolate_client``). Either way the
            trial's phase and replay progress go to ``progress.json`` in ``spec.workdir``
            (:class:`~optimizer.trial_io.TrialProgress`), where its driver reads them.
        on_engine_ready: Called with the healthy engine before the replay (runners use it to
            record the server's process group).
        isolate_client: Run the replay client in a fresh process of its own. Inside a Ray actor
            the worker's background threads compete for the GIL with the client's event loop
            and add tens of milliseconds of send lag; a clean interpreter keeps the schedule.
        engine: The server to measure (default: :func:`engine_for`, a real vLLM server); a
            fake one lets tests check every outcome without vLLM.

    Returns:
        The result; ``records.jsonl.gz`` and ``result.json`` are also written to
        ``spec.workdir``.
    """
    Path(spec.workdir).mkdir(parents=True, exist_ok=True)
    server = engine if engine is not None else engine_for(spec)
    reporter = TrialProgress(spec.workdir, forward=progress)
    try:
        reporter.phase("starting server")
        try:
            server.start()
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
                    memory=server.memory_account(),
                    startup=server.startup_phases,
                ),
            )
        if on_engine_ready is not None:
            on_engine_ready(server)
        account = server.memory_account()
        inactive = memory_param_problem(spec.engine.args, account)
        if inactive is not None:
            return _finish(spec, _inactive(spec, server, inactive))
        if account is not None and account.kv_cache_tokens:
            spec = replace(spec, kv_cache_tokens=int(account.kv_cache_tokens))
        spec, warm = bounded_preroll(spec, account, server.effective_config())
        if spec.capacity is not None:
            reporter.phase("capacity search")
            result = _measure_capacity(spec, server, reporter, isolate_client)
        else:
            reporter.phase("replaying")
            result = _measure_replay(spec, server, reporter, isolate_client)
        if warm and result.summary:
            result = replace(result, summary={**result.summary, **warm})
        return _finish(spec, result)
    finally:
        reporter.phase("stopping server")
        server.stop()


def bounded_preroll(
    spec: TrialSpec, account: MemoryAccount | None, effective: Mapping[str, str]
) -> tuple[TrialSpec, dict[str, float]]:
    """The trace's pre-roll as this server can use it, and what was changed (summary keys).

    Prefix caching off: no pre-roll (the server would keep none of it;
    ``preroll_skipped_no_prefix_cache``). Otherwise cut to the server's KV cache in tokens
    (chains kept in the pre-roll's order: for the default pre-roll, what the window reuses
    most), with ``preroll_chains_left_out`` / ``preroll_tokens_left_out`` when it does not fit.
    """
    trace = spec.trace
    if not trace.preroll:
        return spec, {}
    caching = str(effective.get("enable_prefix_caching", "")).strip().lower()
    if caching == "false":
        logger.info("trial %d: prefix caching off, no pre-roll sent", spec.number)
        return replace(spec, trace=replace(trace, preroll=())), {
            "preroll_skipped_no_prefix_cache": 1.0
        }
    kv = account.kv_cache_tokens if account is not None else None
    chains, tokens = preroll_left_out(trace, kv)
    if not chains:
        return spec, {}
    logger.warning(
        "trial %d: the pre-roll does not fit the server's KV cache (%s tokens): %d chains "
        "(%d tokens) left out",
        spec.number,
        kv,
        chains,
        tokens,
    )
    warm = preroll_trace(trace, kv).requests
    return replace(spec, trace=replace(trace, preroll=warm)), {
        "preroll_chains_left_out": float(chains),
        "preroll_tokens_left_out": float(tokens),
    }


def _inactive(spec: TrialSpec, server: Engine, problem: str) -> TrialResult:
    """A tuned parameter did not act on the engine: flagged, never measured or scored."""
    return TrialResult(
        number=spec.number,
        status=TrialStatus.FAILED,
        failure_class=FailureClass.PARAMETER_INACTIVE,
        message=problem,
        log_path=str(server.log_path),
        memory=server.memory_account(),
        startup_s=server.startup_s,
        startup=server.startup_phases,
    )


def _died(spec: TrialSpec, exc: EngineError, during: str, **measured: Any) -> TrialResult:
    """The engine died while it was measured: a failure, with what was measured until then."""
    return TrialResult(
        number=spec.number,
        status=TrialStatus.FAILED,
        failure_class=exc.failure_class,
        message=f"the engine died during the {during}: " + exc.explanation,
        log_path=exc.log_path,
        log_lines=exc.log_lines,
        **measured,
    )


def _client_side(
    fn: Callable[..., _T],
    spec: TrialSpec,
    server: Engine,
    progress: Callable[[ReplayProgress], None] | None,
    isolate_client: bool,
) -> tuple[_T, dict[str, Any], dict[str, float]]:
    """Run the client side on a healthy server: its outcome, the result fields every
    measurement has (startup and replay times, memory account, effective config), and the
    server's metrics read after it."""
    memory = server.memory_account()
    effective = server.effective_config()
    t0 = time.monotonic()
    outcome = _in_client(fn, spec, server.url, progress, isolate_client)
    fields: dict[str, Any] = {
        "startup_s": server.startup_s,
        "startup": server.startup_phases,
        "replay_s": time.monotonic() - t0,
        "memory": memory,
        "effective_config": effective,
    }
    return outcome, fields, _scrape(server)


def _measure_capacity(
    spec: TrialSpec,
    server: Engine,
    progress: Callable[[ReplayProgress], None] | None,
    isolate_client: bool,
) -> TrialResult:
    """A capacity trial on a healthy server: the rate search, then the server's state."""
    outcome, measured, server_metrics = _client_side(
        _capacity, spec, server, progress, isolate_client
    )
    measured.update(records=outcome.records, summary=outcome.summary, capacity=outcome.doc)
    try:
        server.check_alive()
    except EngineError as exc:
        return _died(spec, exc, "capacity search", **measured)
    return TrialResult(
        number=spec.number,
        status=TrialStatus.INVALID_REPLAY if outcome.invalid else TrialStatus.COMPLETE,
        message=outcome.message,
        server_metrics=server_metrics,
        log_path=str(server.log_path),
        **measured,
    )


def _capacity(
    spec: TrialSpec,
    url: str,
    progress: Callable[[ReplayProgress], None] | None,
    boost: bool = False,
) -> CapacityOutcome:
    """:func:`run_capacity`, its steps reported to the trial's progress file too."""
    if isinstance(progress, TrialProgress):
        return run_capacity(
            spec, url, progress, boost, on_step=progress.step, on_step_start=progress.step_started
        )
    return run_capacity(spec, url, progress, boost)


def _measure_replay(
    spec: TrialSpec,
    server: Engine,
    progress: Callable[[ReplayProgress], None] | None,
    isolate_client: bool,
) -> TrialResult:
    """A fixed-load trial on a healthy server: replay the trace, summarize, judge."""
    slos = [parse_slo(s) for s in spec.slos]
    replay, common, server_metrics = _client_side(_replay, spec, server, progress, isolate_client)
    stopped = replay.stopped_early and replay.stop_reason.startswith(EARLY_STOP_PREFIX)
    # Requests an early stop never sent or cancelled are not the server's failures.
    measured = measured_records(replay.records) if stopped else list(replay.records)
    summary = dict(summarize(measured, slos=slos))
    if replay.preroll_requests:  # the fidelity of a windowed replay: what warmed the cache
        summary.update(
            preroll_requests=float(replay.preroll_requests),
            preroll_tokens=float(replay.preroll_tokens),
            preroll_s=float(replay.preroll_s),
        )
    common["records"] = replay.records
    try:
        server.check_alive()
    except EngineError as exc:
        return _died(spec, exc, "replay", summary=summary, **common)
    message = replay.message
    if not replay.schedule_kept:
        status = TrialStatus.INVALID_REPLAY
    elif stopped:
        # Partial evidence is kept (marked partial); the sampler is never told it as if it
        # were a full replay (see StudyDriver._tell).
        status = TrialStatus.INFEASIBLE
        message = replay.stop_reason
        summary["partial"] = 1.0
    else:
        status = TrialStatus.COMPLETE
    return TrialResult(
        number=spec.number,
        status=status,
        summary=summary,
        message=message,
        server_metrics=server_metrics,
        log_path=str(server.log_path),
        **common,
    )


def _in_client(
    fn: Callable[..., _T],
    spec: TrialSpec,
    url: str,
    progress: Callable[[ReplayProgress], None] | None,
    isolate_client: bool,
) -> _T:
    """Run the client side of a trial here or, isolated, in a fresh process of its own; off
    the server's cores where ``engine.cpus`` pins it (:mod:`optimizer.engine.cpus`)."""
    with client_pinned(spec.engine.env):
        return _in_client_here(fn, spec, url, progress, isolate_client)


def _in_client_here(
    fn: Callable[..., _T],
    spec: TrialSpec,
    url: str,
    progress: Callable[[ReplayProgress], None] | None,
    isolate_client: bool,
) -> _T:
    if isolate_client:
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")
        ) as pool:
            # Only the progress file crosses over (TrialProgress pickles without its forward).
            reporter = progress if isinstance(progress, TrialProgress) else None
            return pool.submit(_isolated, fn, spec, url, reporter, os.getpid()).result()
    # Boost only now: the server, started above, keeps its normal priority.
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        return fn(spec, url, progress, True)
    finally:
        lower_client_priority(before)


def _isolated(
    fn: Callable[..., _T],
    spec: TrialSpec,
    url: str,
    progress: Callable[[ReplayProgress], None] | None,
    parent: int,
) -> _T:
    """The client in its own process: it ends with its trial's process, even a killed one."""
    die_with_parent(parent)
    return fn(spec, url, progress, True)


def _scrape(engine: Engine) -> dict[str, float]:
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
        "startup": dict(result.startup) or None,
        "replay_s": result.replay_s,
        "memory": asdict(result.memory) if result.memory else None,
        "summary": dict(result.summary),
        "server_metrics": dict(result.server_metrics),
        "engine_args": dict(spec.engine.args),
        "log_path": result.log_path,
        "log_lines": list(result.log_lines),
        "effective_config": dict(result.effective_config),
        "capacity": dict(result.capacity) if result.capacity else None,
    }
    (workdir / "result.json").write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    return result


def _jsonable(value: object) -> object:
    if isinstance(value, FailureClass | TrialStatus):
        return value.value
    return str(value)
