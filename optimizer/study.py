"""A study's plan: a job prepared before anything starts.

:func:`prepare` turns a job into a :class:`StudyPlan`: the trace read and shaped, the search
space, the objectives and SLOs, the engine's defaults, the baseline (vLLM's defaults for the same
model and trace, with max-num-seqs and max-num-batched-tokens passed explicitly), a warm start's
configurations and prior trials, and every flag a trial can get checked against the installed
vLLM. A job that fails here leaves nothing behind. :func:`create_storage` opens the study's
Optuna storage. The loop that runs a plan is :mod:`optimizer.study_driver`.

Imports optuna, never ray or mlflow (those live behind the runner and tracking seams).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from objectives import ObjectiveSet, load_objectives
from optimizer.capacity.measure import dev_mode_env
from optimizer.config import JobConfig
from optimizer.engine.cpus import cpus_problem, server_cpus_env
from optimizer.engine.defaults import (
    apply_engine_defaults,
    compile_cache_env,
    kv_env_conflict,
    prompt_token_range,
    trial_env,
)
from optimizer.engine.stack import cpu_bf16_note, gpu_facts
from optimizer.errors import ConfigError
from optimizer.sampling import MODEL_SAMPLERS
from optimizer.study_sampler import auto_sampler
from optimizer.types import EngineConfig, Trace, TrialSpec
from optimizer.warm_start import Priors, WarmStart, prior_trials, warm_start_configs
from search_spaces import ConstraintContext, SearchSpace, check_constraints, load_space
from search_spaces.speculation import speculation_possible, with_acceptance

__all__ = [
    "StudyPlan",
    "baseline_defaults",
    "create_storage",
    "job_objectives",
    "prepare",
]


@dataclass(frozen=True)
class StudyPlan:
    """Everything a driver needs, prepared and validated from a job.

    Attributes:
        job: The job.
        out: Output folder.
        storage_url: Optuna storage URL.
        trace: The shaped trace every trial replays.
        trace_notes: What reading and shaping the trace did (for reports).
        space: The search space.
        objectives: Objectives and SLOs.
        engine: Model, arguments every trial gets, and server env.
        baseline_args: Arguments of the baseline trial (engine args + vLLM's defaults).
        token_range: Ids prompts draw from.
        context: Facts parameter constraints are checked against.
        vllm: "dist version" of the vLLM the trials use.
        warm_start: Configurations enqueued from earlier studies (:mod:`optimizer.warm_start`).
        priors: Earlier studies' told trials, given to a TPE or GP sampler as prior observations.
        notes: What else preparing decided or found, one line each (a warm-start
            configuration skipped, and why; a bfloat16 model on a CPU without bfloat16
            kernels, :func:`optimizer.engine.stack.cpu_bf16_note`).
        study_name: The study's name in its storage (empty: the job's name, as ``tune``
            keeps it; the service names each study by its team and job id, so two teams'
            jobs of the same name never share a study in a shared storage). ``plan.json``
            records it.
    """

    job: JobConfig
    out: Path
    storage_url: str
    trace: Trace
    trace_notes: tuple[str, ...]
    space: SearchSpace
    objectives: ObjectiveSet
    engine: EngineConfig
    baseline_args: dict[str, Any]
    token_range: tuple[int, int]
    context: ConstraintContext
    vllm: str = ""
    warm_start: tuple[WarmStart, ...] = ()
    priors: Priors = field(default_factory=Priors)
    notes: tuple[str, ...] = ()
    study_name: str = ""

    @property
    def storage_name(self) -> str:
        """The study's name in its storage: :attr:`study_name`, else the job's name."""
        return self.study_name or self.job.name

    def with_acceptance(self, args: dict[str, Any]) -> dict[str, Any]:
        """A trial's engine arguments with the job's stated speculation acceptance in an
        enabled ``speculative-config`` (:mod:`search_spaces.speculation`); else unchanged."""
        stated = self.job.engine.speculation
        if stated is None:
            return args
        return with_acceptance(args, length=stated.acceptance_length, rates=stated.acceptance_rates)

    def trial_spec(
        self,
        number: int,
        args: dict[str, Any],
        *,
        workdir: Path,
        seed: int,
        early_stop: bool | None = None,
    ) -> TrialSpec:
        """A trial of this plan: the given engine arguments on the plan's model and trace.

        Args:
            number: Trial number (for logs and records).
            args: Engine arguments (flag names).
            workdir: Folder for the trial's log and records.
            seed: Prompt seed; give every run a fresh one so nothing is served from an
                earlier cache.
            early_stop: Override the job's early-stop setting.
        """
        job = self.job
        capacity = job.capacity.settings() if self.objectives.is_capacity else None
        # The study's compile caches live in its folder, wherever the folder is now.
        env = compile_cache_env(Path(self.out) / "cache", self.engine.env)
        env = trial_env(args, env, cpu_build=self.context.cpu_build, job_env=job.engine.env)
        if capacity is not None:
            # /reset_prefix_cache between capacity steps (dev-mode endpoints only).
            env.update(dev_mode_env())
        return TrialSpec(
            number=number,
            engine=EngineConfig(model=self.engine.model, args=args, env=env),
            trace=self.trace,
            workdir=str(workdir),
            token_range=self.token_range,
            seed=seed,
            warmup_requests=job.trace.warmup_requests,
            max_duration_s=job.trace.max_duration_s,
            slos=tuple(str(s) for s in self.objectives.slos),
            early_stop=job.objectives.early_stop if early_stop is None else early_stop,
            startup_timeout_s=job.engine.startup_timeout_s,
            python=job.engine.python,
            max_send_lag_ms=job.trace.max_send_lag_ms,
            client_priority=job.trace.client_priority,
            capacity=capacity,
            preload_next=(
                job.engine.preload if job.engine.preload is not None else not self.context.cpu_build
            ),
        )


def baseline_defaults(
    is_cpu_build: bool, gpu_memory_gib: float = 0.0, gpu_name: str = ""
) -> dict[str, int]:
    """vLLM's own max-num-seqs / max-num-batched-tokens defaults for the API server here.

    They depend on the device (DESIGN.md §7.5), so the baseline passes them explicitly: the same
    numbers a default deployment on this hardware gets, written down.
    """
    if is_cpu_build:
        return {"max-num-seqs": 128, "max-num-batched-tokens": 2048}
    if gpu_memory_gib >= 160:
        return {"max-num-seqs": 1024, "max-num-batched-tokens": 16384}
    if gpu_memory_gib >= 70 and "a100" not in gpu_name.lower():
        return {"max-num-seqs": 1024, "max-num-batched-tokens": 8192}
    return {"max-num-seqs": 256, "max-num-batched-tokens": 2048}


def _shaped_trace(job: JobConfig) -> tuple[Trace, tuple[str, ...]]:
    """The job's trace, read and shaped, and what reading and shaping did.

    Raises:
        ConfigError: Too few requests left after the warm-up ones.
    """
    from optimizer.workload.formats import read_trace
    from optimizer.workload.shaping import ShapeSpec, shape

    trace, report = read_trace(
        job.trace.path, job.trace.format, skip_bad_rows=job.trace.skip_bad_rows
    )
    shaped, reports = shape(trace, ShapeSpec(**job.trace.shaping.model_dump()))
    if len(shaped) <= job.trace.warmup_requests:
        raise ConfigError(
            f"{job.trace.path}: {len(shaped)} requests after shaping, not more than the "
            f"{job.trace.warmup_requests} warm-up requests: widen the window or lower "
            "warmup_requests"
        )
    return shaped, (report.summary(), *(r.summary() for r in reports))


def _validate_flags(
    install: Any, space: SearchSpace, engine_args: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """Every flag a trial can get, checked against the installed vLLM before anything starts."""
    from optimizer.engine.flags import accepted_flags, validate_engine_args

    flags = accepted_flags(install)
    validate_engine_args(engine_args, flags)
    validate_engine_args(baseline, flags)
    # flag_values covers the space's fixed flags too, with dotted keys assembled.
    for flag, values in space.flag_values().items():
        for value in values:
            validate_engine_args({flag: value}, flags)


def _refuse_memory_params_that_cannot_act(job: JobConfig, space: SearchSpace, is_cpu: bool) -> None:
    """A tuned memory parameter that something else overrides is refused (issue 34)."""
    fixed = {**job.engine.args, **space.fixed_args()}
    conflict = kv_env_conflict(
        list(space.params), job.engine.env, cpu_build=is_cpu, fixed_args=fixed
    )
    if conflict:
        raise ConfigError(f"job {job.name!r}: {conflict}")


def _make_model(job: JobConfig) -> None:
    """The job's model folder made (``model.make``) when it is missing or its weights' seed
    differs."""
    from optimizer.engine.models import make_model, needs_making

    model = job.model.path
    if job.model.make and needs_making(model, job.model.weights_seed):
        make_model(
            model,
            job.model.make,
            max_model_len=job.model.max_model_len,
            weights_seed=job.model.weights_seed,
        )


def _with_server_cpus(job: JobConfig, env: dict[str, str], is_cpu: bool) -> dict[str, str]:
    """The server's environment with the job's ``engine.cpus`` (unchanged without them).

    Raises:
        ConfigError: Cores this machine does not have (or cannot give the server).
    """
    if not job.engine.cpus:
        return env
    problem = cpus_problem(job.engine.cpus)
    if problem:
        raise ConfigError(problem)
    return server_cpus_env(job.engine.cpus, env, cpu_build=is_cpu)


def prepare(job: JobConfig, base: Path, *, check_flags: bool = True) -> StudyPlan:
    """Validate a job completely and build its plan; nothing is started.

    Raises:
        ConfigError: Anything wrong with the job, its trace, its space or its flags.
    """
    from optimizer.engine.flags import installed_vllm
    from optimizer.engine.models import model_info

    out = job.output_dir(base)
    model = job.model.path
    _make_model(job)

    shaped, notes = _shaped_trace(job)
    space = _job_space(job)
    objectives = job_objectives(job)

    job, warm, warm_notes, priors = _with_warm_start(job, base, space, objectives)
    install = installed_vllm(job.engine.python) if check_flags else None
    n_gpus, gpu_mem, gpu_name = gpu_facts()
    is_cpu = install.is_cpu_build if install else n_gpus == 0
    defaults = apply_engine_defaults(
        model,
        job.engine.args,
        job.engine.env,
        cpu_build=is_cpu,
        kv_cache_gib=job.engine.kv_cache_gib,
    )
    engine_args, env = defaults.args, _with_server_cpus(job, defaults.env, is_cpu)
    bf16_note = cpu_bf16_note(model, engine_args) if is_cpu else None
    local_model = Path(model).is_dir()
    baseline = {
        **engine_args,
        **(
            job.engine.baseline_args
            if job.engine.baseline_args is not None
            else baseline_defaults(is_cpu, gpu_mem, gpu_name)
        ),
    }

    if install is not None:
        _validate_flags(install, space, engine_args, baseline)
    _refuse_unstated_speculation(job, space, engine_args, baseline)
    _refuse_memory_params_that_cannot_act(job, space, is_cpu)

    token_range = prompt_token_range(model, job.trace.token_range)
    model_max = model_info(model).max_position_embeddings if local_model else None
    longest = max(r.input_tokens + r.output_tokens for r in shaped.requests)
    gpus = job.gpus_per_trial if job.gpus_per_trial else (0 if is_cpu else 1)
    ctx = ConstraintContext(
        gpus_per_trial=max(gpus, 1),
        longest_request_tokens=longest,
        model_max_len=model_max,
        cpu_build=is_cpu,
    )
    problems = check_constraints(baseline, ctx)
    if problems:
        raise ConfigError("the baseline configuration is invalid: " + "; ".join(problems))
    # Only now: a job that fails validation leaves no empty study folder behind.
    out.mkdir(parents=True, exist_ok=True)
    return StudyPlan(
        job=job,
        out=out,
        storage_url=job.storage_url(base),
        trace=shaped,
        trace_notes=notes,
        space=space,
        objectives=objectives,
        engine=EngineConfig(model=model, args=engine_args, env=env),
        baseline_args=baseline,
        token_range=token_range,
        context=ctx,
        vllm=f"{install.dist} {install.version}" if install else "",
        warm_start=tuple(warm),
        priors=priors,
        notes=(*warm_notes, *([bf16_note] if bf16_note else [])),
    )


def job_objectives(job: JobConfig) -> ObjectiveSet:
    """The job's objectives and SLOs (a preset, or its own objectives)."""
    section = job.objectives
    return load_objectives(
        section.preset if not section.objectives else None, section.objectives, section.slos
    )


def _job_space(job: JobConfig) -> SearchSpace:
    space = load_space(job.search_space)
    if job.sampler.name == "grid":
        space.grid()  # every param enumerable: refused here, before anything starts
    return space


def _refuse_unstated_speculation(
    job: JobConfig, space: SearchSpace, engine_args: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """Speculation on random weights measures nothing unless the job states the acceptance."""
    if job.engine.speculation is not None or "dummy" not in (
        engine_args.get("load-format"),
        baseline.get("load-format"),
    ):
        return
    if speculation_possible(space.params, [engine_args, baseline, space.fixed_args()]):
        raise ConfigError(
            "the search space (or the engine args) can turn speculative decoding on, but the "
            "model has random weights (load-format: dummy): a draft's tokens would be accepted "
            "at random and the measurement would say nothing about your model. State the "
            "acceptance to measure at, from your model's measured acceptance (e.g. vLLM's "
            "spec-decode metrics) or a value to test: engine: {speculation: "
            "{acceptance_length: 2.5}} (or acceptance_rates: [0.8, 0.6, 0.4]); or take "
            "speculative-config out of the space"
        )


def _with_warm_start(
    job: JobConfig, base: Path, space: SearchSpace, objectives: ObjectiveSet
) -> tuple[JobConfig, list[WarmStart], list[str], Priors]:
    """The job with its warm-start configurations after its own ``enqueue:``, notes on those
    skipped, and the sampler's prior trials (:func:`_priors`); every enqueued configuration
    checked against the space (raises, naming the value, before anything starts)."""
    for args in job.enqueue:
        space.enqueue_params(args)
    if job.warm_start is None:
        return job, [], [], Priors()
    warm, notes = warm_start_configs(job.warm_start.studies, base, job.warm_start.top, space)
    own = {json.dumps(a, sort_keys=True, default=str) for a in job.enqueue}
    warm = [w for w in warm if json.dumps(w.args, sort_keys=True, default=str) not in own]
    job = job.model_copy(update={"enqueue": [*job.enqueue, *(w.args for w in warm)]})
    priors = _priors(job, base, space, objectives)
    return job, warm, [*notes, *priors.notes], priors


def _priors(job: JobConfig, base: Path, space: SearchSpace, objectives: ObjectiveSet) -> Priors:
    """The warm start's prior observations for a sampler that learns from them (the forest, TPE,
    GP; ``auto`` as what it picks for this space and budget)."""
    ws = job.warm_start
    if ws is None or not ws.priors:
        return Priors()
    name = auto_sampler(job, space) if job.sampler.name == "auto" else job.sampler.name
    if name not in MODEL_SAMPLERS:
        return Priors(
            notes=(
                f"warm start: no prior trials given: the {name} sampler does not learn from trials",
            )
        )
    pairs = [
        (o.metric, optuna.study.StudyDirection[o.direction.upper()]) for o in objectives.objectives
    ]
    return prior_trials(ws.studies, base, space, pairs, [str(x) for x in objectives.slos])


def create_storage(
    url: str, *, heartbeat_interval_s: int = 30, grace_period_s: int = 90
) -> optuna.storages.BaseStorage:
    """Optuna storage for a URL: SQLite/PostgreSQL (RDB, with heartbeats) or ``journal:///path``."""
    if url.startswith("journal://"):
        from optuna.storages.journal import JournalFileBackend

        path = url[len("journal://") :]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(path))
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        # Several processes (drivers, `show`) share the file: wait for locks instead of failing.
        engine_kwargs = {"connect_args": {"timeout": 60}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    import sqlalchemy.exc

    # Two drivers starting at once on a fresh database both create Optuna's tables; on
    # PostgreSQL the loser's CREATE TYPE fails with a unique violation (pg_type). The tables
    # are there by then: try again.
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=heartbeat_interval_s,
                grace_period=grace_period_s,
            )
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")
