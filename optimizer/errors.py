"""The tuner's one exception tree.

Per-request failures are data (``RequestRecord.error``), trial failures are states
(``FailureClass``), and bugs raise. Everything the tuner raises on purpose derives from
:class:`AutotuneError`::

    AutotuneError
    ├── ConfigError            a job file, CLI option or engine argument is wrong (user fixes it)
    │   ├── EngineArgError     an engine flag the installed vLLM does not accept
    │   ├── ObjectiveError     an objective string, preset or combination (also a ValueError)
    │   ├── SloError           an SLO string or field (also a ValueError)
    │   └── SearchSpaceError   a search space (also a ValueError)
    ├── TraceError             a trace file is malformed (file, line, field)
    ├── EngineError            a vLLM server failed; carries the FailureClass and log lines
    ├── ReplayError            the replay could not run
    │   └── ClientCouldNotKeepUp   a capacity step's schedule was missed twice in a row
    ├── NotFound               the service has no such job or trial (HTTP 404)
    └── SubmissionRefused      the service refuses a submission by policy (its HTTP status)

Modules raise these; a few private exceptions that never leave their module (control flow in a
parser) are not listed.

This module is the ground floor of the package: it imports nothing of the project (the records of
:mod:`optimizer.types` import it, for :class:`FailureClass` and the settings' errors).
"""

from __future__ import annotations

import enum

__all__ = [
    "AutotuneError",
    "ClientCouldNotKeepUp",
    "ConfigError",
    "EngineArgError",
    "EngineError",
    "FailureClass",
    "NotFound",
    "ObjectiveError",
    "ReplayError",
    "SearchSpaceError",
    "SloError",
    "SubmissionRefused",
    "TraceError",
    "TrialNodeLost",
]


class FailureClass(enum.StrEnum):
    """Why an engine (or a trial) failed; stored in Optuna attributes and MLflow tags."""

    OOM_AT_LOAD = "oom_at_load"
    KV_CACHE_TOO_SMALL = "kv_cache_too_small"
    INVALID_ARGUMENT = "invalid_argument"
    CUDA_ERROR = "cuda_error"
    MISSING_MODULE = "missing_module"
    PARAMETER_INACTIVE = "parameter_inactive"
    ENGINE_CRASHED = "engine_crashed"
    STARTUP_TIMEOUT = "startup_timeout"


class AutotuneError(Exception):
    """Base of every error the tuner raises on purpose."""


class ConfigError(AutotuneError):
    """A configuration given by the user is invalid; the message says what to change."""


class EngineArgError(ConfigError):
    """An engine argument the installed vLLM does not accept.

    Attributes:
        flag: The offending flag name.
        suggestion: The closest accepted flag name, if any.
    """

    def __init__(self, message: str, *, flag: str, suggestion: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag
        self.suggestion = suggestion


class TraceError(AutotuneError):
    """A trace file cannot be read.

    Attributes:
        path: The file.
        line: 1-based line number (None when the error concerns the whole file).
        field: The field at fault, if one.
    """

    def __init__(
        self, message: str, *, path: str = "", line: int | None = None, field: str | None = None
    ) -> None:
        where = path
        if line is not None:
            where += f":{line}"
        if field:
            where += f" [{field}]"
        super().__init__(f"{where}: {message}" if where else message)
        self.path = path
        self.line = line
        self.field = field


class EngineError(AutotuneError):
    """A vLLM server failed to start or died.

    Attributes:
        failure_class: Why, as a :class:`FailureClass`.
        log_lines: The relevant lines of the server log.
        log_path: The full server log.
        explanation: One paragraph for a user: what happened and what to change.
    """

    def __init__(
        self,
        message: str,
        *,
        failure_class: FailureClass,
        log_lines: tuple[str, ...] = (),
        log_path: str = "",
        explanation: str = "",
    ) -> None:
        super().__init__(message)
        self.failure_class = failure_class
        self.log_lines = log_lines
        self.log_path = log_path
        self.explanation = explanation or message


class ReplayError(AutotuneError):
    """The replay itself could not run as asked."""


class TrialNodeLost(AutotuneError):
    """A trial's Ray node died under it (its raylet, or the machine): the cluster's loss, not
    the configuration's result. The study runs the configuration once more (on a node that is
    alive) and never tells the sampler the loss as a failure.

    Attributes:
        node_id: The lost node's Ray id ("" when Ray did not say).
    """

    def __init__(self, message: str, node_id: str = "") -> None:
        super().__init__(message)
        self.node_id = node_id


class NotFound(AutotuneError):
    """The service has no such job (or trial), or not for this caller."""


class SubmissionRefused(AutotuneError):
    """A submission the service will not run for a reason of policy, not validity.

    Attributes:
        status: The HTTP status that says why (403: a file outside the allowed roots, 413: an
            upload over the size limit, 409: the request conflicts with the job's state, 429:
            too many of the caller's requests at once).
        retry_after_s: Seconds after which the same request may succeed (429; None: unsaid).
    """

    def __init__(self, message: str, *, status: int, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class ObjectiveError(ConfigError, ValueError):
    """An objective string, preset or combination is invalid; the message names the fix."""


class SloError(ConfigError, ValueError):
    """An SLO string or field is malformed; the message names it and the valid forms."""


class SearchSpaceError(ConfigError, ValueError):
    """A search space is malformed; the message names the key at fault and the fix."""


class ClientCouldNotKeepUp(ReplayError):
    """The replay client could not keep a step's schedule twice in a row."""
