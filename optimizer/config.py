"""The job file: one YAML document describing a tuning study, validated by pydantic.

Every model forbids unknown keys, so a typo fails at load time with the key's path and the
closest valid name. Relative paths in a job file are resolved against the file's folder, so a
job runs the same from any working directory. Strings that reach a rendered file or a command
line (paths, names, engine arguments, environment) are plain text: no control characters, a
bounded length (:mod:`optimizer.text`). :func:`load_job` is the only way in.
"""

from __future__ import annotations

import difflib
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from optimizer.errors import ConfigError
from optimizer.stability.options import StabilityOptions, stability_options
from optimizer.text import escape_controls, text_problem, tree_problem
from optimizer.types import CapacitySettings
from search_spaces.speculation import rates_problems

__all__ = [
    "MAX_BUDGET",
    "CapacitySection",
    "EngineSection",
    "JobConfig",
    "ModelSection",
    "ObjectivesSection",
    "SamplerSection",
    "SpeculationSection",
    "StabilitySection",
    "TraceSection",
    "load_job",
    "parse_budget",
    "parse_until",
    "read_job_document",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _plain_text(value: str) -> str:
    """A string that reaches a rendered file or a command line: no control characters, a
    bounded length (:func:`optimizer.text.text_problem`)."""
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


#: A path, name or URL of the job: data, never structure (see :mod:`optimizer.text`).
PlainText = Annotated[str, AfterValidator(_plain_text)]


def _plain_tree(value: Any) -> Any:
    """Every key and string of engine arguments (or an inline space) is plain text."""
    problem = tree_problem(value, "", skip=("description",))
    if problem is not None:
        raise ValueError(problem)
    return value


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class ModelSection(_Strict):
    """Which model to serve.

    Attributes:
        path: Model folder or hub name, passed as ``--model``.
        make: A make-model preset: the folder is created when missing (weight-less, served with
            ``--load-format dummy``).
        max_model_len: With ``make``, lower the generated model's context length.
        weights_seed: With ``make`` (a Llama preset): give the folder seeded weights at a
            standard initialization scale instead of none, served by vLLM's normal loader.
            Dummy weights give flat logits, on which the quality gate sees nothing; two seeds
            are two different models.
    """

    path: PlainText
    make: PlainText | None = None
    max_model_len: int | None = Field(default=None, gt=0)
    weights_seed: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _seed_needs_make(self) -> ModelSection:
        if self.weights_seed is not None and not self.make:
            raise ValueError("weights_seed makes a model's weights: it needs make (a preset)")
        return self


class SpeculationSection(_Strict):
    """The acceptance that trials with speculative decoding are measured at.

    With random (dummy) weights a draft's acceptance means nothing; vLLM's synthetic rejection
    sampler runs the real proposer and verification but accepts draft tokens at the stated rate
    (:mod:`search_spaces.speculation`). State your model's measured acceptance, or a value to
    test against. Exactly one of:

    Attributes:
        acceptance_length: Mean tokens per verification step, accepted drafts plus the bonus
            token (1 = nothing accepted; at most num_speculative_tokens + 1).
        acceptance_rates: Per-position unconditional acceptance rates in [0, 1], not increasing
            (a trial drafting fewer tokens uses the first ones).
    """

    acceptance_length: float | None = Field(default=None, ge=1)
    acceptance_rates: list[float] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one(self) -> SpeculationSection:
        if (self.acceptance_length is None) == (self.acceptance_rates is None):
            raise ValueError(
                "state exactly one of acceptance_length (e.g. 2.5) and acceptance_rates "
                "(e.g. [0.8, 0.6, 0.4])"
            )
        problems = rates_problems(self.acceptance_rates or [])
        if problems:
            raise ValueError("; ".join(problems))
        return self


class EngineSection(_Strict):
    """How every trial's server is started.

    Attributes:
        python: Interpreter with vLLM installed (default: the tuner's own).
        args: Engine arguments every trial gets, baseline included (flag names).
        env: Extra environment of the server process (never logged to MLflow: may hold secrets).
        startup_timeout_s: Give up on a server not healthy after this long.
        kv_cache_gib: CPU build only: VLLM_CPU_KVCACHE_SPACE in whole GiB.
        baseline_args: Arguments of the baseline beyond ``args``; by default vLLM's own
            defaults for this hardware, with max-num-seqs and max-num-batched-tokens explicit.
        preload: While a trial replays, start the next trial's server interpreter on the same
            GPUs and import vLLM in it (:mod:`optimizer.engine.preload`), so the next start
            skips the imports. None (auto): on for GPU trials, off on the CPU build, where the
            imports would take cores from the replay being measured.
        speculation: The acceptance trials with speculative decoding are measured at
            (required when the model has random weights and the study can turn speculation on).
        cpus: Linux: the cores (ids as ``taskset`` names them) every trial's server runs on;
            its replay client then keeps to the tuner's other cores. On a CPU host a client
            that shares cores with the server it loads misses its schedule once the server
            saturates them (the replay is then retried, never scored). None: no pinning.
    """

    python: PlainText | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, PlainText] = Field(default_factory=dict)
    startup_timeout_s: float = Field(default=900.0, gt=0)
    kv_cache_gib: int | None = Field(default=None, ge=1)
    baseline_args: dict[str, Any] | None = None
    preload: bool | None = None
    speculation: SpeculationSection | None = None
    cpus: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)

    _args = field_validator("args", "baseline_args")(_plain_tree)

    @field_validator("cpus")
    @classmethod
    def _distinct_cpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"cores named twice: {v}")
        return sorted(v) if v is not None else None

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(
                    f"{escape_controls(key[:80])!r} is not an environment variable name "
                    "(letters, digits and _, not starting with a digit)"
                )
        return v


class ShapingSection(_Strict):
    """Trace shaping for every trial (see :mod:`optimizer.workload.shaping`)."""

    window_s: tuple[float, float | None] | None = None  # seconds from the file's first arrival
    # Seconds before the window whose requests warm the prefix cache before every replay (and
    # again after every prefix-cache reset between capacity steps), never measured. None:
    # enough to cover the window's prefix references; 0: no pre-roll. Only with window_s.
    preroll_s: float | None = Field(default=None, ge=0)
    spread_ticks: bool = False
    tick_s: float | None = Field(default=None, gt=0)
    sample_fraction: float | None = Field(default=None, gt=0, le=1)
    compress: float | None = Field(default=None, gt=0)
    target_duration_s: float | None = Field(default=None, gt=0)
    rate_scale: float | None = Field(default=None, gt=0)
    length_scale: float | None = Field(default=None, gt=0)
    output_scale: float | None = Field(default=None, gt=0)  # outputs' own, not length_scale's
    max_model_len: int | None = Field(default=None, gt=1)
    max_output_tokens: int | None = Field(default=None, gt=0)
    seed: int = 0


class TraceSection(_Strict):
    """The workload.

    Attributes:
        path: Trace file (any supported format).
        format: Format name, or ``auto``.
        skip_bad_rows: Skip and count malformed rows instead of failing.
        shaping: Shaping applied before every trial.
        warmup_requests: Leading requests excluded from the metrics.
        max_duration_s: Replay time limit per trial.
        max_send_lag_ms: A replay whose client P99 send lag exceeds this is retried, not scored.
        client_priority: The replay client's priority over the server where they share cores:
            ``nice`` (-10), ``realtime`` (SCHED_FIFO: on a saturated CPU host the only one that
            keeps the schedule) or ``normal``; each needs root or CAP_SYS_NICE, else the client
            runs as it is (:mod:`optimizer.engine.cpus`).
        token_range: ``[low, high)`` ids prompts may use (default: from the model folder).
    """

    path: PlainText
    format: PlainText = "auto"
    skip_bad_rows: bool = False
    shaping: ShapingSection = Field(default_factory=ShapingSection)
    warmup_requests: int = Field(default=0, ge=0)
    max_duration_s: float | None = Field(default=None, gt=0)
    max_send_lag_ms: float = Field(default=10.0, gt=0)
    client_priority: Literal["realtime", "nice", "normal"] = "nice"
    token_range: tuple[int, int] | None = None


class ObjectivesSection(_Strict):
    """What to optimize.

    Attributes:
        preset: An objectives preset name (``default``: min p95_ttft_ms, min p95_tpot_ms,
            max output_throughput).
        objectives: Instead of a preset, e.g. ``["min:p95_ttft_ms", "max:output_throughput"]``.
        slos: Constraints such as ``p95_ttft_ms<=500``; trials that miss one are infeasible.
        early_stop: Stop a tuned trial's replay once its SLOs can no longer be met (the baseline
            always replays the whole trace: it is the reference).
    """

    preset: PlainText | None = "default"
    objectives: list[PlainText] | None = None
    slos: list[PlainText] = Field(default_factory=list)
    early_stop: bool = True


class CapacitySection(_Strict):
    """The per-trial capacity search (used when an objective is a capacity metric).

    Attributes:
        start_scale: First rate scale, the nominal load (1.0: the shaped trace as is).
        min_scale: Lowest scale tried; failing there is capacity 0.
        max_scale: Highest scale tried.
        tolerance: Stop once the bracket ``hi / lo - 1`` is within this.
        max_steps: Replays per trial, noise repeats included.
        noise: Repeat a step whose deciding SLO margin is within this of its threshold.
        max_repeats: Extra replays of such a step.
        peak_rps: A peak request rate to provision for: the answer then says how many GPUs
            the baseline and the winner need for it.
        gpu_hour_price: Price of one GPU-hour: the answer then says the cost per million
            output tokens at capacity.
        racing: Race every tuned trial at the study's incumbent (its best capacity so far):
            the first step at the incumbent's scale; a configuration that fails there stops
            after one more step (:mod:`optimizer.capacity.search`). On by default (measured:
            benchmarks/RESULTS.md, issue 26); off: every trial searches from ``start_scale``.
        race_margin: The race step is at the incumbent's scale times ``1 + race_margin``.
        race_growth: The first step up from a passed race step; each further pass squares it,
            up to ``growth`` (:mod:`optimizer.capacity.search`).
    """

    start_scale: float = Field(default=1.0, gt=0)
    min_scale: float = Field(default=1.0 / 16, gt=0)
    max_scale: float = Field(default=16.0, gt=0)
    tolerance: float = Field(default=0.05, gt=0, lt=1)
    max_steps: int = Field(default=8, ge=1, le=64)
    noise: float = Field(default=0.05, ge=0)
    max_repeats: int = Field(default=1, ge=0, le=5)
    peak_rps: float | None = Field(default=None, gt=0)
    gpu_hour_price: float | None = Field(default=None, gt=0)
    racing: bool = True
    race_margin: float = Field(default=0.0, ge=-0.5, le=1.0)
    race_growth: float = Field(default=1.25, gt=1, le=4)

    @model_validator(mode="after")
    def _scales(self) -> CapacitySection:
        if not self.min_scale <= self.start_scale <= self.max_scale:
            raise ValueError(
                "capacity scales must satisfy min_scale <= start_scale <= max_scale "
                f"(got {self.min_scale:g}, {self.start_scale:g}, {self.max_scale:g})"
            )
        return self

    def settings(self) -> CapacitySettings:
        """The search settings."""
        return CapacitySettings(
            start_scale=self.start_scale,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            tolerance=self.tolerance,
            max_steps=self.max_steps,
            noise=self.noise,
            max_repeats=self.max_repeats,
            race_margin=self.race_margin,
            race_growth=self.race_growth,
        )


class StabilitySection(_Strict):
    """The stability check as a stage of the study: ``vllm-autotune stability``'s options, with
    its defaults.

    Attributes:
        after_study: ``tune`` runs the check when the study ends: the configuration export's
            default policy picks and the baseline, each on a server of its own, under the
            same plan; the verdicts go to ``stability.json`` and MLflow like the command's.
        minutes: Sustained phase, minutes.
        fraction: Capacity studies: the load as a fraction of the measured capacity.
        burst_factor: Burst rate, times capacity (a fixed-load study: times the trace's rate).
        burst_s: Burst seconds.
        recovery_s: Seconds after the burst (None: 1.5 times the time its backlog takes to
            drain at capacity, at least 30).
        long_s: Seconds of the long-input phase.
        window_s: Latency window, seconds.
        baseline: Run the baseline too (the comparison needs it).
    """

    after_study: bool = False
    minutes: float = Field(default=3.0, gt=0)
    fraction: float = Field(default=0.7, gt=0)
    burst_factor: float = Field(default=3.0, gt=0)
    burst_s: float = Field(default=20.0, ge=0)
    recovery_s: float | None = Field(default=None, ge=0)
    long_s: float = Field(default=30.0, ge=0)
    window_s: float = Field(default=10.0, gt=0)
    baseline: bool = True

    def options(self) -> StabilityOptions:
        """The check's options."""
        return stability_options(**self.model_dump(exclude={"after_study"}))


class SamplerSection(_Strict):
    """The Optuna sampler: by default ``rf``, SMAC3's random-forest surrogate
    (optimizer.rf_sampler; several objectives by ParEGO), the best measured search
    (benchmarks/RESULTS.md, "Search strategies"); ``tpe``: Optuna's multi-objective TPE; ``gp``;
    ``random`` for comparison; ``grid`` to measure every configuration of a space whose params are
    all enumerable (a categorical param's choices, a numeric param's steps) once, in an order the
    seed shuffles; ``guided``: the tuning guide's moves from the baseline (optimizer.guided),
    then TPE; ``auto``: grid where the trial budget covers the space, else ``rf``."""

    name: Literal["tpe", "gp", "rf", "random", "grid", "guided", "auto"] = "rf"
    seed: int | None = 0
    n_startup_trials: int = Field(default=4, ge=0)
    # A model's (rf, TPE, GP) first n_startup_trials: random draws, or the tuning guide's moves
    # from the baseline (optimizer.guided). "guided" as the name: the guide until done, then TPE.
    startup: Literal["random", "guided"] = "random"


class QualitySection(_Strict):
    """The quality gate (:mod:`optimizer.quality`): a configuration that changes numerics
    (quantization, KV-cache dtype, speculative decoding, dtype) is compared with the baseline
    on the same weights before it can be exported; every other one is unchanged by
    construction. Dummy weights (flat logits) skip it, never a pass.

    Attributes:
        enabled: Check the feasible front's numeric-changing members before the study ends.
        prompts: Prompts compared, each sent alone, in order (the trace's first requests).
        prompt_tokens: Tokens of each prompt, at most.
        continuation_tokens: Tokens of the baseline's greedy continuation scored.
        min_top1_agreement: Least share of positions where the baseline's token stays the
            candidate's top choice (0.95: InferenceBench's gate keeps 0.95x the accuracy).
        max_logprob_drift: Most mean absolute logprob difference over the floor, in nats
            (0.1: the chosen token's probability moves about 10 % on average; the FP8 KV cache
            moved seeded weights of the small shape by 0.023).
        min_greedy_match: Least share of the candidate's own greedy tokens before it diverges
            from the baseline's (judged where speculation is a lever).
        eval_set: A local JSONL eval set (``prompt`` and ``answer`` per line), relative to the
            job file; its accuracy ratio to the baseline's is judged too.
        eval_max_tokens: Tokens of each eval answer.
        min_accuracy_ratio: Least candidate accuracy over the baseline's on the eval set.
    """

    enabled: bool = True
    prompts: int = Field(default=8, ge=1, le=256)
    prompt_tokens: int = Field(default=128, ge=16)
    continuation_tokens: int = Field(default=64, ge=1, le=4096)
    min_top1_agreement: float = Field(default=0.95, ge=0, le=1)
    max_logprob_drift: float = Field(default=0.1, ge=0)
    min_greedy_match: float = Field(default=0.9, ge=0, le=1)
    eval_set: PlainText | None = None
    eval_max_tokens: int = Field(default=16, ge=1)
    min_accuracy_ratio: float = Field(default=0.95, ge=0)


class WarmStartSection(_Strict):
    """Begin with the best configurations of earlier studies (:mod:`optimizer.warm_start`).

    Attributes:
        studies: Earlier study folders (relative to the job file): the same model, a
            similar trace.
        top: Best configurations taken from each.
        priors: Also give a model-based sampler (TPE, GP) the earlier studies' told trials as
            prior observations (same objectives and SLOs only;
            :func:`optimizer.warm_start.prior_trials`).
    """

    studies: list[str] = Field(min_length=1)
    top: int = Field(default=3, ge=1, le=20)
    priors: bool = True


class MlflowSection(_Strict):
    """MLflow review (default: a local SQLite-backed store in the output folder)."""

    enabled: bool = True
    tracking_uri: PlainText | None = None
    experiment: PlainText | None = None


class JobConfig(_Strict):
    """A whole tuning job.

    Attributes:
        name: Study name (also the MLflow experiment by default).
        model: What to serve.
        engine: How to start servers.
        gpus_per_trial: GPUs one trial may use (0: the CPU build, one trial at a time).
        trace: The workload.
        search_space: A preset name, a YAML path, or an inline space.
        objectives: Objectives and SLOs.
        capacity: The capacity search of each trial (with a capacity objective), and what
            the answer is priced in (peak rate, GPU-hour price).
        sampler: The Optuna sampler.
        trials: Number of trials, baseline included (None: until the budget ends).
        budget: Wall-clock budget, e.g. ``8h`` or ``90m``: stop launching after it.
        until: Local time of day, e.g. ``07:00``: stop launching then.
        parallel: Trials at once (each in its own Ray actor and GPUs).
        storage: Optuna storage URL (default: SQLite in the output folder).
        out: Output folder (default: ``runs/<name>`` beside the job file).
        ray_address: Join this Ray cluster instead of starting a local one.
        retries: How often a trial whose replay was invalid is re-run before giving up.
        enqueue: Configurations (engine arguments of the search space) to try right after the
            baseline, e.g. the one in production today.
        warm_start: Earlier studies whose best configurations are enqueued after these.
        mlflow: MLflow settings.
        stability: The stability check as a stage (``after_study``) and its plan.
        quality: The quality gate on numeric-changing configurations.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)
    model: ModelSection
    engine: EngineSection = Field(default_factory=EngineSection)
    gpus_per_trial: int = Field(default=0, ge=0)
    trace: TraceSection
    search_space: str | dict[str, Any] = "default"
    objectives: ObjectivesSection = Field(default_factory=ObjectivesSection)
    capacity: CapacitySection = Field(default_factory=CapacitySection)
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    trials: int | None = Field(default=None, ge=1)
    budget: PlainText | None = None
    until: PlainText | None = None
    parallel: int = Field(default=1, ge=1)
    storage: PlainText | None = None
    out: PlainText | None = None
    ray_address: PlainText | None = None
    retries: int = Field(default=2, ge=0)
    enqueue: list[dict[str, Any]] = Field(default_factory=list)
    warm_start: WarmStartSection | None = None
    mlflow: MlflowSection = Field(default_factory=MlflowSection)
    stability: StabilitySection = Field(default_factory=StabilitySection)
    quality: QualitySection = Field(default_factory=QualitySection)

    _trees = field_validator("search_space", "enqueue")(_plain_tree)

    @field_validator("budget")
    @classmethod
    def _budget(cls, v: str | None) -> str | None:
        if v is not None:
            parse_budget(v)
        return v

    @field_validator("until")
    @classmethod
    def _until(cls, v: str | None) -> str | None:
        if v is not None:
            parse_until(v, now=datetime.now())
        return v

    @model_validator(mode="after")
    def _stops(self) -> JobConfig:
        if self.trials is None and self.budget is None and self.until is None:
            raise ValueError("set `trials`, `budget` or `until`: the study needs a way to stop")
        return self

    def output_dir(self, base: Path) -> Path:
        """The output folder, resolved against ``base`` (the job file's folder)."""
        return _resolve(self.out or f"runs/{self.name}", base)

    def storage_url(self, base: Path) -> str:
        """Optuna storage URL: the configured one, or SQLite in the output folder."""
        if self.storage:
            return self.storage
        return f"sqlite:///{self.output_dir(base) / 'study.db'}"


def _resolve(path: str, base: Path) -> Path:
    """``path`` (``~`` expanded) against ``base``.

    Raises:
        ConfigError: ``~name`` of a user this machine does not know.
    """
    try:
        p = Path(path).expanduser()
    except RuntimeError:
        raise ConfigError(
            f"{path[:200]!r}: no home folder for its '~' on this machine; give the full path"
        ) from None
    return p if p.is_absolute() else (base / p).resolve()


_BUDGET = re.compile(
    r"^\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m)?\s*(?:(\d+(?:\.\d+)?)\s*s)?\s*$"
)


#: Longest budget a job may give (a study of a year is a mistake, and a larger one overflows).
MAX_BUDGET = timedelta(days=365)


def parse_budget(text: str) -> timedelta:
    """``"8h"``, ``"1h30m"``, ``"90m"``, ``"45s"`` -> timedelta, at most :data:`MAX_BUDGET`.

    Raises:
        ConfigError: Unreadable text, or a duration longer than :data:`MAX_BUDGET`.
    """
    shown = escape_controls(text[:40])
    m = _BUDGET.match(text)
    if not m or not any(m.groups()):
        raise ConfigError(f"budget {shown!r}: expected a duration such as 8h, 1h30m, 90m or 600s")
    h, mins, s = (float(g) if g else 0.0 for g in m.groups())
    seconds = h * 3600 + mins * 60 + s
    limit = MAX_BUDGET.total_seconds()
    if not seconds <= limit:  # inf and NaN included
        raise ConfigError(
            f"budget {shown!r}: longer than the longest budget, {limit / 3600:.0f}h "
            f"({MAX_BUDGET.days} days); give at most {limit / 3600:.0f}h"
        )
    return timedelta(seconds=seconds)


def parse_until(text: str, *, now: datetime) -> datetime:
    """``"07:00"`` -> the next such local time after ``now``.

    Raises:
        ConfigError: Unreadable text.
    """
    try:
        t = datetime.strptime(text.strip(), "%H:%M").time()
    except ValueError as exc:
        raise ConfigError(
            f"until {escape_controls(text[:40])!r}: expected a local time HH:MM such as 07:00"
        ) from exc
    at = now.replace(hour=t.hour, minute=t.minute, second=0, microsecond=0)
    return at if at > now else at + timedelta(days=1)


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Valid keys at ``loc`` (for 'did you mean' hints)."""
    current: Any = model
    for part in loc[:-1]:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        ann = field.annotation
        candidates = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)]
        current = next((a for a in candidates if issubclass(a, BaseModel)), None)
        if current is None:
            return []
    return list(current.model_fields)


def _explain(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid job file"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        # a key is the submitter's text: one line, bounded (a newline would split the errors)
        path = ".".join(escape_controls(str(p)[:80]) for p in loc) or "(top level)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            names = _field_names(JobConfig, loc)
            close = difflib.get_close_matches(str(loc[-1])[:80], names, n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
            msg = f"unknown key; {fix}"
        elif err["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)


def read_job_document(path: Path) -> dict[str, Any]:
    """A job file's YAML mapping, not yet validated.

    Raises:
        ConfigError: Unreadable, not YAML, or not a mapping.
    """
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read job file ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a job file is a YAML mapping (name, model, trace, ...)")
    return data


def load_job(
    source: str | Path | dict[str, Any], *, base: Path | None = None
) -> tuple[JobConfig, Path]:
    """Read and validate a job.

    Args:
        source: A YAML file path, or an already-parsed mapping (then ``base`` resolves paths).
        base: Folder relative paths are resolved against (default: the file's folder, or the
            working directory for a mapping).

    Returns:
        The job and the base folder, with ``model.path``, ``trace.path`` and a
        ``search_space`` file (any string that is not a preset name) resolved to absolute
        paths.

    Raises:
        ConfigError: Unreadable YAML or an invalid job; the message names every bad key.
    """
    if isinstance(source, dict):
        data, where = source, "job"
        folder = (base or Path.cwd()).resolve()
    else:
        path = Path(source)
        data = read_job_document(path)
        where = str(path)
        folder = (base or path.parent).resolve()
    try:
        job = JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, where)) from exc
    model_path = job.model.path
    if job.model.make or model_path.startswith((".", "/", "~")) or (folder / model_path).exists():
        model_path = str(_resolve(model_path, folder))
    from search_spaces.schema import is_preset_name

    space: str | dict[str, Any] = job.search_space
    if isinstance(space, str) and not is_preset_name(space):  # a file, whatever its suffix
        space = str(_resolve(space, folder))
    job = job.model_copy(
        update={
            "model": job.model.model_copy(update={"path": model_path}),
            "trace": job.trace.model_copy(update={"path": str(_resolve(job.trace.path, folder))}),
            "search_space": space,
            "quality": job.quality.model_copy(
                update={
                    "eval_set": (
                        str(_resolve(job.quality.eval_set, folder))
                        if job.quality.eval_set
                        else None
                    )
                }
            ),
        }
    )
    return job, folder
