"""What the service accepts of a submission, before it is queued: the keys the service decides
(output folder, cluster, storage and MLflow, the vLLM install; engine flags and environment
under the policy of :mod:`optimizer.service.security`), an uploaded trace stored under the job's
upload folder, the trace and a search-space file only under the operator's roots, the model made
in the team's folder, found under a model root or (where allowed) a hub name, the space's flags,
the trace's size, and the plan check (:func:`~optimizer.study.prepare` without starting
anything), whose failures quote none of the trace.

:class:`Admission` holds these checks for :class:`~optimizer.service.facade.JobService`, which
mixes it in, and for the service's check processes
(:mod:`optimizer.service.check_workers`), which run them on a body as received
(:meth:`Admission.admit_body`: parsed, checked, the upload stored) and hand back only what the
job's record needs (:class:`Admitted`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import functools
import gc
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from optimizer.config import JobConfig, load_job
from optimizer.errors import ConfigError, SubmissionRefused, TraceError
from optimizer.service import security
from optimizer.service.settings import ServiceSettings
from optimizer.service.submissions import (
    Body,
    Submission,
    Upload,
    read_body,
    safe_filename,
    save_upload,
)
from optimizer.text import escape_controls
from search_spaces.schema import is_preset_name

__all__ = ["Admission", "Admitted", "Upload", "prepare_check"]

log = logging.getLogger(__name__)

#: Largest search-space file the service reads.
_MAX_SPACE_BYTES = 1024**2


@dataclass(frozen=True)
class Admitted:
    """A submission that passed every check: what its job record is made of (picklable: it
    comes back from a check process).

    Attributes:
        name: The job's name.
        job: The job as loaded and placed (JSON-safe).
        base: The job's base folder.
        storage_url: The study's Optuna storage.
        out: The study's folder.
        not_before: The submission's ``not_before``.
        until: The submission's ``until``.
        notes: What the service changed in the job.
    """

    name: str
    job: dict[str, Any]
    base: str
    storage_url: str
    out: str
    not_before: datetime | None = None
    until: datetime | None = None
    notes: list[str] = field(default_factory=list)


class Admission:
    """The checks a submission passes before :meth:`JobService.submit
    <optimizer.service.facade.JobService.submit>` queues it (a mixin of
    :class:`~optimizer.service.facade.JobService`; on its own, what a check process runs).

    Args:
        settings: The service's settings.
        check_plan: The plan check (see :class:`~optimizer.service.facade.JobService`).
    """

    settings: ServiceSettings
    check_plan: Callable[[JobConfig, Path], None]
    data_dir: Path
    roots: list[Path]
    models_dir: Path
    model_roots: list[Path]

    def __init__(
        self, settings: ServiceSettings, check_plan: Callable[[JobConfig, Path], None]
    ) -> None:
        self.settings = settings
        self.check_plan = check_plan
        self.data_dir = Path(settings.data_dir).resolve()
        self.roots = [Path(r).expanduser().resolve() for r in settings.trace_roots]
        self.models_dir = self.data_dir / "models"  # made models: models_dir/TEAM, its own
        self.model_roots = [Path(r).expanduser().resolve() for r in settings.model_roots]

    def upload_dir(self, job_id: str) -> Path:
        """Where job ``job_id``'s uploaded trace is stored (removed if it is refused)."""
        return self.data_dir / "uploads" / job_id

    def admit_body(self, job_id: str, team: str, body: Body) -> Admitted:
        """:meth:`admit` on a body as the API received it, parsed here (a JSON or YAML body
        at most :data:`~optimizer.service.security.MAX_BODY_BYTES`, a multipart ``job`` part
        too: what parsing a job may cost is bounded)."""
        job_limit = min(self.settings.max_upload_bytes, security.MAX_BODY_BYTES)
        with read_body(body, job_limit) as (sub, upload):
            return self.admit(job_id, team, sub, upload)

    def admit(self, job_id: str, team: str, sub: Submission, upload: Upload | None) -> Admitted:
        """Every check of a submission of ``team`` that will be job ``job_id``: the document's
        limits and text, the upload stored, the keys the service decides, the job loaded, its
        files, space and trace size, the plan check.

        Raises:
            ConfigError: An invalid job (the message names the key and the fix).
            SubmissionRefused: A file outside the allowed roots, or an oversize upload.
        """
        upload_dir = self.upload_dir(job_id)
        security.check_limits(sub.job)  # a Submission built in code, not only parsed bodies
        # One rule for every key and string of the job, before any of it is used or echoed
        # (keys the service replaces, such as out or storage, included).
        security.check_text(sub.job)
        doc = json.loads(json.dumps(sub.job, default=str))
        notes = self._store_upload(doc, sub, upload, upload_dir)
        notes += self._service_owned_keys(doc, job_id, team)
        job, base = load_job(doc, base=self.roots[0] if self.roots else self.data_dir)
        # the model path as given: load_job resolves a relative one that exists beside its base
        job = self._check_files(job, upload_dir, str(doc["model"]["path"]), team)
        self._check_space(job)
        self._check_trace_size(job, upload_dir)
        self._prepare(job, base)
        return Admitted(
            name=job.name,
            job=job.model_dump(mode="json"),
            base=str(base),
            storage_url=job.storage_url(base),
            out=str(job.output_dir(base)),
            not_before=sub.not_before,
            until=sub.until,
            notes=notes,
        )

    def _under_roots(self, path: str | Path, extra: Iterable[Path] = ()) -> bool:
        return security.under(path, [*self.roots, *extra])

    def _store_upload(
        self,
        doc: dict[str, Any],
        sub: Submission,
        upload: Upload | None,
        upload_dir: Path,
    ) -> list[str]:
        """An uploaded trace (multipart part or base64 in the envelope) copied under
        ``upload_dir`` (a short, safe file name; at most the upload limit, in chunks) and
        named in ``doc``'s trace.path."""
        if sub.trace_upload is not None:
            try:
                data = base64.b64decode(sub.trace_upload.content_b64, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ConfigError(f"trace_upload.content_b64: not valid base64 ({exc})") from exc
            upload = (sub.trace_upload.filename, data)
        if upload is None:
            return []
        name, source = upload
        trace = doc.get("trace")
        if not isinstance(trace, dict):
            trace = {}
            doc["trace"] = trace
        upload_dir.mkdir(parents=True, exist_ok=True)
        path = upload_dir / safe_filename(name)
        size = save_upload(source, path, self.settings.max_upload_bytes)
        trace["path"] = str(path)
        return [f"trace: the uploaded file ({size} bytes)"]

    def _service_owned_keys(self, doc: dict[str, Any], job_id: str, team: str) -> list[str]:
        """What the service decides, not the submitter: the output folder, the cluster,
        operator URLs, the vLLM install; engine flags and environment under the policy."""
        notes: list[str] = []
        out = self.data_dir / "studies" / job_id
        if isinstance(doc.get("out"), str):
            given = escape_controls(doc["out"][:200])
            notes.append(f"out: ignored ({given}); the service keeps studies in {out}")
        doc["out"] = str(out)
        if doc.get("ray_address"):
            notes.append("ray_address: ignored; studies run on the service's cluster")
        doc["ray_address"] = None
        notes += self._operator_urls(doc)
        stability = doc.get("stability")
        if isinstance(stability, dict) and stability.get("after_study"):
            stability["after_study"] = False
            notes.append(
                "stability.after_study: ignored; the service runs no stability stage (run "
                "`vllm-autotune stability` on the study folder)"
            )
        quality = doc.get("quality")
        if isinstance(quality, dict) and quality.get("eval_set") is not None:
            # A file of this machine: another team's included.
            raise ConfigError(
                "quality.eval_set: the service reads no eval set from its machine; remove the "
                "key (the gate still compares each configuration with the baseline)"
            )
        if doc.get("warm_start") is not None:
            # Folders of earlier studies: paths of this machine, another team's included.
            raise ConfigError(
                "warm_start: the service does not read earlier study folders; remove the key "
                "(enqueue the configurations to start from under enqueue:)"
            )
        engine = doc.get("engine")
        if isinstance(engine, dict):
            if engine.get("python"):
                raise ConfigError(
                    "engine.python: the service runs servers with its own vLLM; remove the key"
                )
            if engine.get("cpus") is not None:
                # Cores of the operator's machines: placement is the operator's (its runner).
                raise ConfigError(
                    "engine.cpus: the service places servers on its own cores; remove the key"
                )
            # Not mappings: the job loader below says so (iterating them here would be a 500).
            if isinstance(engine.get("env"), dict):
                security.check_env(engine["env"])
            for key in ("args", "baseline_args"):
                if isinstance(engine.get(key), dict):
                    security.check_engine_args(engine[key], f"engine.{key}")
        model = doc.get("model")
        path = model.get("path") if isinstance(model, dict) and model.get("make") else None
        if isinstance(model, dict) and isinstance(path, str) and not path.startswith(("/", "~")):
            model["path"] = str(self.models_dir / team / path)  # a relative target: the team's
        return notes

    def _check_files(self, job: JobConfig, upload_dir: Path, model: str, team: str) -> JobConfig:
        """The model (``model``: its path as submitted), the trace and a search-space file only
        where the operator allows (each path resolved and checked before anything is read: an
        answer never says whether a file outside the roots exists); returns the job with its
        model placed."""
        job = self._place_model(job, model, team)
        trace_path = Path(job.trace.path)
        if not self._under_roots(trace_path, [upload_dir]):
            raise SubmissionRefused(
                f"trace.path {job.trace.path}: outside the service's trace roots ("
                + (", ".join(str(r) for r in self.roots) or "none configured")
                + "): upload the trace with the request (trace_upload, or a multipart `trace` "
                "part) or ask the operator to add a --trace-root",
                status=403,
            )
        space = job.search_space
        if isinstance(space, str) and not is_preset_name(space) and not self._under_roots(space):
            raise SubmissionRefused(
                f"search_space {space[:300]}: a file outside the service's trace roots (any "
                "name that is not a preset is a file); inline the space in the job or use a "
                "preset name",
                status=403,
            )
        return job

    def _operator_urls(self, doc: dict[str, Any]) -> list[str]:
        """Storage and MLflow are the operator's: a job's own URLs are replaced (with a note)."""
        notes: list[str] = []
        if doc.get("storage"):
            notes.append("storage: ignored; the service keeps every study in its own storage")
        doc.pop("storage", None)
        if self.settings.study_storage:
            doc["storage"] = self.settings.study_storage
        ml = doc.get("mlflow")
        if ml is None and self.settings.mlflow_uri:
            ml = doc["mlflow"] = {}  # the operator's store, whether or not the job has mlflow:
        if isinstance(ml, dict):
            if ml.get("tracking_uri"):
                notes.append("mlflow.tracking_uri: ignored; the service's MLflow store is used")
            ml.pop("tracking_uri", None)
            if self.settings.mlflow_uri:
                ml["tracking_uri"] = self.settings.mlflow_uri
        return notes

    def _place_model(self, job: JobConfig, given: str, team: str) -> JobConfig:
        """The job with its model where the operator allows: made only under DATA_DIR/models/
        TEAM (read again only by that team, by its path); read under the model roots (a
        relative path, as ``given``, is looked for under each root, never beside the service's
        working directory or the job's base folder); else a hub name, where the operator allows
        them (``--allow-hub-models``).

        Raises:
            SubmissionRefused: (403) A model outside the roots, or a hub name the operator
                does not allow. The answer is the same whether or not such a path exists.
            ConfigError: With hub names allowed, a name that is not a hub repository id.
        """
        path, made = job.model.path, self.models_dir / team  # made: only this team's
        if job.model.make:
            if not security.under(path, [made]):
                raise SubmissionRefused(
                    f"model.path: with `make` the service creates models only in its own "
                    f"folder; give a relative path (it lands in {made})",
                    status=403,
                )
            return job
        roots = ", ".join(str(r) for r in self.model_roots)
        if Path(given).expanduser().is_absolute():
            if not security.under(path, [*self.model_roots, made]):
                raise SubmissionRefused(
                    f"model.path: outside the service's model roots ({roots}): ask the "
                    "operator to add a --model-root"
                    + (", or give a hub name" if self.settings.allow_hub_models else ""),
                    status=403,
                )
            return job
        found = self._find_in_model_roots(given)
        placed = found if found is not None else self._hub_model(given, roots)
        return job.model_copy(update={"model": job.model.model_copy(update={"path": placed})})

    def _find_in_model_roots(self, path: str) -> str | None:
        """``root/path`` for the first model root that holds it (never a path that leaves
        its root: that is checked before anything is looked for)."""
        for root in self.model_roots:
            candidate = root / path
            if security.under(candidate, [root]) and candidate.exists():
                return str(candidate)
        return None

    def _hub_model(self, path: str, roots: str) -> str:
        """A model name found under no model root: a hub name, if the operator allows them."""
        if not self.settings.allow_hub_models:
            raise SubmissionRefused(
                f"model.path {path[:200]!r}: not a model under the service's model roots "
                f"({roots}), and this service serves no hub names: give a folder under a "
                "model root (a path relative to one is looked for there), or ask the operator "
                "to start the service with --allow-hub-models",
                status=403,
            )
        if not security.is_hub_name(path):
            raise ConfigError(
                f"model.path {path[:200]!r}: neither a model under the service's model roots "
                f"({roots}) nor a hub name (ORG/NAME: letters, digits, '.', '_' and '-', no "
                "'..')"
            )
        return path

    @staticmethod
    def _check_space(job: JobConfig) -> None:
        """Every flag the search space can set is one the service accepts. A space file (under
        the roots: :meth:`_check_files`) that is not a valid space is refused without quoting
        any of it (its keys and values included)."""
        from search_spaces.schema import load_space

        space = job.search_space
        if isinstance(space, dict) or is_preset_name(space):
            security.check_space(load_space(space))
            return
        name = Path(space).name[:200]
        try:
            if not Path(space).is_file() or Path(space).stat().st_size > _MAX_SPACE_BYTES:
                raise ConfigError("not a file of at most 1 MiB")
            security.check_space(load_space(space))
        except (ConfigError, OSError, ValueError):
            raise ConfigError(
                f"search_space: {name} is not a search space the service accepts (a YAML "
                "file of at most 1 MiB with name, fixed, params, and only flags the service "
                "allows); the service does not quote the file: `vllm-autotune tune` with the "
                "job locally says what is wrong, or inline the space in the job"
            ) from None

    def _check_trace_size(self, job: JobConfig, upload_dir: Path) -> None:
        """At most the operator's rows in the trace, counted before it is parsed; an uploaded
        one at most the upload limit once decompressed."""
        path = Path(job.trace.path)
        uploaded = path.is_relative_to(upload_dir)
        security.check_trace_size(
            path,
            self.settings.max_trace_rows,
            self.settings.max_upload_bytes if uploaded else None,
        )

    def _prepare(self, job: JobConfig, base: Path) -> None:
        """The plan check, with every failure a 4xx that quotes none of the trace; what it
        allocated (the whole trace, read and shaped) goes back to the system after it."""
        try:
            self.check_plan(job, base)
        except TraceError as exc:
            where = ", ".join(
                f"{k} {v}" for k, v in (("line", exc.line), ("field", exc.field)) if v is not None
            )
            raise ConfigError(
                f"trace: {Path(job.trace.path).name} cannot be read"
                + (f" ({where})" if where else "")
                + "; the service does not quote the file: `vllm-autotune trace inspect` on it "
                "says what is wrong"
            ) from None
        except (ConfigError, SubmissionRefused):
            raise
        except Exception as exc:
            log.warning("submission refused: its plan failed with %s", type(exc).__name__)
            raise ConfigError(
                f"the job could not be prepared ({type(exc).__name__}): the trace or the "
                "model folder is unreadable; `vllm-autotune tune` on it locally says more"
            ) from None
        finally:
            _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the memory a plan check freed back to the system: glibc keeps freed heap pages
    for reuse, so a replica that checked a large trace would otherwise stay about as large as
    the check made it. Elsewhere than glibc (macOS, musl): nothing to do."""
    gc.collect()
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)


def prepare_check(job: JobConfig, base: Path) -> None:
    """Build the plan without starting anything; flags and values are checked against the
    installed vLLM as `tune` does, when this process has one (else the driver checks them)."""
    from optimizer.study import prepare

    prepare(job, base, check_flags=_has_vllm())


@functools.cache
def _has_vllm() -> bool:
    from optimizer.engine.flags import installed_vllm

    try:
        installed_vllm()
    except (ConfigError, OSError, ValueError):
        return False
    return True
