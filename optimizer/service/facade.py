"""The service facade: everything the HTTP API does, without HTTP (submit, list, show, cancel,
export), on top of the store, the scheduler and the study hosts.

A submission is a job file (the same schema as ``tune`` reads) inside an optional envelope
that adds a time window (``not_before``, ``until``) and an uploaded trace. :class:`JobService`
checks it (the job's own validation, trace and search-space files only under the configured
roots whatever their names, a model under the model roots or, where the operator allows, a hub
name, a trace of at most the operator's rows, the service's policy from
:mod:`optimizer.service.security`; these checks are :mod:`optimizer.service.admission`'s, run
on a body in a check process where the service has them: :mod:`.check_workers`),
records it in the :class:`~optimizer.service.store.JobStore` and answers every read from the
store and the study's Optuna storage. Exports go through the same use case as the CLI
(:mod:`optimizer.export.workflow`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy as sa
from optuna.trial import FrozenTrial, TrialState

from optimizer.config import JobConfig
from optimizer.errors import ConfigError, NotFound, SubmissionRefused
from optimizer.quality.stage import quality_notes
from optimizer.service import security
from optimizer.service.admission import Admission, Admitted, Upload, prepare_check
from optimizer.service.auth import DEFAULT_TEAM, Principal
from optimizer.service.check_workers import CheckWorkers
from optimizer.service.liveness import StoreLiveness
from optimizer.service.scheduler import Scheduler
from optimizer.service.security import is_secret, redact_job
from optimizer.service.settings import ServiceSettings
from optimizer.service.store import (
    FINAL_STATES,
    OWNER_ATTR,
    JobRecord,
    JobStore,
    belongs_to,
    study_name_for,
)
from optimizer.service.submissions import Body, CheckSlots, Submission
from optimizer.service.validations import Validation, ValidationQueue
from optimizer.trial_view import TrialView, metric_names, refused_trials

__all__ = ["ExportResult", "JobService", "Upload", "Validator"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """An export as a download.

    Attributes:
        text: The file.
        filename: Suggested file name.
        trial: The trial exported.
        gain: What the header says about the measured gain.
    """

    text: str
    filename: str
    trial: int
    gain: str


#: (record, study, choice, runs, force) -> (gain text, reasons to refuse); a forced gain text
#: says what it overrode. The service default re-runs both on the cluster; tests pass a fake.
Validator = Callable[[JobRecord, optuna.Study, Any, int, bool], tuple[str, list[str]]]


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def _timestamp(key: str, when: datetime | None) -> float | None:
    """A submission's time as a timestamp that :func:`_iso` can show again.

    Raises:
        ConfigError: A time the platform cannot represent (year 1 or 9999 near the edges of
            the local time zone): stored, it would break every later listing.
    """
    if when is None:
        return None
    try:
        ts = when.timestamp()
        _iso(ts)
    except (ValueError, OverflowError, OSError) as exc:
        raise ConfigError(f"{key}: {when.isoformat()} is out of range ({exc})") from exc
    return ts


def _num(v: Any) -> Any:
    """JSON-safe numbers: NaN and infinities become None."""
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


class JobService(Admission):
    """Everything the HTTP API does, without HTTP: submit, list, show, cancel, export.

    Args:
        settings: Service settings.
        store: The job store.
        scheduler: The scheduler (its launcher runs the drivers).
        check_plan: Called with a submitted job and its base folder before it is queued
            (default: :func:`~optimizer.study.prepare` without the flag check, so a bad trace,
            space or SLO is refused at once); raise ConfigError to refuse.
        validator: Re-validation for exports with ``validate=true``.
        clock: Epoch seconds.
        validation_workers: Re-validations running at once, all teams together (one of a
            team at a time: :class:`~optimizer.service.validations.ValidationQueue`).
        check_processes: Processes that check submitted bodies (:meth:`submit_body`:
            :class:`~optimizer.service.check_workers.CheckWorkers`, started now; ``check_plan``
            must then be picklable); 0: they are checked in the calling thread.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        store: JobStore,
        scheduler: Scheduler,
        *,
        check_plan: Callable[[JobConfig, Path], None] | None = None,
        validator: Validator | None = None,
        clock: Callable[[], float] = time.time,
        validation_workers: int = 2,
        check_processes: int = 0,
    ) -> None:
        super().__init__(settings, check_plan if check_plan is not None else prepare_check)
        self.store = store
        self.scheduler = scheduler
        self.validator = validator if validator is not None else _cluster_validator
        self.clock = clock
        self._storages: dict[str, optuna.storages.BaseStorage] = {}
        self._storage_lock = threading.Lock()
        self.validations = ValidationQueue(
            self._run_validation, workers=validation_workers, clock=clock
        )
        self.checks = CheckSlots(settings.max_plan_checks, settings.max_plan_checks_per_team)
        self.check_workers = (
            CheckWorkers(settings, self.check_plan, check_processes) if check_processes else None
        )
        # the store's liveness for /healthz (the replica starts its thread: no I/O per probe)
        self.liveness = StoreLiveness(self._ping_store)

    # --- submit --------------------------------------------------------------------------------

    def submit(
        self,
        sub: Submission,
        *,
        upload: Upload | None = None,
        owner: Principal | None = None,
    ) -> tuple[JobRecord, list[str]]:
        """Check a submission and queue it (checked in the calling thread).

        Args:
            sub: The submission.
            upload: A trace uploaded as a file part: (file name, bytes or a binary file).
            owner: Who submits (its team owns the study; None: the default team).

        Returns:
            The queued job and notes on what the service changed in it.

        Raises:
            ConfigError: An invalid job (the message names the key and the fix).
            SubmissionRefused: A file outside the allowed roots, or an oversize upload; (429)
                too many submissions of the team, or of all teams, being checked already
                (:class:`~optimizer.service.submissions.CheckSlots`).
        """
        return self._checked(owner, lambda job_id, team: self.admit(job_id, team, sub, upload))

    def submit_body(
        self, body: Body, owner: Principal | None = None
    ) -> tuple[JobRecord, list[str]]:
        """:meth:`submit` on a body as the API received it: parsed and checked in a check
        process where the service has them (``check_processes``), the caller waiting without
        work of its own; then queued here.

        Raises:
            ConfigError: Not a submission, or an invalid job.
            SubmissionRefused: As :meth:`submit`; (400, 413) a malformed or oversize
                multipart part; (503) the check process died.
        """
        workers = self.check_workers

        def check(job_id: str, team: str) -> Admitted:
            if workers is not None:
                return workers.admit(job_id, team, body)
            return self.admit_body(job_id, team, body)

        return self._checked(owner, check)

    def _checked(
        self, owner: Principal | None, check: Callable[[str, str], Admitted]
    ) -> tuple[JobRecord, list[str]]:
        """``check`` (job id, team) run in one of the team's check slots, then the job queued;
        a refused job leaves nothing behind (its upload folder removed)."""
        job_id = uuid.uuid4().hex[:12]
        team = owner.team if owner is not None else DEFAULT_TEAM
        with self.checks.hold(team):
            try:
                admitted = check(job_id, team)
                return self._queue(job_id, team, admitted), admitted.notes
            except BaseException:
                shutil.rmtree(self.upload_dir(job_id), ignore_errors=True)
                raise

    def close(self) -> None:
        """Stop the check processes and the liveness thread (the replica is going away)."""
        self.liveness.stop()
        if self.check_workers is not None:
            self.check_workers.close()

    def _queue(self, job_id: str, team: str, admitted: Admitted) -> JobRecord:
        """The admitted job recorded and queued (the scheduler woken)."""
        now = self.clock()
        rec = JobRecord(
            id=job_id,
            seq=0,
            name=admitted.name,
            state="queued",
            job=admitted.job,
            base=admitted.base,
            storage_url=admitted.storage_url,
            out=admitted.out,
            submitted_at=now,
            not_before=_timestamp("not_before", admitted.not_before),
            until=_timestamp("until", admitted.until),
            owner=team,
            # Never the job's name: another team's job of that name in a shared storage
            # would be the same study.
            study_name=study_name_for(team, job_id),
        )
        if rec.until is not None and rec.until <= now:
            raise ConfigError("until: the time window has already closed; give a later time")
        # `vllm-autotune export` on this folder applies the service's policy too
        security.mark_service_study(Path(rec.out), job_id)
        rec = self.store.add(rec)
        self.scheduler.wake()
        return rec

    # --- reads ---------------------------------------------------------------------------------

    def get(self, job_id: str, who: Principal | None = None) -> JobRecord:
        """One job, if ``who`` may see it (None: anyone, the service itself).

        Raises:
            NotFound: No such job, or another team's (the same answer: no id is confirmed).
        """
        rec = self.store.get(job_id)
        if who is not None and not who.may_see(rec.owner):
            raise NotFound(f"no study {job_id!r}")
        return rec

    def summary(self, rec: JobRecord) -> dict[str, Any]:
        """The short form of a job (lists)."""
        state = rec.state
        if state == "running" and rec.cancel_requested:
            state = "cancelling"
        return {
            "id": rec.id,
            "name": rec.name,
            "owner": rec.owner,
            "state": state,
            "submitted_at": _iso(rec.submitted_at),
            "not_before": _iso(rec.not_before),
            "until": _iso(rec.until),
            "started_at": _iso(rec.started_at),
            "finished_at": _iso(rec.finished_at),
            "driver_starts": rec.driver_starts,
            "message": rec.message,
            "trials": rec.job.get("trials"),
            "progress": rec.progress,
        }

    def list_summaries(self, who: Principal | None = None) -> list[dict[str, Any]]:
        """Every job ``who`` may see (None or an admin: all), in submission order, short form."""
        owner = None if who is None or who.admin else who.team
        return [self.summary(r) for r in self.store.records(owner=owner)]

    def _storage(self, url: str) -> optuna.storages.BaseStorage:
        from optimizer.study import create_storage

        with self._storage_lock:
            if url not in self._storages:
                self._storages[url] = create_storage(url)
            return self._storages[url]

    def study(self, rec: JobRecord) -> optuna.Study | None:
        """The job's Optuna study, or None before its driver created it.

        The study is the one named :attr:`JobRecord.study_name` and marked as this job's
        (:func:`~optimizer.service.store.belongs_to`): never another team's of the same name.
        The API never opens a storage its driver may still be initializing: two processes
        creating Optuna's schema at once make one of them fail. A storage is read once a
        driver has reported running (``storage_ready``), or when the job has ended.
        """
        url = rec.storage_url
        if url.startswith("sqlite:///") and not Path(url[len("sqlite:///") :]).exists():
            return None
        ready = bool(rec.progress.get("storage_ready"))
        if not ready and not (rec.state in FINAL_STATES and rec.started_at is not None):
            return None
        try:
            study = optuna.load_study(study_name=rec.study_name, storage=self._storage(url))
        except KeyError:
            return None
        except Exception:
            if ready:
                raise
            return None  # a job that failed while creating its storage
        mark = study.user_attrs.get(OWNER_ATTR)
        if not belongs_to(mark, team=rec.owner, job_id=rec.id, storage_url=url, out=rec.out):
            # Never another job's study, whatever the storage holds under this name.
            log.warning("job %s: the study %r in its storage is not its own", rec.id, rec.name)
            return None
        return study

    def detail(self, job_id: str, who: Principal | None = None) -> dict[str, Any]:
        """Status, progress, budget, trials and the front with the baseline and gains."""
        from optimizer.report import front_rows, study_status

        rec = self.get(job_id, who)
        doc = self.summary(rec)
        doc["job"] = redact_job(rec.job)
        study = self.study(rec)
        total = rec.job.get("trials")
        progress: dict[str, Any] = {
            "trials_total": total,
            "remaining": rec.progress.get("remaining", total),
            "budget_left_s": rec.progress.get("budget_left_s"),
            "last_event": rec.progress.get("last_event", ""),
        }
        doc["progress"] = progress
        doc["objectives"] = []
        doc["trials_detail"] = []
        doc["baseline"] = None
        doc["front"] = []
        if study is None:
            return doc
        names = metric_names(study)
        doc["objectives"] = [
            {"metric": n, "direction": d.name.lower()}
            for n, d in zip(names, study.directions, strict=False)
        ]
        st = study_status(study)
        progress.update(
            done=st.done,
            running=st.running,
            failed=st.failed,
            infeasible=st.infeasible,
            front_size=st.front_size,
            best=st.best,
            by_status=st.by_status,
        )
        if rec.state in FINAL_STATES:
            progress["remaining"] = 0
        elif total is not None and "remaining" not in rec.progress:
            progress["remaining"] = max(0, int(total) - st.done - st.running)
        doc["trials_detail"] = [
            self._trial_short(t, names) for t in study.get_trials(deepcopy=False)
        ]
        for row in front_rows(study):
            item = {
                "number": row.number,
                "values": {n: _num(v) for n, v in zip(names, row.values, strict=False)},
                "gains_pct": {n: _num(g) for n, g in zip(names, row.gains_pct, strict=False)},
                "changed": row.changed,
                "feasible": row.feasible,
            }
            if row.baseline:
                doc["baseline"] = item
            else:
                doc["front"].append(item)
        return doc

    @staticmethod
    def _trial_short(t: FrozenTrial, names: list[str]) -> dict[str, Any]:
        view = TrialView(t)
        return {
            "number": t.number,
            "state": t.state.name.lower(),
            "status": view.status,
            "baseline": view.is_baseline,
            "values": (
                {n: _num(v) for n, v in zip(names, t.values, strict=False)} if t.values else None
            ),
            "feasible": view.feasible if t.state == TrialState.COMPLETE else None,
            "failure_class": view.failure_class or None,
            "retry_of": view.retry_of,
        }

    def trial(self, job_id: str, number: int, who: Principal | None = None) -> dict[str, Any]:
        """One trial in full: engine args, summary, memory, constraints, message.

        Raises:
            NotFound: No such job or trial (or another team's).
        """
        rec = self.get(job_id, who)
        study = self.study(rec)
        trials = study.get_trials(deepcopy=False) if study is not None else []
        if not 0 <= number < len(trials):
            raise NotFound(f"study {job_id!r} has no trial {number}")
        t = trials[number]
        names = metric_names(study) if study is not None else []
        doc = self._trial_short(t, names)
        view = TrialView(t)
        attrs = {
            k: v
            for k, v in view.attributes().items()
            if k not in ("engine_args", "log_path") and not is_secret(k)
        }
        doc.update(
            engine_args=view.engine_args,
            params=t.params,
            constraints={k: _num(v) for k, v in t.constraints.items()},
            started_at=t.datetime_start.isoformat() if t.datetime_start else None,
            finished_at=t.datetime_complete.isoformat() if t.datetime_complete else None,
            attrs=json.loads(json.dumps(attrs, default=str)),
        )
        return doc

    # --- actions -------------------------------------------------------------------------------

    def cancel(self, job_id: str, who: Principal | None = None) -> dict[str, Any]:
        """Cancel a job (see :meth:`Scheduler.cancel`); returns its short form."""
        self.get(job_id, who)
        return self.summary(self.scheduler.cancel(job_id))

    def export(
        self,
        job_id: str,
        fmt: str,
        policy: str = "max-throughput",
        *,
        trial: int | None = None,
        weights: Mapping[str, float] | None = None,
        validate: bool = False,
        runs: int = 3,
        force: bool = False,
        who: Principal | None = None,
    ) -> ExportResult:
        """The chosen configuration rendered for ``fmt``. With ``validate``, re-validated
        here, blocking (the HTTP API queues it instead: :meth:`request_validation`).

        Raises:
            NotFound: No such job.
            ConfigError: Unknown format or policy, or nothing exportable.
            SubmissionRefused: (409) The study has no measured trial yet, or re-validation
                refused the export.
        """
        rec = self.get(job_id, who)
        return self._export(
            rec, fmt, policy, trial, dict(weights or {}), validate=validate, runs=runs, force=force
        )

    def _choice(
        self, rec: JobRecord, policy: str, trial: int | None, weights: Mapping[str, float]
    ) -> tuple[optuna.Study, dict[str, Any], Any]:
        """(study, saved plan, choice) of an export, refused now if it would be refused."""
        from optimizer import export as ex

        study = self.study(rec)
        plan_file = Path(rec.out) / "plan.json"
        if study is None or not plan_file.exists():
            raise SubmissionRefused(
                f"study {rec.id} has not started: nothing to export", status=409
            )
        saved = json.loads(plan_file.read_text())
        choice = ex.choose(study, policy, trial_number=trial, weights=weights)
        # What the service would refuse is not exported, nor re-run (a study stored before the
        # allow-list, or a trial whose arguments were changed since).
        _check_stored_job(rec.job)
        security.check_engine_args(
            choice.chosen.engine_args, f"trial {choice.chosen.number}'s engine arguments"
        )
        return study, saved, choice

    @staticmethod
    def _validatable(choice: Any) -> None:
        if choice.baseline is None:
            raise SubmissionRefused("the study has no baseline to validate against", status=409)
        security.check_engine_args(choice.baseline.engine_args, "the baseline's engine arguments")

    def _export(
        self,
        rec: JobRecord,
        fmt: str,
        policy: str,
        trial: int | None,
        weights: Mapping[str, float],
        *,
        validate: bool,
        runs: int,
        force: bool,
    ) -> ExportResult:
        from optimizer import export as ex

        study, saved, choice = self._choice(rec, policy, trial, weights)
        refused = {t.number for t in refused_trials(study)}
        if choice.chosen.number in refused and not force:
            raise SubmissionRefused(
                f"refusing to export: trial {choice.chosen.number} was refused by the quality "
                "gate (force=true exports anyway)",
                status=409,
            )
        if validate:
            self._validatable(choice)
            gain, problems = self.validator(rec, study, choice, runs, force)
            if problems and not force:
                raise SubmissionRefused(
                    "refusing to export: " + "; ".join(problems) + " (force=true exports anyway)",
                    status=409,
                )
        else:
            gain = ex.unvalidated_gain(study, choice)
        ctx = ex.context(saved, choice, gain, job=rec.job, study_name=rec.name)
        notes = quality_notes(study, choice.chosen.number)
        text = ex.render(fmt, dataclasses.replace(ctx, notes=(*ctx.notes, *notes)))
        exports = list(study.user_attrs.get("exports", []))
        exports.append(
            {
                "trial": choice.chosen.number,
                "format": fmt,
                "policy": choice.policy,
                "via": "service",
                "gain": gain,
            }
        )
        study.set_user_attr("exports", exports)
        return ExportResult(
            text=text, filename=ex.default_filename(fmt), trial=choice.chosen.number, gain=gain
        )

    # --- validations: exports re-measured off the request path ----------------------------------

    def request_validation(
        self,
        job_id: str,
        fmt: str,
        policy: str = "max-throughput",
        *,
        trial: int | None = None,
        weights: Mapping[str, float] | None = None,
        runs: int = 3,
        force: bool = False,
        who: Principal | None = None,
    ) -> dict[str, Any]:
        """Queue a re-validated export (:mod:`optimizer.service.validations`); returns its
        status at once (poll :meth:`validation`, then download :meth:`validation_export`).
        What would refuse the export (no study yet, no baseline, a flag the service does
        not accept) refuses it now.

        Raises:
            NotFound: No such job (or another team's).
            ConfigError: Nothing exportable by this policy.
            SubmissionRefused: (409) Not exportable; (429) the team's queue is full.
        """
        rec = self.get(job_id, who)
        chosen_weights = dict(weights or {})
        _study, _saved, choice = self._choice(rec, policy, trial, chosen_weights)
        self._validatable(choice)
        request = {
            "fmt": fmt,
            "policy": policy,
            "trial": trial,
            "weights": chosen_weights,
            "runs": runs,
            "force": force,
        }
        team = who.team if who is not None else rec.owner
        return self._validation_doc(self.validations.submit(rec.id, team, request))

    def _run_validation(self, item: Validation) -> ExportResult:
        """The body of a queued validation (in its own thread)."""
        req = item.request
        return self._export(
            self.store.get(item.job_id),
            req["fmt"],
            req["policy"],
            req["trial"],
            req["weights"],
            validate=True,
            runs=req["runs"],
            force=req["force"],
        )

    def validation(
        self, job_id: str, validation_id: str, who: Principal | None = None
    ) -> dict[str, Any]:
        """A validation's state (and, once done, the export's trial and gain).

        Raises:
            NotFound: No such job or validation (or another team's).
        """
        self.get(job_id, who)
        return self._validation_doc(self.validations.get(validation_id, job_id))

    def validation_export(
        self, job_id: str, validation_id: str, who: Principal | None = None
    ) -> ExportResult:
        """The export of a validation that is done.

        Raises:
            NotFound: No such job or validation (or another team's).
            SubmissionRefused: (409) Not done yet (poll it), refused or failed (its reason).
        """
        self.get(job_id, who)
        item = self.validations.get(validation_id, job_id)
        if item.state == "done":
            result: ExportResult = item.result
            return result
        if item.state in ("queued", "running"):
            raise SubmissionRefused(
                f"validation {validation_id} is {item.state}: poll "
                f"/v1/studies/{job_id}/validations/{validation_id} until it is done",
                status=409,
            )
        raise SubmissionRefused(
            f"validation {validation_id} {item.state}: {item.message}", status=409
        )

    @staticmethod
    def _validation_doc(item: Validation) -> dict[str, Any]:
        url = f"/v1/studies/{item.job_id}/validations/{item.id}"
        doc: dict[str, Any] = {
            "id": item.id,
            "study": item.job_id,
            "state": item.state,
            "format": item.request["fmt"],
            "policy": item.request["policy"],
            "runs": item.request["runs"],
            "submitted_at": _iso(item.submitted_at),
            "started_at": _iso(item.started_at),
            "finished_at": _iso(item.finished_at),
            "message": item.message,
            "poll": url,
            "download": f"{url}/export" if item.state == "done" else None,
        }
        if item.result is not None:
            doc.update(trial=item.result.trial, gain=item.result.gain)
        return doc

    def _ping_store(self) -> None:
        with self.store.engine.connect() as conn:
            conn.execute(sa.select(1))

    def health(self) -> dict[str, Any]:
        """Liveness of the store and the scheduler (the store's as :attr:`liveness` last saw
        it, no I/O, while its thread runs; else asked now)."""
        db_ok = self.liveness.ok()
        age = self.liveness.age_s()
        return {
            "ok": db_ok,
            "database": db_ok,
            "database_age_s": None if age is None else round(age, 2),
            "scheduler": self.scheduler.alive,
            "last_tick": _iso(self.scheduler.last_tick),
        }


def _check_stored_job(job: Mapping[str, Any]) -> None:
    """A stored job's engine flags and environment against the service's allow-lists."""
    security.check_stored_study(job)


def _cluster_validator(
    rec: JobRecord, study: optuna.Study, choice: Any, runs: int, force: bool
) -> tuple[str, list[str]]:
    """Re-run the choice and the baseline on the cluster (blocking), by the export use case
    the CLI uses (:func:`optimizer.export.revalidate_job`, :func:`optimizer.export.verdict`)."""
    from optimizer import export as ex
    from optimizer.runners import RayRunner

    val = ex.revalidate_job(
        rec.job,
        Path(rec.base),
        study,
        choice,
        lambda _plan: RayRunner(capacity=1),
        label="service",
        runs=runs,
    )
    return ex.verdict(val, choice.policy, force=force)
