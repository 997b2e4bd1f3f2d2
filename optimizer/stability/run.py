"""A stability plan on one server: warm up, replay the plan's load with the server sampled
beside it, judge; and the same on a server started for it (stopped after, whatever happens).

The load is one open-loop replay of :func:`~optimizer.stability.plan.build_load`'s trace, its
schedule's time zero fixed ahead (``ReplayOptions.start_at``) so the samples and the records
share one timeline. Requests still unfinished ``drain_grace_s`` after the last arrival are
cancelled and count as errors of their phase.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from objectives import Slo
from optimizer.engine.process import EngineProcess
from optimizer.errors import EngineError
from optimizer.stability.plan import PlanLoad, StabilityPlan
from optimizer.stability.sampler import Sampler
from optimizer.stability.verdicts import (
    Sample,
    Thresholds,
    Verdict,
    Window,
    evaluate,
    overall,
    phase_stats,
    windows,
)
from optimizer.trial_io import write_records
from optimizer.types import EngineConfig, RequestRecord, Trace
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import ReplayOptions, ReplayProgress, run_replay

__all__ = ["RunOutcome", "Target", "finite", "measure", "progress_lines", "run_on_new_server"]

_WARMUP_REQUESTS = 8


@dataclass(frozen=True)
class Target:
    """What the load is sent with: the model name, prompt ids, seed, the client's lag bound,
    the SLOs the windows are judged on."""

    model: str
    vocab: TokenRange
    seed: int
    slos: tuple[Slo, ...]
    max_send_lag_ms: float = 50.0
    thresholds: Thresholds = field(default_factory=Thresholds)


@dataclass
class RunOutcome:
    """One configuration's stability run.

    Attributes:
        label: ``chosen`` or ``baseline`` (or a test's name).
        engine_args: Its engine arguments.
        verdicts: The verdicts (empty when the server never served).
        windows: Latency per window.
        samples: The server's state over time.
        records: Every request of the load.
        failure: Why the run has no verdicts ("" when it has).
        p99_send_lag_ms: The client's P99 send lag.
        schedule_kept: The client kept the schedule (else the load was lighter than planned).
        startup_s: Seconds the server took to start.
        phases: Per phase: peak KV usage, running, waiting; mean RSS.
    """

    label: str
    engine_args: dict[str, Any]
    verdicts: list[Verdict] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    records: tuple[RequestRecord, ...] = ()
    failure: str = ""
    p99_send_lag_ms: float = math.nan
    schedule_kept: bool = True
    startup_s: float | None = None
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """``stable``, ``unstable``, or ``failed`` (no verdicts: the server did not serve)."""
        return "failed" if self.failure else overall(self.verdicts)

    def verdict(self, name: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.name == name), None)

    def doc(self) -> dict[str, Any]:
        """JSON-safe (records and samples are written beside it, not in it)."""
        doc: dict[str, Any] = finite(
            {
                "label": self.label,
                "status": self.status,
                "failure": self.failure,
                "engine_args": self.engine_args,
                "startup_s": self.startup_s,
                "p99_send_lag_ms": self.p99_send_lag_ms,
                "schedule_kept": self.schedule_kept,
                "requests": len(self.records),
                "verdicts": [asdict(v) for v in self.verdicts],
                "phases": self.phases,
                "windows": [asdict(w) for w in self.windows],
            }
        )
        return doc


def finite(value: Any) -> Any:
    """NaN and infinities as None, recursively (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _warm_up(url: str, trace: Trace, target: Target) -> None:
    head = Trace(
        requests=trace.requests[: max(1, min(_WARMUP_REQUESTS, len(trace)))],
        block_size=trace.block_size,
        source=trace.source,
    )
    run_replay(
        head,
        url,
        target.model,
        vocab=target.vocab,
        seed=target.seed * 1000 + 999,
        warmup_requests=len(head),
        max_send_lag_ms=math.inf,
    )


def measure(
    url: str,
    metrics: Callable[[], dict[str, float]],
    pgid: int | None,
    load: PlanLoad,
    plan: StabilityPlan,
    target: Target,
    *,
    label: str,
    engine_args: Mapping[str, Any],
    warmup_trace: Trace | None = None,
    progress: Callable[[str], None] | None = None,
) -> RunOutcome:
    """Run the plan against the server at ``url`` and judge it.

    Args:
        url: The running server.
        metrics: Reads its ``/metrics``.
        pgid: Its process group (RSS samples; None: none).
        load: The plan's load.
        plan: The plan.
        target: Model, prompts, seed, SLOs.
        label: Names the run.
        engine_args: Recorded with the outcome.
        warmup_trace: Its first requests warm the server up first (default: the load's).
        progress: Told a line every 30 s while the plan runs (:func:`progress_lines`).
    """
    _warm_up(url, warmup_trace or load.trace, target)
    # Prompts for the whole load are built before time zero: a second per 300 requests.
    t0 = time.perf_counter() + 2.0 + len(load.trace) / 300
    sampler = Sampler(metrics, pgid, t0, plan.settings.sample_interval_s)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -10)  # the client over the server (root only)
    sampler.start()
    try:
        result = run_replay(
            load.trace,
            url,
            target.model,
            vocab=target.vocab,
            seed=target.seed,
            options=ReplayOptions(
                start_at=t0,
                schedule_origin_s=0.0,
                max_duration_s=plan.duration_s + plan.settings.drain_grace_s,
                max_send_lag_ms=target.max_send_lag_ms,
            ),
            progress=progress_lines(label, plan, progress) if progress is not None else None,
        )
    finally:
        samples = sampler.stop()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, before)
    slos = list(target.slos)
    return RunOutcome(
        label=label,
        engine_args=dict(engine_args),
        verdicts=evaluate(result.records, load.long_input, samples, plan, slos, target.thresholds),
        windows=windows(result.records, plan, slos),
        phases=phase_stats(samples, plan),
        samples=samples,
        records=result.records,
        p99_send_lag_ms=result.p99_send_lag_ms,
        schedule_kept=result.schedule_kept,
    )


def run_on_new_server(
    config: EngineConfig,
    load: PlanLoad,
    plan: StabilityPlan,
    target: Target,
    *,
    label: str,
    workdir: Path,
    python: str | None = None,
    startup_timeout_s: float = 900.0,
    warmup_trace: Trace | None = None,
    on_ready: Callable[[EngineProcess], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RunOutcome:
    """Start a server for ``config``, run the plan, stop it; the run's files go to ``workdir``
    (``engine.log``, ``records.jsonl.gz``, ``samples.jsonl``, ``outcome.json``). A server that
    does not start, or dies, is an outcome with its ``failure``, never an exception."""
    workdir.mkdir(parents=True, exist_ok=True)
    engine = EngineProcess(
        config, log_path=workdir / "engine.log", python=python, startup_timeout_s=startup_timeout_s
    )
    try:
        try:
            engine.start()
        except EngineError as exc:
            outcome = RunOutcome(label=label, engine_args=dict(config.args), failure=_why(exc))
        else:
            if on_ready is not None:
                on_ready(engine)
            if progress is not None:
                progress(f"{label}: server up in {engine.startup_s or 0:.0f} s; warming up")
            outcome = measure(
                engine.url,
                engine.scrape_metrics,
                engine.pgid,
                load,
                plan,
                target,
                label=label,
                engine_args=config.args,
                warmup_trace=warmup_trace,
                progress=progress,
            )
            outcome.startup_s = engine.startup_s
            try:
                engine.check_alive()
            except EngineError as exc:
                outcome.verdicts.append(Verdict("server", "fail", "died: " + _why(exc)))
    finally:
        engine.stop()
    write_outcome(outcome, workdir)
    return outcome


def progress_lines(
    label: str, plan: StabilityPlan, say: Callable[[str], None], every_s: float = 30.0
) -> Callable[[ReplayProgress], None]:
    """A replay progress callback that says one line every ``every_s`` of the plan (and one
    when every request has finished): the phase, the time, requests done and failed, the P95
    TTFT so far. Nothing per request."""
    last = [-math.inf]

    def on(p: ReplayProgress) -> None:
        finished = p.completed + p.failed >= p.total
        if p.elapsed_s - last[0] < every_s and not (finished and last[0] < math.inf):
            return
        last[0] = math.inf if finished else p.elapsed_s
        t = min(max(p.elapsed_s, 0.0), plan.duration_s)
        ttft = "-" if p.p95_ttft_ms is None else f"{p.p95_ttft_ms:,.0f} ms"
        say(
            f"{label}: {plan.phase_at(t)} at {t:.0f}/{plan.duration_s:.0f} s, "
            f"{p.completed}/{p.total} done, {p.failed} failed, P95 TTFT so far {ttft}"
        )

    return on


def _why(exc: EngineError) -> str:
    return f"{exc.failure_class.value}: {exc.explanation}"


def write_outcome(outcome: RunOutcome, workdir: Path) -> None:
    """The run's records, samples and document in ``workdir``."""
    import json

    workdir.mkdir(parents=True, exist_ok=True)
    if outcome.records:
        write_records(outcome.records, workdir / "records.jsonl.gz")
    with open(workdir / "samples.jsonl", "w") as f:
        for s in outcome.samples:
            f.write(json.dumps(finite(asdict(s))) + "\n")
    (workdir / "outcome.json").write_text(json.dumps(outcome.doc(), indent=2) + "\n")


def samples_of(outcomes: Sequence[RunOutcome]) -> dict[str, list[Sample]]:
    """Every outcome's samples by label (for plots)."""
    return {o.label: o.samples for o in outcomes}
