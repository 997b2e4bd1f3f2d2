"""The study: an Optuna ask/tell loop over vLLM engine configurations.

``prepare`` turns a job into a plan (shaped trace, search space, objectives, baseline, every flag
checked against the installed vLLM) before anything starts. ``StudyDriver.run`` then asks Optuna
for configurations, rejects invalid combinations before any engine starts, hands the rest to a
:class:`~optimizer.runners.TrialRunner`, and tells Optuna the outcome:

- trial 0 is the baseline (vLLM's defaults for the same model and trace, with max-num-seqs and
  max-num-batched-tokens passed explicitly), enqueued once per study;
- a measured trial is told its objective values and its SLO margins as constraints
  (``trial.set_constraint``, <= 0 met), so ``study.best_trials`` is the feasible Pareto front;
- an engine that fails (crash, OOM, KV cache too small, timeout) or a replay stopped early is
  told as complete with worst-case values and violated constraints: the sampler learns where
  the feasible region ends;
- a replay whose client could not keep the schedule is re-run, never scored;
- a cancelled trial is failed with status ``cancelled``: a cancel is not a result;
- without SLOs every told trial carries one constraint, ``engine_served`` (met when the engine
  served), so measured and failed trials have the same constraints (Optuna's samplers compare
  them) and the feasible front holds the measured ones;
- a driver that dies leaves RUNNING trials; the next driver fails them (same host: the dead
  pid; elsewhere: Optuna's heartbeat) and re-enqueues their configurations, so none is lost;
- a resumed study re-seeds its sampler from the number of trials it holds (the same seed would
  replay the first driver's proposals), and a proposal the study already measured starts no
  engine: it is failed with status ``duplicate`` and counts toward the trial count.

Imports optuna, never ray or mlflow (those live behind the runner and tracking seams).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import math
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from objectives import ObjectiveSet, load_objectives
from optimizer.capacity.measure import dev_mode_env
from optimizer.capacity.trial import capacity_constraints
from optimizer.config import JobConfig, parse_budget, parse_until
from optimizer.engine.cpus import cpus_problem, server_cpus_env
from optimizer.engine.defaults import (
    apply_engine_defaults,
    compile_cache_env,
    kv_env_conflict,
    prompt_token_range,
    trial_env,
)
from optimizer.engine.stack import gpu_facts, hardware_line, installed_stack
from optimizer.errors import ConfigError, SearchSpaceError
from optimizer.guided import GuidedSampler
from optimizer.sampling import MODEL_SAMPLERS, model_sampler
from optimizer.study_folder import portable_url
from optimizer.trial_io import progress_line, read_progress
from optimizer.trial_view import (
    BASELINE_ATTR,
    TrialView,
    gpus_per_server,
    record_engine_args,
    record_result,
    record_status,
)
from optimizer.types import EngineConfig, Trace, TrialResult, TrialSpec, TrialStatus
from optimizer.warm_start import Priors, WarmStart, prior_trials, warm_start_configs
from search_spaces import ConstraintContext, SearchSpace, check_constraints, load_space
from search_spaces.speculation import speculation_possible, with_acceptance

__all__ = [
    "StudyDriver",
    "StudyEvent",
    "StudyPlan",
    "baseline_defaults",
    "create_storage",
    "is_baseline",
    "prepare",
]

_DRIVER_ATTR = "driver"
# Without SLOs, the one constraint every told trial carries: the engine served (<= 0) or not.
_SERVED = "engine_served"


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
        notes: What else preparing decided, one line each (a warm-start configuration
            skipped, and why).
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


@dataclass(frozen=True)
class StudyEvent:
    """Something a progress display or tracker wants to know.

    Attributes:
        kind: ``started``, ``progress`` (a running trial's phase and replay progress, at most
            every ``progress_interval_s``, in ``detail``), ``finished``, ``rejected``,
            ``retry``, ``stale``, ``enqueued`` (a configuration of the job's ``enqueue:``
            added on resume), ``enqueue_refused`` (those not added: the trial count is
            reached; ``number`` -1) or ``exhausted`` (the sampler proposed only configurations
            the study had measured, :data:`MAX_REPEATS` in a row: launching stops; -1).
        number: Optuna trial number.
        result: The trial's result (``finished``).
        trial: The frozen trial after ``tell`` (``finished``, ``rejected``).
        detail: Free text.
    """

    kind: str
    number: int
    result: TrialResult | None = None
    trial: FrozenTrial | None = None
    detail: str = ""


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


def prepare(job: JobConfig, base: Path, *, check_flags: bool = True) -> StudyPlan:
    """Validate a job completely and build its plan; nothing is started.

    Raises:
        ConfigError: Anything wrong with the job, its trace, its space or its flags.
    """
    from optimizer.engine.flags import installed_vllm
    from optimizer.engine.models import make_model, model_info, needs_making

    out = job.output_dir(base)
    model = job.model.path
    if job.model.make and needs_making(model, job.model.weights_seed):
        make_model(
            model,
            job.model.make,
            max_model_len=job.model.max_model_len,
            weights_seed=job.model.weights_seed,
        )

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
    engine_args, env = defaults.args, defaults.env
    if job.engine.cpus:
        problem = cpus_problem(job.engine.cpus)
        if problem:
            raise ConfigError(problem)
        env = server_cpus_env(job.engine.cpus, env, cpu_build=is_cpu)
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
        notes=tuple(warm_notes),
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
    """The warm start's prior observations for a sampler that learns from them (TPE, GP)."""
    ws = job.warm_start
    if ws is None or not ws.priors:
        return Priors()
    if job.sampler.name not in MODEL_SAMPLERS:
        return Priors(
            notes=(
                f"warm start: no prior trials given: the {job.sampler.name} sampler does not "
                "learn from trials",
            )
        )
    pairs = [
        (o.metric, optuna.study.StudyDirection[o.direction.upper()]) for o in objectives.objectives
    ]
    return prior_trials(ws.studies, base, space, pairs, [str(x) for x in objectives.slos])


def _portable_job(plan: StudyPlan) -> dict[str, Any]:
    """The job as ``plan.json`` keeps it: the study folder as ``.`` and the default storage
    unset, both read against the folder the study is in now (:mod:`optimizer.study_folder`)."""
    doc = plan.job.model_dump(mode="json")
    doc["out"] = "."
    if doc.get("storage") and portable_url(str(doc["storage"]), plan.out) == "study.db":
        doc["storage"] = None  # the default, SQLite in the study folder: read against it
    return doc


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
    return optuna.storages.RDBStorage(
        url,
        engine_kwargs=engine_kwargs,
        heartbeat_interval=heartbeat_interval_s,
        grace_period=grace_period_s,
    )


MAX_REPEATS = 20
"""Duplicate proposals in a row after which a study stops launching (its space is measured
through)."""


def _sampler(
    job: JobConfig,
    space: SearchSpace,
    resumed_at: int = 0,
    priors: tuple[FrozenTrial, ...] = (),
) -> optuna.samplers.BaseSampler:
    """The job's sampler; ``resumed_at``: trials the study already holds; ``priors``: a warm
    start's prior observations (TPE and GP only).

    TPE and GP are wrapped in :class:`~optimizer.sampling.KnowledgeSampler`: they learn from the
    trials that chose a configuration (not the param-less baseline) and from ``priors``, and
    propose no configuration the study holds while one is free.

    The grid sampler skips the grid points the study's trials already measured, so a resumed
    grid study goes on where it stopped.

    A seeded sampler restarts its random sequence in every new driver, so a resumed study would
    propose the first driver's configurations again: the seed is offset by the trial count.
    """
    s = job.sampler
    seed = None if s.seed is None else s.seed + resumed_at
    if s.name == "auto":
        s = s.model_copy(update={"name": auto_sampler(job, space)})
    if s.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s.name == "grid":
        return _GridSampler(space.grid(), seed=s.seed)
    if s.name == "rf":
        from optimizer.rf_sampler import RFSampler  # SMAC3: the `rf` extra

        return RFSampler(seed=seed, n_startup_trials=s.n_startup_trials)
    model = model_sampler("tpe" if s.name == "guided" else s.name, seed, s.n_startup_trials, priors)
    if s.name == "guided" or s.startup == "guided":
        cap = None if s.name == "guided" else s.n_startup_trials
        return GuidedSampler(space_distributions(space), model, max_guided=cap)
    return model


def auto_sampler(job: JobConfig, space: SearchSpace) -> str:
    """The sampler ``auto`` picks by size: ``grid`` where the trial budget covers every
    configuration of the space (the baseline besides), else TPE (a model that proposes its best
    free configuration; benchmarks/RESULTS.md has the measured comparison)."""
    try:
        points = math.prod(len(v) for v in space.grid().values())
    except SearchSpaceError:
        return "tpe"  # continuous, conditional or too large to list
    return "grid" if job.trials is not None and job.trials >= points + 1 else "tpe"


def space_distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    """The distributions a trial of ``space`` suggests (its params active by default)."""
    probe = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = probe.ask()
    space.suggest(trial)
    return dict(trial.distributions)


def request_seed(study_seed: int | None, number: int, attempt: int) -> int:
    """The prompts' seed of a trial's attempt: fresh per trial and attempt, and per study seed,
    so that repeats of one job (``--seed N``) replay their baselines (trial 0) and every other
    trial number with other requests. Seed 0 (and None) keep the numbering of earlier studies."""
    return abs(study_seed or 0) * 10_000_000 + number * 1000 + attempt + 1


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler made safe to resume, for an ask/tell loop.

    - Optuna numbers the grid's points in an order shuffled by the seed, and gives trial *n* point
      *n*: a study resumed with another seed (or holding enqueued trials, which take numbers but
      no point) would read its measured points as other ones, measure some twice and never reach
      others. Here a point's number is its place in the grid's own order (the same in every
      driver), the seed only picks which unmeasured point comes next, and a point that any
      finished or running trial holds (enqueued ones too, matched by their values) counts as taken.
    - Once every point is measured Optuna calls ``study.stop()``, which only ``study.optimize``
      allows (a RuntimeError from ``tell`` otherwise); the driver asks :meth:`is_exhausted`
      before it launches instead.
    """

    def __init__(self, search_space: dict[str, list[Any]], seed: int | None = None) -> None:
        super().__init__(search_space, seed=seed)
        self._all_grids = list(itertools.product(*self._search_space.values()))
        self._index = {point: i for i, point in enumerate(self._all_grids)}

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if "grid_id" in trial.system_attrs or "fixed_params" in trial.system_attrs:
            return
        free = self._get_unvisited_grid_ids(study) or list(range(len(self._all_grids)))
        grid_id = int(self._rng.rng.choice(sorted(free)))
        study._storage.set_trial_system_attr(trial._trial_id, "search_space", self._search_space)
        study._storage.set_trial_system_attr(trial._trial_id, "grid_id", grid_id)

    def _get_unvisited_grid_ids(self, study: optuna.Study) -> list[int]:
        taken = {
            self._index.get(tuple(t.params.get(name, _NO_VALUE) for name in self._param_names))
            for t in study._storage.get_all_trials(study._study_id, deepcopy=False)
            if t.state.is_finished() or t.state == TrialState.RUNNING
        }
        return [i for i in range(len(self._all_grids)) if i not in taken]

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        return None


_NO_VALUE = object()


def is_baseline(trial: FrozenTrial) -> bool:
    """True for the study's baseline trial."""
    return TrialView(trial).is_baseline


def _driver_identity() -> dict[str, Any]:
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "create_time": me.create_time()}


def _driver_dead(ident: Any) -> bool:
    """True when a driver recorded on this host is no longer running."""
    if not isinstance(ident, dict) or ident.get("host") != socket.gethostname():
        return False
    try:
        return (
            abs(psutil.Process(int(ident["pid"])).create_time() - float(ident["create_time"])) > 1.0
        )
    except psutil.NoSuchProcess:
        return True


class StudyDriver:
    """Runs a plan's trials through a runner until the count or the budget says stop.

    Args:
        plan: The prepared plan.
        runner: Where trials run.
        on_event: Called for every :class:`StudyEvent` (progress display, MLflow).
        heartbeat_interval_s: How often running trials' heartbeats are recorded (RDB storage).
        grace_period_s: A RUNNING trial without heartbeat for this long is stale.
        now: Wall clock (a seam for budget tests).
        progress_interval_s: How often running trials' progress files are read (``progress``
            events; a trial on another machine without a shared study folder has none).
    """

    def __init__(
        self,
        plan: StudyPlan,
        runner: Any,
        *,
        on_event: Callable[[StudyEvent], None] | None = None,
        heartbeat_interval_s: int = 30,
        grace_period_s: int = 90,
        now: Callable[[], datetime] = datetime.now,
        progress_interval_s: float = 10.0,
    ) -> None:
        self.plan = plan
        self.progress_interval_s = progress_interval_s
        self._progress_seen: dict[int, Any] = {}
        self._progress_polled = time.monotonic()
        self.runner = runner
        self.on_event = on_event or (lambda _e: None)
        self.now = now
        self.storage = create_storage(
            plan.storage_url,
            heartbeat_interval_s=heartbeat_interval_s,
            grace_period_s=grace_period_s,
        )
        self.heartbeat_interval_s = heartbeat_interval_s
        job = plan.job
        self.study = optuna.create_study(
            study_name=plan.storage_name,
            storage=self.storage,
            sampler=_sampler(job, plan.space, priors=plan.priors.trials),
            directions=[o.direction for o in plan.objectives.objectives],
            load_if_exists=True,
        )
        if not self.study.metric_names:
            self.study.set_metric_names([o.metric for o in plan.objectives.objectives])
        held = len(self.study.get_trials(deepcopy=False))
        if held:
            self.study.sampler = _sampler(
                job, plan.space, resumed_at=held, priors=plan.priors.trials
            )
        self.started_at = now()
        self.deadline: datetime | None = None
        if job.budget:
            self.deadline = self.started_at + parse_budget(job.budget)
        if job.until:
            until = parse_until(job.until, now=self.started_at)
            self.deadline = min(self.deadline, until) if self.deadline else until
        self._stop_requested = False
        self._repeats = 0  # duplicate proposals in a row
        self._cancelled = False
        self._running: dict[int, tuple[Any, optuna.trial.Trial, int]] = {}

    # --- bookkeeping ---------------------------------------------------------------------------

    def _counted(self, trials: list[FrozenTrial]) -> int:
        """Trials that count toward ``job.trials``: told ones and ones in flight."""
        return sum(
            1
            for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.RUNNING)
            or (
                t.state == TrialState.FAIL
                and TrialView(t).status
                in (TrialStatus.INVALID_REPLAY.value, TrialStatus.DUPLICATE.value)
            )
        )

    def remaining(self) -> int | None:
        """Trials still to launch (None: no count limit)."""
        if self.plan.job.trials is None:
            return None
        return max(0, self.plan.job.trials - self._counted(self.study.get_trials(deepcopy=False)))

    def budget_left(self) -> timedelta | None:
        """Time left before launching stops (None: no budget)."""
        if self.deadline is None:
            return None
        return max(self.deadline - self.now(), timedelta(0))

    def request_stop(self) -> None:
        """Stop launching trials; running ones finish."""
        self._stop_requested = True

    def cancel(self) -> None:
        """Stop launching and stop the running trials (their actors and servers).

        Cancelled trials are failed in the storage with status ``cancelled``; what finished is
        kept. Safe to call from another thread while :meth:`run` is looping.
        """
        self._stop_requested = True
        self._cancelled = True
        for handle, _trial, _attempt in list(self._running.values()):
            self.runner.cancel(handle)

    def _may_launch(self) -> bool:
        if self._stop_requested:
            return False
        if self._repeats >= MAX_REPEATS:
            # A small discrete space measured through (or a converged sampler in a conditional
            # space, where repeats are not avoided): each launch would refuse a duplicate at
            # once, and without a trial count the loop would spin until the budget ends.
            self._stop_requested = True
            self.on_event(
                StudyEvent(
                    "exhausted",
                    -1,
                    detail=f"the sampler proposed {MAX_REPEATS} configurations in a row that "
                    "this study had measured (the space is measured through, or the sampler "
                    "has converged): no more trials are launched; widen the space, or resume "
                    "with the random sampler, to go on",
                )
            )
            return False
        sampler = self.study.sampler
        if isinstance(sampler, _GridSampler) and sampler.is_exhausted(self.study):
            return False
        left = self.remaining()
        if left is not None and left <= 0:
            return False
        return not (self.deadline is not None and self.now() >= self.deadline)

    def recover(self) -> list[int]:
        """Fail trials a dead driver left RUNNING and re-enqueue their configurations.

        Same host: the recorded driver pid is dead. Other hosts: Optuna's heartbeat expired.
        Returns the numbers of the trials failed.
        """
        failed = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if _driver_dead(t.system_attrs.get(_DRIVER_ATTR)):
                # A FrozenTrial cannot be written through: the storage is (same attribute).
                self.storage.set_trial_user_attr(t._trial_id, "status", "driver_died")
                self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                failed.append(t.number)
        if isinstance(self.storage, optuna.storages.RDBStorage):
            before = {
                t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
            }
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(self.study)
            after = self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
            failed += [t.number for t in after if t.number not in before]
        trials = self.study.get_trials(deepcopy=False)
        for number in failed:
            lost = trials[number]
            self.on_event(StudyEvent("stale", number, detail="left RUNNING by a dead driver"))
            self._requeue(lost, trials)
        return failed

    def _requeue(self, lost: FrozenTrial, trials: list[FrozenTrial]) -> None:
        alive = [
            t
            for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
        ]
        if is_baseline(lost):
            if not any(is_baseline(t) for t in alive):
                self.study.enqueue_trial(
                    {}, user_attrs={BASELINE_ATTR: True, "retry_of": lost.number}
                )
        elif lost.params:
            self.study.enqueue_trial(lost.params, user_attrs={"retry_of": lost.number})

    def _enqueue_attrs(self, args: dict[str, Any]) -> dict[str, Any]:
        """An enqueued trial's attributes: where it came from when a warm start chose it."""
        for w in self.plan.warm_start:
            if w.args == args:
                return {"enqueued": True, "warm_start_from": f"{w.folder} trial {w.trial}"}
        return {"enqueued": True}

    def _enqueue_on_resume(self, trials: list[FrozenTrial]) -> None:
        """A resumed study runs the job's ``enqueue:`` configurations it does not hold yet.

        One the study already holds (measured, running or waiting) is not run twice; when the
        trial count is already reached, the study says so instead of dropping them silently.
        """

        def key(params: dict[str, Any]) -> str:
            return json.dumps(params, sort_keys=True, default=str)

        held = {key(t.params or t.system_attrs.get("fixed_params") or {}) for t in trials}
        new = []
        for args in self.plan.job.enqueue:
            params = self.plan.space.enqueue_params(args)
            if key(params) not in held:
                held.add(key(params))
                new.append((args, params))
        if not new:
            return
        left = self.remaining()
        if left == 0:
            names = "; ".join(json.dumps(a, sort_keys=True, default=str) for a, _ in new)
            self.on_event(
                StudyEvent(
                    "enqueue_refused",
                    -1,
                    detail=f"the study already holds its {self.plan.job.trials} trials: "
                    f"{names} not run; raise the trial count (--trials) to run them",
                )
            )
            return
        for args, params in new:
            self.study.enqueue_trial(params, user_attrs=self._enqueue_attrs(args))
            number = self.study.get_trials(deepcopy=False)[-1].number
            self.on_event(
                StudyEvent(
                    "enqueued",
                    number,
                    detail=json.dumps(args, sort_keys=True, default=str)
                    + " (from the job's enqueue:, new since the study started)",
                )
            )

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> optuna.Study:
        """Run until the trial count or the budget is reached; returns the Optuna study."""
        self._write_plan()
        self.recover()
        trials = self.study.get_trials(deepcopy=False)
        if not trials:
            self.study.enqueue_trial({}, user_attrs={BASELINE_ATTR: True})
            for args in self.plan.job.enqueue:
                self.study.enqueue_trial(
                    self.plan.space.enqueue_params(args), user_attrs=self._enqueue_attrs(args)
                )
        else:
            self._enqueue_on_resume(trials)
        try:
            self._loop()
        finally:
            for handle, _trial, _attempt in list(self._running.values()):
                self.runner.cancel(handle)
        return self.study

    def _loop(self) -> None:
        last_beat = 0.0
        while True:
            while len(self._running) < self.runner.capacity and self._may_launch():
                self._launch_next()
            if not self._running:
                if not self._may_launch():
                    return
                continue
            futures = {h.future: n for n, (h, _t, _a) in self._running.items()}
            done, _ = concurrent.futures.wait(
                futures,
                timeout=min(5.0, float(self.heartbeat_interval_s)),
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
            if time.monotonic() - last_beat >= self.heartbeat_interval_s / 2:
                self._heartbeat()
                last_beat = time.monotonic()
            for fut in done:
                self._collect(futures[fut], fut)
            self._poll_progress()

    def _poll_progress(self) -> None:
        """A ``progress`` event per running trial whose progress file changed (at most every
        ``progress_interval_s``)."""
        if time.monotonic() - self._progress_polled < self.progress_interval_s:
            return
        self._progress_polled = time.monotonic()
        for number, (handle, _trial, _attempt) in list(self._running.items()):
            spec = getattr(handle, "spec", None)
            doc = read_progress(spec.workdir) if spec is not None else None
            if doc is None or doc.get("updated") == self._progress_seen.get(number):
                continue
            self._progress_seen[number] = doc.get("updated")
            self.on_event(StudyEvent("progress", number, detail=progress_line(doc)))

    def _heartbeat(self) -> None:
        if isinstance(self.storage, optuna.storages.RDBStorage):
            for _h, trial, _a in self._running.values():
                self.storage.record_heartbeat(trial._trial_id)

    def _launch_next(self) -> None:
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for Study.optimize; the driver records
            # them itself (see _heartbeat), which is what ask/tell needs.
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = self.study.ask()
        trial.storage.set_trial_system_attr(trial._trial_id, _DRIVER_ATTR, _driver_identity())
        if isinstance(self.storage, optuna.storages.RDBStorage):
            self.storage.record_heartbeat(trial._trial_id)
        if TrialView(self._frozen(trial.number)).is_baseline:
            args = dict(self.plan.baseline_args)
        else:
            args = {**self.plan.engine.args, **self.plan.space.suggest(trial)}
        args = self.plan.with_acceptance(args)
        encoded = record_engine_args(trial, args)
        twin = self._measured_twin(encoded)
        if twin is not None:
            # A resumed seeded sampler, or an exhausted space: never measure a configuration
            # twice in one study.
            record_status(
                trial,
                TrialStatus.DUPLICATE.value,
                f"trial {twin} measured this configuration",
                duplicate_of=twin,
            )
            self.study.tell(trial, state=TrialState.FAIL)
            self.on_event(StudyEvent("rejected", trial.number, detail=f"duplicate of trial {twin}"))
            self._repeats += 1
            return
        self._repeats = 0
        problems = check_constraints(args, self.plan.context)
        if problems:
            # Never start an engine for an invalid combination; the sampler still learns.
            self._tell_failure(trial, TrialStatus.REJECTED, "; ".join(problems))
            self.on_event(
                StudyEvent(
                    "rejected",
                    trial.number,
                    trial=self._frozen(trial.number),
                    detail="; ".join(problems),
                )
            )
            return
        self._submit(trial, args, attempt=0)

    def _measured_twin(self, encoded_args: str) -> int | None:
        """The number of a trial that already ran these engine arguments (None: none did)."""
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            view = TrialView(t)
            if view.engine_args_key == encoded_args and view.status != TrialStatus.REJECTED.value:
                return t.number
        return None

    def _spec(self, trial: optuna.trial.Trial, args: dict[str, Any], attempt: int) -> TrialSpec:
        spec = self._plain_spec(trial, args, attempt)
        incumbent = self._incumbent_scale()
        if (
            spec.capacity is not None
            and self.plan.job.capacity.racing
            and incumbent is not None
            and not TrialView(self._frozen(trial.number)).is_baseline
        ):
            spec = replace(spec, capacity=replace(spec.capacity, race_at=incumbent))
        return spec

    def _incumbent_scale(self) -> float | None:
        """The study's best capacity so far, as a rate scale (None: no trial carried any)."""
        best = 0.0
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            cap = TrialView(t).capacity
            if cap is not None and not cap.raced_out and TrialView(t).status == "complete":
                best = max(best, cap.estimate_scale)
        return best or None

    def _plain_spec(
        self, trial: optuna.trial.Trial, args: dict[str, Any], attempt: int
    ) -> TrialSpec:
        return self.plan.trial_spec(
            trial.number,
            args,
            workdir=self.plan.out / "trials" / f"{trial.number:04d}" / f"attempt-{attempt}",
            # Fresh prompts per trial and attempt: nothing is served from an earlier cache.
            seed=request_seed(self.plan.job.sampler.seed, trial.number, attempt),
            # The baseline is the reference every gain is read against: it replays the whole
            # trace even when it misses an SLO, so the report compares full measurements.
            early_stop=False if TrialView(self._frozen(trial.number)).is_baseline else None,
        )

    def _submit(self, trial: optuna.trial.Trial, args: dict[str, Any], attempt: int) -> None:
        spec = self._spec(trial, args, attempt)
        handle = self.runner.submit(
            spec, gpus_per_server(args, cpu_build=self.plan.context.cpu_build)
        )
        self._running[trial.number] = (handle, trial, attempt)
        self.on_event(
            StudyEvent(
                "started", trial.number, detail=json.dumps(args, sort_keys=True, default=str)
            )
        )

    def _collect(self, number: int, fut: concurrent.futures.Future[TrialResult]) -> None:
        handle, trial, attempt = self._running.pop(number)
        release = getattr(self.runner, "release", None)
        if release is not None:
            release(handle)
        try:
            result = fut.result()
        except Exception as exc:
            result = TrialResult(
                number=number,
                status=TrialStatus.FAILED,
                message=f"trial runner failed: {type(exc).__name__}: {exc}",
            )
        if self._cancelled and result.status is not TrialStatus.COMPLETE:
            # Stopped by cancel(): not a result the sampler may learn from.
            result = TrialResult(
                number=number,
                status=TrialStatus.CANCELLED,
                message="cancelled: " + result.message,
                log_path=result.log_path,
            )
        if result.status is TrialStatus.INVALID_REPLAY and attempt < self.plan.job.retries:
            self.on_event(StudyEvent("retry", number, result=result, detail=result.message))
            self._submit(trial, TrialView(self._frozen(number)).engine_args, attempt + 1)
            return
        self._tell(trial, result, attempt)
        self.on_event(StudyEvent("finished", number, result=result, trial=self._frozen(number)))

    def _frozen(self, number: int) -> FrozenTrial:
        return self.study.get_trials(deepcopy=False)[number]

    def _tell(self, trial: optuna.trial.Trial, result: TrialResult, attempt: int) -> None:
        record_result(trial, result, attempt)
        objectives = self.plan.objectives
        if result.status is TrialStatus.COMPLETE and (result.capacity or {}).get("raced_out"):
            self._tell_raced_out(trial, result)
        elif result.status is TrialStatus.COMPLETE and result.capacity:
            # A capacity trial: feasible when some scale met every SLO (capacity > 0).
            names = [str(slo) for slo in objectives.slos]
            for name, margin in zip(
                names, capacity_constraints(result.capacity, names), strict=True
            ):
                trial.set_constraint(name, margin)
            if not names:
                trial.set_constraint(_SERVED, -1.0)
            self.study.tell(trial, objectives.values(result.summary))
        elif result.status is TrialStatus.COMPLETE:
            for slo, margin in zip(
                objectives.slos, objectives.constraints(result.summary), strict=True
            ):
                trial.set_constraint(str(slo), margin)
            if not objectives.slos:
                trial.set_constraint(_SERVED, -1.0)
            self.study.tell(trial, objectives.values(result.summary))
        elif result.status in (TrialStatus.INVALID_REPLAY, TrialStatus.CANCELLED):
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            # Failed, or stopped early: a stopped replay's figures cover a partial window whose
            # values depend on when the stop came, so they are kept in the trial's attributes
            # (marked partial) but never told as if comparable with a full replay: worst values,
            # every SLO violated.
            self._tell_failure(trial, result.status, result.message, record=False)

    def _tell_raced_out(self, trial: optuna.trial.Trial, result: TrialResult) -> None:
        """Lost the race and failed one step below too: no capacity was measured, only an
        upper bound. Told as pruned, never as a value: TPE ranks pruned trials after every
        complete one (a loser, as it is) and by their last intermediate value among
        themselves (here the upper bound, single-objective studies only: Optuna keeps no
        intermediate values for several objectives); the GP sampler leaves pruned trials out
        (it cannot fit a censored value); random and grid sampling read nothing."""
        record_status(trial, TrialStatus.RACED_OUT.value, result.message)
        upper = (result.capacity or {}).get("rps_hi")
        if len(self.study.directions) == 1 and isinstance(upper, int | float):
            trial.report(float(upper), step=0)
        self.study.tell(trial, state=TrialState.PRUNED)

    def _tell_failure(
        self, trial: optuna.trial.Trial, status: TrialStatus, message: str, *, record: bool = True
    ) -> None:
        """Failed, infeasible or rejected: complete, worst values, every constraint violated."""
        if record:
            record_status(trial, status.value, message)
        slos = self.plan.objectives.slos
        margins = self.plan.objectives.failed_constraints()
        if slos:
            for slo, margin in zip(slos, margins, strict=True):
                trial.set_constraint(str(slo), margin)
        else:
            # Without SLOs, "feasible" still means "the engine served": one implicit constraint.
            trial.set_constraint(_SERVED, 1.0)
        self.study.tell(trial, self.plan.objectives.worst())

    def _write_plan(self) -> None:
        doc = {
            "study": self.plan.storage_name,
            "storage": portable_url(self.plan.storage_url, self.plan.out),
            "vllm": self.plan.vllm,
            "trace": self.plan.job.trace.path,
            "trace_notes": list(self.plan.trace_notes),
            "requests": len(self.plan.trace),
            "baseline_args": self.plan.baseline_args,
            "engine_args": dict(self.plan.engine.args),
            "objectives": [f"{o.direction}:{o.metric}" for o in self.plan.objectives.objectives],
            "slos": [str(s) for s in self.plan.objectives.slos],
            "driver": _driver_identity(),
            "hardware": hardware_line(self.plan.context.cpu_build),
            # What served the trials, for `regress` after an upgrade (optimizer.engine.stack).
            "environment": installed_stack(
                self.plan.job.engine.python, cpu_build=self.plan.context.cpu_build
            ),
            "job": _portable_job(self.plan),
            "warm_start": [w.to_dict() for w in self.plan.warm_start],
            "warm_start_priors": self.plan.priors.to_dict(),
            "started_at": self.started_at.isoformat(timespec="seconds"),
        }
        (self.plan.out / "plan.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
