"""Frozen records shared by every part of the tuner, settings included.

The ground floor with :mod:`optimizer.errors`: the standard library and that module only.

Records hold raw observations with units in their names; metrics are derived later by pure
functions in :mod:`objectives`. Times inside one trial come from one monotonic clock and are
seconds since the replay started, so they can be subtracted from each other and nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from optimizer.errors import ConfigError, FailureClass

__all__ = [
    "CapacitySettings",
    "EngineConfig",
    "FailureClass",
    "MemoryAccount",
    "RequestRecord",
    "Trace",
    "TraceRequest",
    "TrialResult",
    "TrialSpec",
    "TrialStatus",
]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload, as recorded in production or generated.

    Attributes:
        arrival_s: Arrival time in seconds since the start of the trace (>= 0, non-decreasing
            along a trace).
        input_tokens: Prompt length in tokens (> 0).
        output_tokens: Number of tokens to generate (> 0); the replay sends it as
            ``max_tokens`` with ``ignore_eos`` so the server produces exactly this many.
        prefix_blocks: Hash ids of the prompt's leading blocks of ``Trace.block_size`` tokens.
            Two requests sharing a block id share those prompt tokens (prefix-cache reuse).
        session_id: Optional conversation/session identifier.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    prefix_blocks: tuple[int, ...] = ()
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """An ordered workload plus the facts needed to interpret it.

    Attributes:
        requests: Requests sorted by ``arrival_s``.
        block_size: Tokens per prefix block of ``TraceRequest.prefix_blocks``.
        source: Where the trace came from (file name and format), for reports.
        preroll: Requests of the stretch before a window, in arrival order (``arrival_s``
            relative to the window's start, so negative): sent before the measured replay to
            warm the server's prefix cache as production's would be, never measured
            (:func:`optimizer.workload.shaping.time_window`). Empty for a whole trace.
    """

    requests: tuple[TraceRequest, ...]
    block_size: int = 512
    source: str = ""
    preroll: tuple[TraceRequest, ...] = ()

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last arrival (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Raw observations of one replayed request. Derive metrics with ``objectives``.

    All ``*_s`` times are seconds since the replay clock started.

    Attributes:
        index: Position of the request in the replayed trace.
        scheduled_s: When the trace said the request should be sent.
        sent_s: When the client actually started sending it.
        first_token_s: Arrival of the first streamed chunk carrying ``choices``; None if none.
        chunk_times_s: Arrival times of every chunk carrying generated text (first included).
        end_s: When the response finished (or failed).
        input_tokens: Prompt tokens sent.
        output_tokens: Output tokens the server reported (usage) or, without usage, the
            number of text chunks received.
        error: None on success; otherwise a short description. An error event inside a 200
            stream is a failure.
        warmup: True for requests outside the measured window.
    """

    index: int
    scheduled_s: float
    sent_s: float
    first_token_s: float | None
    chunk_times_s: tuple[float, ...]
    end_s: float
    input_tokens: int
    output_tokens: int
    error: str | None = None
    warmup: bool = False

    @property
    def ok(self) -> bool:
        """True when the request completed without error."""
        return self.error is None


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    """How one configuration's capacity is searched.

    Attributes:
        start_scale: First rate scale measured (1.0: the shaped trace as it is); also the
            nominal scale whose latencies a ``capacity-latency`` study optimizes.
        min_scale: Lowest scale tried; failing there means the configuration serves none of
            this traffic within the SLOs (capacity 0).
        max_scale: Highest scale tried; passing there means capacity is at least this.
        growth: Factor between bracketing steps (> 1).
        tolerance: Stop bisecting once ``hi / lo - 1 <= tolerance``.
        max_steps: Replays a search may spend, repeats included.
        noise: A step whose deciding margin is within this (relative to the threshold) of
            zero is repeated before its verdict counts.
        max_repeats: Extra replays of such a step.
        race_at: Racing: the study's incumbent capacity (a rate scale), set per trial by the
            study (None: no race, the search starts at ``start_scale``).
        race_margin: Racing: the first step is at ``race_at * (1 + race_margin)``.
        race_growth: Racing: the first step up from a passed race step (> 1; smaller than
            ``growth``: a configuration that beats the incumbent rarely doubles it); each
            further pass squares the factor, up to ``growth``.
    """

    start_scale: float = 1.0
    min_scale: float = 1.0 / 16
    max_scale: float = 16.0
    growth: float = 2.0
    tolerance: float = 0.05
    max_steps: int = 8
    noise: float = 0.05
    max_repeats: int = 1
    race_at: float | None = None
    race_margin: float = 0.0
    race_growth: float = 1.25

    def __post_init__(self) -> None:
        problems = []
        if not (0 < self.min_scale <= self.start_scale <= self.max_scale):
            problems.append(
                "scales must satisfy 0 < min_scale <= start_scale <= max_scale "
                f"(got {self.min_scale:g}, {self.start_scale:g}, {self.max_scale:g})"
            )
        if not self.growth > 1:
            problems.append(f"growth must be > 1 (got {self.growth:g})")
        if not 0 < self.tolerance < 1:
            problems.append(f"tolerance must lie in (0, 1) (got {self.tolerance:g})")
        if self.max_steps < 1:
            problems.append(f"max_steps must be >= 1 (got {self.max_steps})")
        if self.noise < 0 or self.max_repeats < 0:
            problems.append("noise and max_repeats must be >= 0")
        if self.race_at is not None and not self.race_at > 0:
            problems.append(f"race_at must be > 0 (got {self.race_at:g})")
        if not -0.5 <= self.race_margin <= 1.0:
            problems.append(f"race_margin must lie in [-0.5, 1] (got {self.race_margin:g})")
        if not self.race_growth > 1:
            problems.append(f"race_growth must be > 1 (got {self.race_growth:g})")
        if problems:
            raise ConfigError("capacity search: " + "; ".join(problems))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What to start: a model, engine arguments keyed by ``vllm serve`` flag names, and env.

    Attributes:
        model: Model path or name, passed as ``--model``.
        args: Flag name (kebab-case, without ``--``) to value. ``True`` writes the bare flag,
            ``False`` writes ``--no-<flag>``, ``None`` leaves the flag out, lists repeat it.
        env: Extra environment variables for the server process.
    """

    model: str
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MemoryAccount:
    """What the engine said about its memory at startup (None where it did not say).

    Attributes:
        weights_gib: Memory taken by the model weights.
        kv_cache_gib: Memory available for the KV cache.
        kv_cache_tokens: KV cache capacity in tokens.
        max_concurrency: Maximum concurrency for requests of max-model-len tokens.
        cuda_graph_gib: Memory taken by CUDA graphs (GPU builds).
        max_model_len: The max-model-len the engine settled on.
        memory_utilization: The share of device memory (on the CPU build, of CPU memory) the
            engine says it sized its KV cache from (``gpu-memory-utilization`` as applied).
        kv_cache_explicit: True where the engine sized the KV cache in bytes
            (``kv-cache-memory-bytes``, or ``VLLM_CPU_KVCACHE_SPACE`` on the CPU build), False
            where it sized it from the memory share, None where it did not say.
    """

    weights_gib: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    cuda_graph_gib: float | None = None
    max_model_len: int | None = None
    memory_utilization: float | None = None
    kv_cache_explicit: bool | None = None


class TrialStatus(enum.StrEnum):
    """How a trial ended.

    ``complete``: measured and scored. ``failed``: the engine failed (crash, OOM, KV cache too
    small, timeout): a result that marks the edge of the feasible region. ``infeasible``: stopped
    early because its SLOs could no longer be met. ``invalid_replay``: the client could not keep
    the schedule; never scored, retried. ``rejected``: an invalid combination caught before any
    engine started. ``cancelled``: stopped by a cancel; not a result, never told to the sampler.
    ``duplicate``: a configuration the study had already measured; no engine started.
    ``raced_out``: a capacity trial that lost the race at the study's incumbent and failed one
    step below it too: only an upper bound of its capacity is known; told as pruned.
    ``lost``: its Ray node died under it, and again when it ran once more: the cluster's loss,
    not a result; never told to the sampler.
    """

    COMPLETE = "complete"
    FAILED = "failed"
    INFEASIBLE = "infeasible"
    INVALID_REPLAY = "invalid_replay"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    DUPLICATE = "duplicate"
    RACED_OUT = "raced_out"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class TrialSpec:
    """Everything one trial needs; picklable, so it can travel to a Ray actor.

    Attributes:
        number: The Optuna trial number.
        engine: What to start.
        trace: The shaped trace to replay.
        workdir: Folder for this trial's log and records.
        token_range: ``(low, high)`` ids prompts may use.
        seed: Prompt seed (fresh per trial, so no prompt is served from an earlier cache).
        warmup_requests: Leading requests excluded from the measured window.
        max_duration_s: Replay time limit (None: until every request finished).
        slos: SLO strings, e.g. ``("p95_ttft_ms<=500",)``, for goodput and early stopping.
        early_stop: Stop the replay once the SLOs can no longer be met.
        startup_timeout_s: Engine startup limit.
        python: Interpreter with vLLM (None: the current one).
        max_send_lag_ms: Bound on the client's P99 send lag for a valid replay.
        client_priority: The client's priority over the server (``realtime``, ``nice`` or
            ``normal``: :func:`optimizer.engine.cpus.raise_client_priority`).
        capacity: Search this configuration's capacity at the SLOs (a
            :class:`CapacitySettings`) instead of one fixed-load replay.
        preload_next: Once this trial's server is healthy, its runner may prepare the next
            trial's interpreter on the same GPUs (``engine.preload``).
        kv_cache_tokens: The started server's KV cache in tokens (set by the trial once the
            server reports it; None: unknown). A capacity search keeps the pre-roll's warm set
            cached between steps while it and the tokens sent since fit.
    """

    number: int
    engine: EngineConfig
    trace: Trace
    workdir: str
    token_range: tuple[int, int]
    seed: int = 0
    warmup_requests: int = 0
    max_duration_s: float | None = None
    slos: tuple[str, ...] = ()
    early_stop: bool = False
    startup_timeout_s: float = 900.0
    python: str | None = None
    max_send_lag_ms: float = 10.0
    client_priority: str = "nice"
    capacity: CapacitySettings | None = None
    preload_next: bool = False
    kv_cache_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What one trial observed.

    Attributes:
        number: The Optuna trial number.
        status: How it ended.
        summary: Metrics (``objectives.summarize`` keys); empty when nothing was measured.
        records: Raw per-request records (empty when the engine never served).
        failure_class: Why it failed, for ``failed`` trials.
        message: One paragraph for a user.
        startup_s: Launch to healthy.
        replay_s: Wall time of the replay.
        memory: The engine's memory account.
        server_metrics: Selected ``/metrics`` values after the replay (preemptions, ...).
        log_path: The engine log.
        log_lines: Relevant log lines of a failure.
        effective_config: The engine's settings once vLLM filled in its defaults (snake_case
            field -> logged text; see ``EngineProcess.effective_config``).
        startup: Where the start went: ``{"phases": {phase: s}, "reported": {what: s}}``
            (:mod:`optimizer.engine.startup`); also for a start that failed.
        capacity: A capacity trial's search (capacity, bracket, steps, isolation, SLO floors;
            see :func:`optimizer.capacity.trial.capacity_doc`); empty for fixed-load trials.
    """

    number: int
    status: TrialStatus
    summary: Mapping[str, float] = field(default_factory=dict)
    records: tuple[RequestRecord, ...] = ()
    failure_class: FailureClass | None = None
    message: str = ""
    startup_s: float | None = None
    replay_s: float | None = None
    memory: MemoryAccount | None = None
    server_metrics: Mapping[str, float] = field(default_factory=dict)
    log_path: str = ""
    log_lines: tuple[str, ...] = ()
    effective_config: Mapping[str, str] = field(default_factory=dict)
    capacity: Mapping[str, Any] = field(default_factory=dict)
    startup: Mapping[str, Any] = field(default_factory=dict)
