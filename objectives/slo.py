"""Service-level objectives: ``p95_ttft_ms<=500`` parsed into a checkable constraint.

An :class:`Slo` compares one key of a :func:`objectives.summarize` summary with a threshold.
It answers two questions: whether a trial met it (:meth:`Slo.met`) and by how much it missed,
as an Optuna constraint value that is <= 0 when met (:meth:`Slo.margin`). SLOs on a latency
that exists per request (TTFT, TPOT, E2EL, TTFT from scheduled arrival) also define goodput, as
``vllm bench serve --goodput ttft:500 tpot:50`` does: a request is good when its own value meets
the threshold of every such SLO, whatever the statistic prefix (``p95_``, ``mean_``, ...) says.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from optimizer.errors import SloError

__all__ = [
    "PER_REQUEST_METRICS",
    "SLO_OPS",
    "UNMEASURED_MARGIN",
    "Slo",
    "SloError",
    "is_summary_key",
    "parse_slo",
]

SLO_OPS: Final[tuple[str, ...]] = ("<=", "<", ">=", ">")
"""Comparison operators an SLO may use."""

PER_REQUEST_METRICS: Final[tuple[str, ...]] = (
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
    "ttft_from_scheduled_ms",
)
"""Latencies every request has on its own; SLOs on them count towards goodput."""

UNMEASURED_MARGIN: Final[float] = 1.0e6
"""Margin of an SLO whose value is NaN (nothing measured): violated, but finite so samplers
that model constraints (Optuna's GP) keep working."""

# A strict comparison met with equality has a raw margin of exactly 0, which Optuna reads as
# feasible; nudge it positive so margin() and met() never disagree.
_STRICT_EQUALITY_MARGIN: Final[float] = 1.0e-9

_OPS: Final[dict[str, Callable[[float, float], bool]]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
}

# Families summarize() reports as mean_/median_/std_/pXX_<family>_ms.
_STAT_FAMILIES: Final[tuple[str, ...]] = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "ttft_from_scheduled",
    "send_lag",
)
_SCALAR_KEYS: Final[frozenset[str]] = frozenset(
    {
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "error_rate",
        "request_goodput",
        "good_completed",
        "max_send_lag_ms",
        # A capacity trial's answer (optimizer.capacity.trial): not SLO-able per request.
        "capacity_scale",
        "capacity_rps",
        "capacity_output_tps",
        "nominal_p95_ttft_ms",
        "nominal_p95_tpot_ms",
    }
)
_PERCENTILE = r"p(?:100|[1-9]?[0-9])(?:\.[0-9]+)?"
_FAMILY_KEY_RE: Final[re.Pattern[str]] = re.compile(
    rf"^(?P<stat>mean|median|std|{_PERCENTILE})_(?P<family>{'|'.join(_STAT_FAMILIES)})_ms$"
)
_SLO_RE: Final[re.Pattern[str]] = re.compile(
    r"^\s*(?P<metric>[A-Za-z0-9_.]+)\s*(?P<op><=|>=|<|>)\s*"
    r"(?P<threshold>[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*$"
)
_VALID_FORMS: Final[str] = (
    "write METRIC OP THRESHOLD, e.g. 'p95_ttft_ms<=500', 'mean_tpot_ms<50' or "
    "'output_throughput>=1000'; OP is one of <=, <, >=, >; METRIC is a summary key: "
    "mean_/median_/std_/pNN_ followed by ttft_ms, tpot_ms, itl_ms, e2el_ms, "
    "ttft_from_scheduled_ms or send_lag_ms, or one of " + ", ".join(sorted(_SCALAR_KEYS))
)


def is_summary_key(name: str) -> bool:
    """Tell whether ``name`` is a key :func:`objectives.summarize` can produce.

    Percentile keys (``p95_ttft_ms``) exist only for the percentiles summarize was asked for;
    this accepts any percentile between 0 and 100.

    Args:
        name: A candidate key, e.g. ``"p95_ttft_ms"``.

    Returns:
        True when the name has the form of a summary key.
    """
    return name in _SCALAR_KEYS or _FAMILY_KEY_RE.match(name) is not None


@dataclass(frozen=True, slots=True)
class Slo:
    """One constraint on a summary key: ``metric op threshold``.

    Attributes:
        metric: A key of the summary, e.g. ``"p95_ttft_ms"`` (units are the key's own).
        op: One of ``<=``, ``<``, ``>=``, ``>``.
        threshold: The bound, finite.

    Raises:
        SloError: On an unknown metric or operator or a non-finite threshold.
    """

    metric: str
    op: str
    threshold: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise SloError(f"SLO {self}: unknown operator {self.op!r}; {_VALID_FORMS}")
        if not is_summary_key(self.metric):
            raise SloError(f"SLO {self}: unknown metric {self.metric!r}; {_VALID_FORMS}")
        if not math.isfinite(self.threshold):
            raise SloError(f"SLO {self}: threshold must be a finite number; {_VALID_FORMS}")

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"

    @property
    def per_request_metric(self) -> str | None:
        """The per-request latency this SLO bounds for goodput, or None.

        ``p95_ttft_ms``, ``mean_ttft_ms`` and ``median_ttft_ms`` all give ``"ttft_ms"``: for
        goodput each request's own TTFT is held to the threshold. ``std_`` keys, ITL, send lag
        and aggregate keys (throughput, error rate) have no per-request meaning and give None.
        """
        match = _FAMILY_KEY_RE.match(self.metric)
        if match is None or match["stat"] == "std":
            return None
        name = f"{match['family']}_ms"
        return name if name in PER_REQUEST_METRICS else None

    def holds(self, value: float) -> bool:
        """Compare a value with the threshold; NaN never holds.

        Args:
            value: A value in the metric's units.

        Returns:
            True when ``value op threshold``.
        """
        if math.isnan(value):
            return False
        return _OPS[self.op](value, self.threshold)

    def met(self, summary: Mapping[str, float]) -> bool:
        """Tell whether a summary meets this SLO (a NaN value does not).

        Args:
            summary: A summary from :func:`objectives.summarize`.

        Returns:
            True when ``summary[metric] op threshold``.

        Raises:
            KeyError: The summary lacks the metric (e.g. a percentile it was not asked for).
        """
        return self.holds(self._value(summary))

    def margin(self, summary: Mapping[str, float]) -> float:
        """Constraint value in Optuna's convention: <= 0 when met, > 0 when violated.

        The violation is relative to the threshold, ``(value - threshold) / |threshold|`` for
        ``<=`` and ``<`` and the negation for ``>=`` and ``>`` (divided by 1 instead of a
        zero threshold), so SLOs in different units weigh alike. A strict bound met with
        equality gets a tiny positive margin; a NaN value gets :data:`UNMEASURED_MARGIN`.

        Args:
            summary: A summary from :func:`objectives.summarize`.

        Returns:
            The margin; ``margin(summary) <= 0`` exactly when ``met(summary)``.

        Raises:
            KeyError: The summary lacks the metric.
        """
        value = self._value(summary)
        if math.isnan(value):
            return UNMEASURED_MARGIN
        scale = abs(self.threshold) or 1.0
        excess = value - self.threshold if self.op in ("<=", "<") else self.threshold - value
        margin = excess / scale
        if margin == 0.0 and not self.holds(value):
            return _STRICT_EQUALITY_MARGIN
        return margin

    def _value(self, summary: Mapping[str, float]) -> float:
        try:
            return float(summary[self.metric])
        except KeyError:
            raise KeyError(
                f"SLO {self}: the summary has no {self.metric!r}; ask summarize() for that "
                "percentile or pass the SLO to it (request_goodput exists only with SLOs)"
            ) from None


def parse_slo(text: str) -> Slo:
    """Parse ``"p95_ttft_ms<=500"`` into an :class:`Slo`.

    Spaces around the operator are allowed; the threshold is a plain number in the metric's
    own units (no unit suffix).

    Args:
        text: The SLO string.

    Returns:
        The parsed SLO.

    Raises:
        SloError: The string is not ``METRIC OP NUMBER`` or names an unknown metric; the
            message quotes the string and lists the valid forms.
    """
    match = _SLO_RE.match(text)
    if match is None:
        raise SloError(f"cannot parse SLO {text!r}: {_VALID_FORMS}")
    metric = match["metric"]
    if not is_summary_key(metric):
        hint = ""
        if metric in PER_REQUEST_METRICS or metric in {f[:-3] for f in PER_REQUEST_METRICS}:
            hint = f" (did you mean p95_{metric.removesuffix('_ms')}_ms?)"
        raise SloError(f"SLO {text!r}: unknown metric {metric!r}{hint}; {_VALID_FORMS}")
    try:
        return Slo(metric=metric, op=match["op"], threshold=float(match["threshold"]))
    except SloError as error:
        raise SloError(f"SLO {text!r}: {error}") from None
