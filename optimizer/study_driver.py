"""The study's driver: an Optuna ask/tell loop over vLLM engine configurations.

:func:`~optimizer.study.prepare` turns a job into a plan (shaped trace, search space, objectives,
baseline, every flag checked against the installed vLLM) before anything starts.
``StudyDriver.run`` then asks Optuna for configurations (the job's sampler:
:mod:`optimizer.study_sampler`), rejects invalid combinations before any engine starts, hands the
rest to a :class:`~optimizer.runners.TrialRunner`, and tells Optuna the outcome:

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
import json
import logging
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import optuna
import psutil
from optuna.trial import FrozenTrial, TrialState

from optimizer.capacity.trial import capacity_constraints
from optimizer.config import parse_budget, parse_until
from optimizer.engine.stack import hardware_line, installed_stack
from optimizer.errors import ConfigError, TrialNodeLost
from optimizer.study import StudyPlan, create_storage
from optimizer.study_folder import portable_url
from optimizer.study_sampler import StudyGridSampler, job_sampler
from optimizer.trial_io import progress_line, read_progress
from optimizer.trial_view import (
    BASELINE_ATTR,
    TrialView,
    gpus_per_server,
    record_engine_args,
    record_result,
    record_status,
)
from optimizer.types import TrialResult, TrialSpec, TrialStatus
from search_spaces import check_constraints

log = logging.getLogger(__name__)

__all__ = [
    "MAX_REPEATS",
    "StudyDriver",
    "StudyEvent",
    "is_baseline",
    "request_seed",
]

_DRIVER_ATTR = "driver"
# Without SLOs, the one constraint every told trial carries: the engine served (<= 0) or not.
_SERVED = "engine_served"
#: How many times a trial whose Ray node died under it runs once more (issue 45).
NODE_LOST_RERUNS = 1
#: How long a new trial waits for a lower-numbered running trial's engine arguments to be
#: recorded before it decides whether it repeats them.
_TWIN_WAIT_S = 2.0


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


MAX_REPEATS = 20
"""Duplicate proposals in a row after which a study stops launching (its space is measured
through)."""


def request_seed(study_seed: int | None, number: int, attempt: int) -> int:
    """The prompts' seed of a trial's attempt: fresh per trial and attempt, and per study seed,
    so that repeats of one job (``--seed N``) replay their baselines (trial 0) and every other
    trial number with other requests. Seed 0 (and None) keep the numbering of earlier studies."""
    return abs(study_seed or 0) * 10_000_000 + number * 1000 + attempt + 1


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
        proc = psutil.Process(int(ident["pid"]))
        if abs(proc.create_time() - float(ident["create_time"])) > 1.0:
            return True  # the pid was reused
        # A driver killed with its Ray node can stay a zombie where nothing reaps orphans
        # (a container whose init does not): it has exited, its trials are left.
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _portable_job(plan: StudyPlan) -> dict[str, Any]:
    """The job as ``plan.json`` keeps it: the study folder as ``.`` and the default storage
    unset, both read against the folder the study is in now (:mod:`optimizer.study_folder`)."""
    doc = plan.job.model_dump(mode="json")
    doc["out"] = "."
    if doc.get("storage") and portable_url(str(doc["storage"]), plan.out) == "study.db":
        doc["storage"] = None  # the default, SQLite in the study folder: read against it
    return doc


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
        self.grace_period_s = grace_period_s
        #: The trials this driver asked, by number (their storage ids): those not finished
        #: get heartbeats (:meth:`_beat`).
        self._asked: dict[int, int] = {}
        job = plan.job
        self.study = optuna.create_study(
            study_name=plan.storage_name,
            storage=self.storage,
            sampler=job_sampler(job, plan.space, priors=plan.priors.trials),
            directions=[o.direction for o in plan.objectives.objectives],
            load_if_exists=True,
        )
        if not self.study.metric_names:
            self.study.set_metric_names([o.metric for o in plan.objectives.objectives])
        held = len(self.study.get_trials(deepcopy=False))
        if held:
            self.study.sampler = job_sampler(
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
                in (
                    TrialStatus.INVALID_REPLAY.value,
                    TrialStatus.DUPLICATE.value,
                    TrialStatus.LOST.value,  # a failing cluster must not loop forever
                )
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
        if isinstance(sampler, StudyGridSampler) and sampler.is_exhausted(self.study):
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
        stop = threading.Event()
        beats = threading.Thread(target=self._beat, args=(stop,), name="heartbeat", daemon=True)
        beats.start()
        try:
            self._loop()
        finally:
            stop.set()
            beats.join(timeout=10)
            for handle, _trial, _attempt in list(self._running.values()):
                self.runner.cancel(handle)
        return self.study

    def _beat(self, stop: threading.Event) -> None:
        """Record the running trials' heartbeats every half interval, apart from the loop (as
        Optuna's ``optimize`` does): a loop busy for a while (a sampler's fit, a slow
        submission, a storage lock) never lets a live driver's trials look dead to another
        driver's :meth:`recover`."""
        while not stop.wait(self.heartbeat_interval_s / 2):
            try:
                self._heartbeat()
            except Exception as exc:  # the storage unreachable for a moment: the next beat
                log.warning("heartbeat not recorded: %s", exc)

    def _loop(self) -> None:
        last_recovered = time.monotonic()  # run() recovered just before
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
            if time.monotonic() - last_recovered >= self.grace_period_s / 2:
                # Another driver that died while this one runs (its node lost, or its host)
                # leaves trials RUNNING whose heartbeat expires only after this one started:
                # failed and re-enqueued here, not at some later start.
                self.recover()
                last_recovered = time.monotonic()
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
        """A heartbeat for each trial this driver asked that is not finished yet (running, or
        between its ask and its submission)."""
        if isinstance(self.storage, optuna.storages.RDBStorage):
            running = {
                t._trial_id
                for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            }
            for number, trial_id in list(self._asked.items()):
                if trial_id in running:
                    self.storage.record_heartbeat(trial_id)
                else:  # finished: no more heartbeats
                    self._asked.pop(number, None)

    def _launch_next(self) -> None:
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for Study.optimize; the driver records
            # them itself (see _heartbeat), which is what ask/tell needs.
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = self.study.ask()
        self._asked[trial.number] = trial._trial_id
        trial.storage.set_trial_system_attr(trial._trial_id, _DRIVER_ATTR, _driver_identity())
        if isinstance(self.storage, optuna.storages.RDBStorage):
            self.storage.record_heartbeat(trial._trial_id)
        if TrialView(self._frozen(trial.number)).is_baseline:
            args = dict(self.plan.baseline_args)
        else:
            args = {**self.plan.engine.args, **self.plan.space.suggest(trial)}
        args = self.plan.with_acceptance(args)
        encoded = record_engine_args(trial, args)
        twin = self._measured_twin(encoded, trial.number)
        if twin is not None:
            # A resumed seeded sampler, or an exhausted space: never measure a configuration
            # twice in one study.
            record_status(
                trial,
                TrialStatus.DUPLICATE.value,
                f"trial {twin} measured (or is measuring) this configuration",
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

    def _measured_twin(self, encoded_args: str, number: int) -> int | None:
        """The number of a trial that ran these engine arguments, or runs them now with a
        lower number than trial ``number`` (None: none). The running ones are there for
        several drivers of one study (or parallel trials): two that launch one configuration
        at once (both drivers' baselines of a new study, or one seed's proposals) measure it
        once, in the trial numbered first."""
        states = (TrialState.COMPLETE, TrialState.RUNNING)
        deadline = time.monotonic() + _TWIN_WAIT_S
        while True:
            trials = self.study.get_trials(deepcopy=False, states=states)
            # A lower-numbered trial another driver has just asked for records its engine
            # arguments a moment later: wait for them (at most _TWIN_WAIT_S).
            unread = [
                t
                for t in trials
                if t.state == TrialState.RUNNING
                and t.number < number
                and TrialView(t).engine_args_key is None
            ]
            if not unread or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for t in trials:
            view = TrialView(t)
            if t.state == TrialState.RUNNING and t.number >= number:
                continue
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
        except TrialNodeLost as exc:
            self._node_lost(trial, number, attempt, exc)
            return
        except ConfigError as exc:
            # The node cannot run it (a path it cannot see, ...): the cluster's setup, not the
            # configuration's result. Told as not run, never learned from; the study stops.
            self._tell(
                trial,
                TrialResult(number=number, status=TrialStatus.CANCELLED, message=f"not run: {exc}"),
                attempt,
            )
            raise
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

    def _node_lost(
        self, trial: optuna.trial.Trial, number: int, attempt: int, exc: TrialNodeLost
    ) -> None:
        """A trial whose Ray node died under it: run once more (on a node that is alive, as
        Ray places it) unless the study is cancelling; lost again, told as failed (``lost``),
        which no sampler learns from. Each loss is kept on the trial (``nodes_lost``)."""
        lost = [*self._frozen(number).user_attrs.get("nodes_lost", []), exc.node_id or "?"]
        trial.set_user_attr("nodes_lost", lost)
        if len(lost) <= NODE_LOST_RERUNS and not self._cancelled:
            self.on_event(StudyEvent("retry", number, detail=f"run once more: {exc}"))
            self._submit(trial, TrialView(self._frozen(number)).engine_args, attempt + 1)
            return
        status = TrialStatus.CANCELLED if self._cancelled else TrialStatus.LOST
        result = TrialResult(number=number, status=status, message=str(exc))
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
        elif result.status in (TrialStatus.INVALID_REPLAY, TrialStatus.CANCELLED, TrialStatus.LOST):
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
