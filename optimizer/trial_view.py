"""The one reader and writer of a stored trial: what the study keeps in Optuna, in one place.

The study driver stores each trial's outcome as Optuna user attributes (``status``,
``engine_args`` as JSON, ``summary``, ``capacity``, ...). The writers here
(:func:`record_engine_args`, :func:`record_status`, :func:`record_result`) are the only code
that sets them; :class:`TrialView` is the only code that reads them, and the study-level
readers (:func:`metric_names`, :func:`baseline_of`, :func:`feasible_front`) answer what every
report asks. The attribute names are a storage format: existing study folders must still read.
:func:`gpus_per_server` is the one rule for how many GPUs a configuration's server takes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from optuna.trial import FrozenTrial, TrialState

if TYPE_CHECKING:
    import optuna

    from optimizer.types import TrialResult

__all__ = [
    "BASELINE_ATTR",
    "QUALITY_ATTR",
    "STATUS_ATTR",
    "CapacityView",
    "TrialView",
    "baseline_of",
    "feasible_front",
    "gpus_per_server",
    "metric_names",
    "quality_verdicts",
    "record_engine_args",
    "record_result",
    "record_status",
    "refused_trials",
]

# Stored attribute names (a storage format: never rename).
BASELINE_ATTR = "baseline"
STATUS_ATTR = "status"
#: The quality gate's verdicts (:mod:`optimizer.quality`): a study attribute, trial number (as
#: text) -> the verdict's document (a finished trial's own attributes cannot change).
QUALITY_ATTR = "quality"
ENGINE_ARGS_ATTR = "engine_args"
_MESSAGE_CHARS = 2000


def gpus_per_server(args: Mapping[str, Any], *, cpu_build: bool = False) -> int:
    """GPUs one server of this configuration uses: tensor x pipeline parallel (0 on a CPU)."""
    if cpu_build:
        return 0
    tp = int(args.get("tensor-parallel-size", 1) or 1)
    pp = int(args.get("pipeline-parallel-size", 1) or 1)
    return tp * pp


def _float(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


@dataclass(frozen=True)
class CapacityView:
    """A capacity trial's search, as stored (see ``optimizer.capacity.trial.capacity_doc``).

    Attributes:
        rps: Requests/s of the trace's mix carried within the SLOs (0: none): the estimate
            inside the bracket (a study folder written before the estimate: the bracket's low).
        output_tps: The same in output tokens/s.
        rps_lo: The bracket's low in requests/s (the highest passing step's rate).
        rps_hi: The bracket's high in requests/s (NaN when no step above failed).
        estimate_lo: Low end of the estimate's range, requests/s.
        estimate_hi: High end of the estimate's range, requests/s (NaN when open).
        estimate_method: How the estimate was made (``interpolated``, ``bracket midpoint``,
            ``lower bound``, ``none``; ``bracket`` for a folder written before estimates).
        estimate_scale: The estimate as a rate scale.
        raced: The search raced at the study's incumbent and this configuration lost.
        raced_out: Lost the race and failed one step below too: only an upper bound
            (``rps_hi``) is known; told to the sampler as pruned.
        scale: The highest passing rate scale.
        lo: Bracket low (highest pass).
        hi: Bracket high (lowest fail above ``lo``; NaN when none failed).
        converged: The bracket is within the tolerance.
        bracket_width: ``hi / lo - 1`` (NaN when open).
        repeat_spread: Largest spread of a repeated step's deciding margin.
        steps: Every step (scale, passed, reason, margins, ...).
        broke_first: The SLO that broke first above the capacity.
        broke_reason: How it broke.
        floors: SLO floors measured when nothing passed.
        isolation: How steps were kept apart.
        stop: Why the search ended.
    """

    rps: float
    output_tps: float
    rps_lo: float
    rps_hi: float
    estimate_lo: float
    estimate_hi: float
    estimate_method: str
    estimate_scale: float
    raced: bool
    raced_out: bool
    scale: float
    lo: float
    hi: float
    converged: bool
    bracket_width: float
    repeat_spread: float
    steps: tuple[Mapping[str, Any], ...]
    broke_first: str | None
    broke_reason: str | None
    floors: Mapping[str, float]
    isolation: str
    stop: str
    first_failure: Mapping[str, Any] | None
    first_failure_partial: bool | None

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> CapacityView:
        """Decode the stored document (one written before estimates: the bracket's low)."""
        rps = _float(doc.get("rps", 0.0))
        est = doc.get("estimate") or {}
        return cls(
            rps=rps,
            output_tps=_float(doc.get("output_tps", 0.0)),
            rps_lo=_float(doc.get("rps_lo", rps)),
            rps_hi=_float(doc.get("rps_hi")),
            estimate_lo=_float(est.get("rps_lo", rps)),
            estimate_hi=_float(est.get("rps_hi", rps)),
            estimate_method=str(est.get("method") or "bracket"),
            estimate_scale=_float(est.get("scale", doc.get("scale", 0.0))),
            raced=bool(doc.get("raced")),
            raced_out=bool(doc.get("raced_out")),
            scale=_float(doc.get("scale", 0.0)),
            lo=_float(doc.get("lo", 0.0)),
            hi=_float(doc.get("hi")),
            converged=bool(doc.get("converged")),
            bracket_width=_float(doc.get("bracket_width")),
            repeat_spread=_float(doc.get("repeat_spread", 0.0)),
            steps=tuple(doc.get("steps") or ()),
            broke_first=doc.get("broke_first"),
            broke_reason=doc.get("broke_reason"),
            floors={k: _float(v) for k, v in (doc.get("floors") or {}).items()},
            isolation=str(doc.get("isolation") or ""),
            stop=str(doc.get("stop") or ""),
            first_failure=doc.get("first_failure"),
            first_failure_partial=doc.get("first_failure_partial"),
        )

    def lowest_step(self) -> Mapping[str, Any] | None:
        """The step at the lowest scale tried."""
        return min(self.steps, key=lambda s: float(s["scale"])) if self.steps else None

    def bracket_text(self) -> str:
        """``[lo, hi]`` in requests/s terms of the scale, e.g. ``x[1.41, 1.5]``."""
        hi = "∞" if math.isnan(self.hi) else f"{self.hi:.3g}"
        return f"x[{self.lo:.3g}, {hi}]"

    def rps_text(self) -> str:
        """The answer in requests/s with how it was reached: ``1.02 req/s (interpolated,
        ±3%; measured bracket 0.98-1.06)``, ``below 0.5 req/s (raced out)``, ``0``."""
        if self.raced_out:
            return f"below {self.rps_hi:.3g} req/s (raced out at the incumbent)"
        if self.rps <= 0:
            return "0 req/s"
        hi = "∞" if math.isnan(self.rps_hi) else f"{self.rps_hi:.3g}"
        bracket = f"measured bracket {self.rps_lo:.3g}-{hi}"
        if self.estimate_method != "interpolated":
            return f"{self.rps:.3g} req/s ({self.estimate_method}; {bracket})"
        half = (self.estimate_hi - self.estimate_lo) / 2 / self.rps
        raced = "; raced out at the incumbent" if self.raced else ""
        return f"{self.rps:.3g} req/s (interpolated, ±{half:.0%}; {bracket}{raced})"


@dataclass(frozen=True)
class TrialView:
    """A stored trial, decoded.

    Attributes:
        trial: The Optuna trial.
    """

    trial: FrozenTrial

    @property
    def number(self) -> int:
        """The trial number."""
        return self.trial.number

    @property
    def status(self) -> str:
        """How it ended: complete, failed, infeasible, invalid_replay, rejected, running, ..."""
        default = self.trial.state.name.lower()
        return str(self.trial.user_attrs.get("status", default))

    @property
    def is_baseline(self) -> bool:
        """True for the study's baseline (vLLM's defaults)."""
        return bool(self.trial.user_attrs.get("baseline"))

    @property
    def engine_args(self) -> dict[str, Any]:
        """The engine arguments it ran with ({} when none were stored or they do not parse)."""
        raw = self.trial.user_attrs.get(ENGINE_ARGS_ATTR)
        try:
            return dict(json.loads(raw)) if isinstance(raw, str) else {}
        except ValueError:
            return {}

    @property
    def engine_args_key(self) -> str | None:
        """The stored engine arguments as written (a canonical JSON text), for equality."""
        raw = self.trial.user_attrs.get(ENGINE_ARGS_ATTR)
        return raw if isinstance(raw, str) else None

    @property
    def measured(self) -> bool:
        """Its objective values are a full measurement (not a failure's placeholders)."""
        return self.trial.state == TrialState.COMPLETE and self.status == "complete"

    @property
    def feasible(self) -> bool:
        """Measured and every SLO constraint met."""
        return self.measured and all(v <= 0 for v in self.trial.constraints.values())

    @property
    def summary(self) -> dict[str, float]:
        """The stored summary (None values as NaN)."""
        raw = self.trial.user_attrs.get("summary") or {}
        return {str(k): _float(v) for k, v in raw.items()}

    @property
    def partial(self) -> bool:
        """The summary covers a window an early stop cut short."""
        return self.status == "infeasible" or bool(self.summary.get("partial"))

    @property
    def stopped_by(self) -> str:
        """The SLO whose early stop ended the replay ("" when it was not stopped early)."""
        message = self.message
        if self.status != "infeasible" or "SLO out of reach: " not in message:
            return ""
        rest = message.split("SLO out of reach: ", 1)[1]
        return rest.split(" can no longer be met", 1)[0].strip()

    @property
    def capacity(self) -> CapacityView | None:
        """The capacity search, for capacity trials."""
        doc = self.trial.user_attrs.get("capacity")
        return CapacityView.from_doc(doc) if isinstance(doc, Mapping) else None

    @property
    def startup_s(self) -> float | None:
        """Seconds its engine took to start (None: it never started)."""
        value = self.trial.user_attrs.get("startup_s")
        return float(value) if value is not None else None

    @property
    def startup_phases(self) -> dict[str, float]:
        """Seconds per phase of its engine's start (:mod:`optimizer.engine.startup`); empty
        for trials stored before phases were recorded."""
        doc = self.trial.user_attrs.get("startup")
        phases = doc.get("phases") if isinstance(doc, Mapping) else None
        return {str(k): float(v) for k, v in (phases or {}).items()}

    @property
    def startup_doc(self) -> dict[str, Any]:
        """The whole startup record: ``{"phases": ..., "reported": ...}`` (may be empty)."""
        doc = self.trial.user_attrs.get("startup")
        return dict(doc) if isinstance(doc, Mapping) else {}

    @property
    def replay_s(self) -> float | None:
        """Seconds its replay took (None: no replay)."""
        value = self.trial.user_attrs.get("replay_s")
        return float(value) if value is not None else None

    @property
    def message(self) -> str:
        """What happened, in a paragraph."""
        return str(self.trial.user_attrs.get("message") or "")

    @property
    def failure_class(self) -> str:
        """Why its engine failed (``oom``, ``kv_cache_too_small``, ...; empty otherwise)."""
        return str(self.trial.user_attrs.get("failure_class") or "")

    @property
    def attempts(self) -> int | None:
        """Replays it took (a replay that could not keep its schedule is retried)."""
        value = self.trial.user_attrs.get("attempts")
        return int(value) if value is not None else None

    @property
    def retry_of(self) -> int | None:
        """The trial whose configuration a dead driver lost and this one re-ran."""
        value = self.trial.user_attrs.get("retry_of")
        return int(value) if value is not None else None

    @property
    def enqueued(self) -> bool:
        """The job enqueued this configuration (it was not the sampler's proposal)."""
        return bool(self.trial.user_attrs.get("enqueued"))

    @property
    def memory(self) -> dict[str, Any]:
        """The engine's memory account at startup ({} when none)."""
        return dict(self.trial.user_attrs.get("memory") or {})

    @property
    def server_metrics(self) -> dict[str, float]:
        """/metrics samples read after the replay ({} when none)."""
        return dict(self.trial.user_attrs.get("server_metrics") or {})

    @property
    def effective_config(self) -> dict[str, str]:
        """The engine's own config line, field -> logged text ({} when none)."""
        return dict(self.trial.user_attrs.get("effective_config") or {})

    @property
    def log_path(self) -> str:
        """The engine log's path ("" when none)."""
        return str(self.trial.user_attrs.get("log_path") or "")

    @property
    def capacity_doc(self) -> dict[str, Any] | None:
        """The capacity search as stored (JSON), for documents that carry it whole."""
        doc = self.trial.user_attrs.get("capacity")
        return dict(doc) if isinstance(doc, Mapping) else None

    def attributes(self) -> dict[str, Any]:
        """Every stored attribute, raw (for a full dump; decode through the properties)."""
        return dict(self.trial.user_attrs)

    def slo_verdicts(self) -> dict[str, bool]:
        """SLO -> met, from the constraints told to Optuna."""
        return {k: v <= 0 for k, v in self.trial.constraints.items()}

    def gpus(self, *, cpu_build: bool = False) -> int:
        """GPUs its server used."""
        return gpus_per_server(self.engine_args, cpu_build=cpu_build)


# --- study-level readers ------------------------------------------------------------------------


def metric_names(study: optuna.Study) -> list[str]:
    """The study's objective names (``objective_<i>`` for a study stored without names)."""
    names = study.metric_names
    return list(names) if names else [f"objective_{i}" for i in range(len(study.directions))]


def baseline_of(study: optuna.Study, *, measured: bool = False) -> FrozenTrial | None:
    """The study's baseline trial (vLLM's defaults); ``measured``: only a told one."""
    for t in study.get_trials(deepcopy=False):
        if TrialView(t).is_baseline and (not measured or t.state == TrialState.COMPLETE):
            return t
    return None


def feasible_front(study: optuna.Study, *, gated: bool = True) -> list[FrozenTrial]:
    """The feasible Pareto front: measured trials that meet every SLO, none dominated.

    ``gated``: trials the quality gate refused are left out before the front is taken, so a
    refused trial never hides the ones it dominates.
    """
    front = [t for t in study.best_trials if TrialView(t).feasible]
    refused = {t.number for t in refused_trials(study)} if gated else set()
    if not refused & {t.number for t in front}:
        return front
    kept = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if TrialView(t).feasible and t.number not in refused
    ]
    return _non_dominated(kept, study.directions)


def quality_verdicts(study: optuna.Study) -> dict[int, dict[str, Any]]:
    """The quality gate's verdicts by trial number (empty: nothing checked)."""
    raw = study.user_attrs.get(QUALITY_ATTR)
    if not isinstance(raw, Mapping):
        return {}
    return {int(k): dict(v) for k, v in raw.items() if str(k).isdigit() and isinstance(v, Mapping)}


def refused_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Measured trials the quality gate refused, in trial order: never exported as a win."""
    refused = {n for n, doc in quality_verdicts(study).items() if doc.get("status") == "fail"}
    return [t for t in study.get_trials(deepcopy=False) if t.number in refused]


def _non_dominated(
    trials: list[FrozenTrial], directions: list[optuna.study.StudyDirection]
) -> list[FrozenTrial]:
    from optuna.study import StudyDirection

    signs = [1.0 if d == StudyDirection.MINIMIZE else -1.0 for d in directions]

    def key(t: FrozenTrial) -> list[float]:
        return [s * float(v) for s, v in zip(signs, t.values or [], strict=True)]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x <= y for x, y in zip(a, b, strict=True)) and a != b

    keys = {t.number: key(t) for t in trials}
    return [
        t
        for t in trials
        if not any(dominates(keys[o.number], keys[t.number]) for o in trials if o is not t)
    ]


# --- writers: the study driver records a trial through these ------------------------------------


def record_engine_args(trial: optuna.trial.Trial, args: Mapping[str, Any]) -> str:
    """Store the engine arguments a trial runs with; returns the stored (canonical) text."""
    encoded = json.dumps(dict(args), sort_keys=True, default=str)
    trial.set_user_attr(ENGINE_ARGS_ATTR, encoded)
    return encoded


def record_status(trial: optuna.trial.Trial, status: str, message: str = "", **extra: Any) -> None:
    """Store how a trial ended (a :class:`~optimizer.types.TrialStatus` value) and why."""
    trial.set_user_attr(STATUS_ATTR, status)
    if message:
        trial.set_user_attr("message", message[:_MESSAGE_CHARS])
    for key, value in extra.items():
        trial.set_user_attr(key, value)


def record_result(trial: optuna.trial.Trial, result: TrialResult, attempt: int) -> None:
    """Store a finished trial's result (status, summary, memory, capacity, ...)."""
    record_status(trial, result.status.value, result.message, attempts=attempt + 1)
    if result.failure_class is not None:
        trial.set_user_attr("failure_class", result.failure_class.value)
    summary = {
        k: (None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in result.summary.items()
    }
    trial.set_user_attr("summary", summary)
    if result.memory is not None:
        trial.set_user_attr("memory", asdict(result.memory))
    if result.startup_s is not None:
        trial.set_user_attr("startup_s", round(result.startup_s, 3))
    if result.replay_s is not None:
        trial.set_user_attr("replay_s", round(result.replay_s, 3))
    if result.startup:
        trial.set_user_attr("startup", _json_safe(result.startup))
    if result.server_metrics:
        trial.set_user_attr("server_metrics", dict(result.server_metrics))
    trial.set_user_attr("log_path", result.log_path)
    if result.effective_config:
        trial.set_user_attr("effective_config", dict(result.effective_config))
    if result.capacity:
        trial.set_user_attr("capacity", _json_safe(result.capacity))


def _json_safe(value: Any) -> Any:
    """``value`` with NaN / infinity as None, so every storage keeps it as JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value
