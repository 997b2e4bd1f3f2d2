"""Capacity steps on one running server: the trace rescaled, replayed, judged, isolated.

:class:`StepRunner` turns the pure search's ``measure(scale, attempt)`` into replays against a
server that was started once for the whole trial:

- before the first step, one warm-up replay (the trace's first requests at its own pace, never
  measured) so no step pays for the server's first-call costs;
- each step replays the shaped trace with its arrival times divided by the scale (bursts kept)
  and **fresh prompts** (a new seed: no prompt token of an earlier step can hit the prefix cache,
  except the pre-roll's warm set, below; the trace's own prefix sharing is kept inside the
  step), with early stop once the step's SLOs are out of reach;
- a windowed trace's pre-roll (:attr:`~optimizer.types.Trace.preroll`, the warm set) is sent
  once per server, before the first step's clock starts: its blocks have a seed of their own
  (``ReplayOptions.warm_seed``), the same in every step, while every other token is the step's,
  so each step finds exactly the warm set cached and nothing of an earlier step. It is sent
  again before a step only when the tokens sent since it was last sent, with it, exceed the
  server's KV cache (:attr:`StepRunner.kv_cache_tokens`; unknown: before every step), so they
  could have evicted some of it; the blocks still cached then hit, and only the evicted ones
  are computed again. Its requests are in no step's records (a step's ``preroll_requests``
  counts them, 0 where the warm set was kept);
- between steps, no request is left in flight (the server's running and waiting gauges are read
  until both are 0) and, for a trace without a pre-roll, the prefix cache is reset with
  ``POST /reset_prefix_cache`` where the server offers it (``VLLM_SERVER_DEV_MODE=1``); with a
  pre-roll it is not (that would drop the warm set; fresh prompts keep the steps apart);
  what isolated the steps is recorded;
- requests an early stop never sent, or cancelled, are outside the measured window: they are not
  errors of the server.

A replay whose client could not keep the schedule is re-run once with fresh prompts; a second
failure raises :class:`ClientCouldNotKeepUp` (the trial is then an invalid replay, never scored).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx

from objectives import Slo, summarize
from objectives.early_stop import EarlyStopper, Observations
from optimizer.capacity.search import StepOutcome
from optimizer.errors import ClientCouldNotKeepUp
from optimizer.types import RequestRecord, Trace
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import (
    ReplayProgress,
    ReplayResult,
    ReplaySnapshot,
    run_replay,
    warm_blocks,
)
from optimizer.workload.shaping import preroll_trace, scale_rate
from optimizer.workload.stats import BURST_WINDOW_S, largest_burst

__all__ = [
    "ClientCouldNotKeepUp",
    "StepRunner",
    "early_stop_check",
    "measured_records",
    "offered_rps",
    "slo_floors",
]

EARLY_STOP_PREFIX = "SLO out of reach: "
_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def measured_records(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The records an early stop did not cut: requests it never sent or cancelled are dropped.

    Such requests were never (fully) offered to the server; counting them as failures would
    charge the server with the tuner's decision to stop (an error rate of 0.74 on a server that
    failed nothing).
    """
    out = []
    for r in records:
        err = r.error or ""
        if err.startswith(("not sent: early stop", "cancelled: early stop")):
            continue
        out.append(r)
    return out


def early_stop_check(
    slos: Sequence[Slo], expected: int
) -> Callable[[ReplaySnapshot], str | None] | None:
    """A replay stop check that fires once ``slos`` can no longer be met (None if none can)."""
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
        return EARLY_STOP_PREFIX + reason if reason else None

    return check


def slo_floors(trace: Trace, records: Sequence[RequestRecord]) -> dict[str, float]:
    """What the trace and the measured server make impossible, in numbers.

    - ``prefill_tokens_per_s``: the fastest prefill any request of the step saw
      (prompt tokens / TTFT): an upper bound on the server's prefill rate;
    - ``burst_prompt_tokens`` / ``burst_requests``: the trace's largest burst (arrivals within
      :data:`~optimizer.workload.stats.BURST_WINDOW_S` of each other: a jittered tick is one);
    - ``ttft_floor_ms``: that burst's tokens / the prefill rate: the TTFT of the burst's last
      request cannot be lower, whatever the scheduler does;
    - ``tpot_floor_ms``: the smallest TPOT of any request (a decode step with the lightest
      batch the step saw).

    Returns an empty mapping when the step served nothing.
    """
    ok = [r for r in records if r.ok and r.first_token_s is not None and not r.warmup]
    if not ok:
        return {}
    rates = [
        r.input_tokens / (r.first_token_s - r.sent_s)
        for r in ok
        if r.first_token_s is not None and r.first_token_s > r.sent_s
    ]
    tpots = []
    for r in ok:
        if r.output_tokens > 1 and r.first_token_s is not None:
            last = r.chunk_times_s[-1] if r.chunk_times_s else r.end_s
            tpots.append((last - r.first_token_s) / (r.output_tokens - 1) * 1000.0)
    burst = largest_burst(trace, within_s=BURST_WINDOW_S)
    n, tokens = burst.requests, burst.prompt_tokens
    out: dict[str, float] = {"burst_prompt_tokens": float(tokens), "burst_requests": float(n)}
    if rates:
        rate = max(rates)
        out["prefill_tokens_per_s"] = rate
        out["ttft_floor_ms"] = tokens / rate * 1000.0
    if tpots:
        out["tpot_floor_ms"] = min(tpots)
    return out


@dataclass
class StepRunner:
    """Measures capacity steps against one running server.

    Attributes:
        url: The server's base URL.
        model: Served model name.
        trace: The shaped trace (scale 1).
        slos: The SLOs a step must meet.
        vocab: Token ids prompts draw from.
        seed: Base seed; every step gets its own (``seed * 1000 + step``).
        warmup_requests: Leading requests of each step outside its measured window.
        max_send_lag_ms: Client lag bound of a valid step.
        metrics: Reads the server's ``/metrics`` (running / waiting gauges).
        records_dir: Where each step's records are written (None: not written).
        progress: Replay progress callback.
        on_step: Called after each step (progress displays).
        on_step_start: Called with a step's scale and a note (``pre-roll first`` for a trace
            with a pre-roll, else "") before it starts.
        drain_timeout_s: How long to wait for the server to empty between steps.
        full_at_or_below: Steps at or below this scale run without early stop, so a
            configuration that fails at the lowest scale is judged on a full window.
        kv_cache_tokens: The server's KV cache in tokens (None: unknown): while the warm set
            and the tokens sent since it was sent fit, nothing of it can have been evicted.
        keep_warm_set: Send the pre-roll once and keep it (the module's rule). False: reset
            the prefix cache between steps and send the pre-roll before every step with the
            step's seed, as before issue 34 (the comparison row of the pre-roll benchmark).

    A step inside a bracket already measured (above a passed step, below a failed one: the
    bisection's steps, near the capacity) also runs without early stop: its margins are what
    the capacity's estimate interpolates to (a stopped step's are partial and never are), and
    an early stop there saves little (near a capacity it fires late in the step).
    """

    url: str
    model: str
    trace: Trace
    slos: Sequence[Slo]
    vocab: TokenRange
    seed: int
    warmup_requests: int = 0
    max_send_lag_ms: float = 10.0
    metrics: Callable[[], dict[str, float]] | None = None
    records_dir: Path | None = None
    progress: Callable[[ReplayProgress], None] | None = None
    on_step: Callable[[StepOutcome], None] | None = None
    on_step_start: Callable[[float, str], None] | None = None
    drain_timeout_s: float = 120.0
    full_at_or_below: float = 0.0
    replay: Callable[..., ReplayResult] = run_replay
    kv_cache_tokens: int | None = None
    keep_warm_set: bool = True
    isolation: set[str] = field(default_factory=set)
    records: dict[int, list[RequestRecord]] = field(default_factory=dict)
    _step: int = 0
    _tokens_since_warm: int | None = None  # None: the warm set was never sent
    _passed_max: float = 0.0
    _failed_min: float = math.inf

    def warm_up(self, requests: int = 16) -> None:
        """Replay the trace's first requests once at its own pace; nothing is measured."""
        head = Trace(
            requests=self.trace.requests[: max(1, min(requests, len(self.trace)))],
            block_size=self.trace.block_size,
            source=self.trace.source,
        )
        self.replay(
            head,
            self.url,
            self.model,
            vocab=self.vocab,
            seed=self.seed * 1000 + 999,
            warmup_requests=len(head),
            max_send_lag_ms=math.inf,
        )
        self._isolate()

    def __call__(self, scale: float, attempt: int) -> StepOutcome:
        """Measure one step (the pure search's ``measure``)."""
        result = self._replay_valid(scale)
        step = self._step
        self._step += 1
        records = measured_records(result.records)
        self.records[step] = records
        if self.records_dir is not None:
            from optimizer.trial_io import write_records

            write_records(records, self.records_dir / f"step-{step:02d}.jsonl.gz")
        summary = dict(summarize(records, slos=list(self.slos)))
        stopped = result.stopped_early and result.stop_reason.startswith(EARLY_STOP_PREFIX)
        margins = {str(slo): _margin(slo, summary) for slo in self.slos}
        reason = result.stop_reason.removeprefix(EARLY_STOP_PREFIX) if stopped else ""
        if not stopped and margins and max(margins.values()) > 0:
            worst = max(margins, key=lambda k: margins[k])
            reason = f"{worst} missed by {margins[worst]:+.0%}"
        self._isolate()
        outcome = StepOutcome(
            scale=scale,
            margins=margins,
            stopped_early=stopped,
            reason=reason,
            summary=summary,
            detail={
                "step": step,
                "attempt": attempt,
                "seed": self._seed(step),
                "offered_rps": offered_rps(self.trace, scale, self.warmup_requests),
                "replay_s": round(result.duration_s, 3),
                "partial": stopped,
                "preroll_requests": result.preroll_requests,
                "preroll_failed": result.preroll_failed,
                "preroll_tokens": result.preroll_tokens,
                "preroll_s": result.preroll_s,
                **self._warm_detail(result),
            },
        )
        if outcome.passed:
            self._passed_max = max(self._passed_max, scale)
        else:
            self._failed_min = min(self._failed_min, scale)
        if self.on_step is not None:
            self.on_step(outcome)
        return outcome

    def runs_in_full(self, scale: float) -> bool:
        """No early stop: at or below ``full_at_or_below``, or inside a measured bracket."""
        inside = 0 < self._passed_max < scale < self._failed_min < math.inf
        return scale <= self.full_at_or_below or inside

    def _seed(self, step: int) -> int:
        return self.seed * 1000 + step

    @property
    def keeps_warm_set(self) -> bool:
        """The trace has a pre-roll: sent once, kept between steps (see the module)."""
        return self.keep_warm_set and bool(self.trace.preroll)

    def _warm_seed(self) -> int | None:
        return self.seed * 1000 + 998 if self.keeps_warm_set else None

    @cached_property
    def _warm_set(self) -> tuple[int, frozenset[int]]:
        """The warm set's prompt tokens and prefix blocks, worked out once (the trace is fixed
        for the runner's life), not once per step and again in every replay."""
        tokens = sum(r.input_tokens for r in preroll_trace(self.trace).requests)
        return tokens, warm_blocks(self.trace)

    def warm_set_due(self) -> bool:
        """Send the pre-roll before the next step: never sent, or it may have been evicted (or
        not kept: before every step)."""
        if not self.keeps_warm_set:
            return bool(self.trace.preroll)
        if self._tokens_since_warm is None or self.kv_cache_tokens is None:
            return True
        return self._warm_set[0] + self._tokens_since_warm > self.kv_cache_tokens

    def _warm_detail(self, result: ReplayResult) -> dict[str, Any]:
        """A step's record of the warm set: ``sent`` before it, or ``kept`` from an earlier one."""
        if not self.keeps_warm_set:
            return {}
        return {"warm_set": "sent" if result.preroll_requests else "kept"}

    def _count_sent(self, trace: Trace, sent_preroll: bool) -> None:
        """Tokens that could evict the warm set since it was last sent (this step's, bounded
        from above by all of its requests' prompt and output tokens)."""
        if not self.keeps_warm_set:
            return
        tokens = sum(r.input_tokens + r.output_tokens for r in trace.requests)
        before = 0 if sent_preroll or self._tokens_since_warm is None else self._tokens_since_warm
        self._tokens_since_warm = before + tokens

    def _replay_valid(self, scale: float) -> ReplayResult:
        scaled = scale_rate(self.trace, scale)[0] if scale != 1.0 else self.trace
        expected = max(0, len(scaled) - self.warmup_requests)
        message = ""
        note = f"pre-roll of {len(self.trace.preroll)} requests first" if self.trace.preroll else ""
        for retry in range(2):
            send_warm = self.warm_set_due()
            if self.on_step_start is not None:
                self.on_step_start(scale, note if send_warm else "")
            result = self.replay(
                scaled,
                self.url,
                self.model,
                vocab=self.vocab,
                seed=self._seed(self._step) + 500 * retry,
                warmup_requests=self.warmup_requests,
                max_send_lag_ms=self.max_send_lag_ms,
                progress=self.progress,
                stop_check=(
                    None if self.runs_in_full(scale) else early_stop_check(self.slos, expected)
                ),
                warm_seed=self._warm_seed(),
                warm_blocks=self._warm_set[1] if self.keeps_warm_set else None,
                send_preroll=send_warm,
            )
            self._count_sent(scaled, send_warm)
            if result.schedule_kept:
                return result
            message = result.message
            self._isolate()
        raise ClientCouldNotKeepUp(f"step at rate x{scale:g}: {message}")

    def _isolate(self) -> None:
        """No request in flight, and the prefix cache reset where the server allows it."""
        if self.metrics is not None:
            deadline = time.monotonic() + self.drain_timeout_s
            while time.monotonic() < deadline:
                try:
                    m = self.metrics()
                except Exception:
                    break
                busy = m.get("vllm:num_requests_running", 0.0) + m.get(
                    "vllm:num_requests_waiting", 0.0
                )
                if busy <= 0:
                    self.isolation.add("drained")
                    break
                time.sleep(0.2)
        if self.keeps_warm_set:
            self.isolation.add("warm set kept")
        else:
            try:
                resp = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30.0)
            except httpx.HTTPError:
                resp = None
            if resp is not None and resp.status_code == 200:
                self.isolation.add("prefix cache reset")
        self.isolation.add("fresh prompts")

    def describe_isolation(self) -> str:
        """How steps were kept apart, e.g. ``"drained, prefix cache reset, fresh prompts"``."""
        order = ("drained", "prefix cache reset", "warm set kept", "fresh prompts")
        return ", ".join(k for k in order if k in self.isolation)


def _margin(slo: Slo, summary: dict[str, float]) -> float:
    try:
        return slo.margin(summary)
    except KeyError:
        return math.inf


def offered_rps(trace: Trace, scale: float, warmup: int) -> float:
    """Requests/s the step offered over its measured window (the trace's mean rate x scale)."""
    reqs = trace.requests[warmup:] if len(trace) > warmup + 1 else trace.requests
    if len(reqs) < 2:
        return 0.0
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return (len(reqs) - 1) / span * scale if span > 0 else 0.0


def dev_mode_env() -> dict[str, str]:
    """The server env that offers ``/reset_prefix_cache`` (vLLM's dev-mode endpoints)."""
    return {_DEV_MODE_ENV: "1"}


def step_doc(step: StepOutcome) -> dict[str, Any]:
    """A step as stored with the trial (JSON-safe; NaN -> None)."""
    return {
        "scale": step.scale,
        "passed": step.passed,
        "stopped_early": step.stopped_early,
        "reason": step.reason,
        "margins": {k: _num(v) for k, v in step.margins.items()},
        **{k: _num(v) if isinstance(v, float) else v for k, v in step.detail.items()},
    }


def _num(v: float) -> float | None:
    return None if math.isnan(v) or math.isinf(v) else round(v, 6)
