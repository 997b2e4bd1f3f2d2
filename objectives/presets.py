"""What a study optimizes: objectives over summary keys, SLOs as constraints, named presets.

An :class:`Objective` names one key of a :func:`objectives.summarize` summary and a direction;
an :class:`ObjectiveSet` bundles the objectives of a study with its SLOs and turns a summary into
what Optuna is told: objective values (never NaN: an unmeasured value becomes the objective's
worst case, so samplers keep working) and constraint values (:meth:`Slo.margin`, <= 0 met).
A trial whose engine failed is told :meth:`ObjectiveSet.worst` and
:meth:`ObjectiveSet.failed_constraints`, so the sampler learns where the feasible region ends.

Presets: ``default`` (min P95 TTFT, min P95 TPOT, max output throughput), ``latency``
(min P95 TTFT, min P95 TPOT), ``throughput`` (max output throughput, min P95 TTFT) and
``goodput`` (max requests/s meeting every SLO; needs SLOs), ``capacity`` (max requests/s of
the trace's traffic mix one server carries with every SLO held: a rate search per trial, see
:mod:`optimizer.capacity`; needs SLOs) and ``capacity-latency`` (capacity, plus P95 TTFT and
TPOT at the nominal scale, measured as the search's first step).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from objectives.metrics import DEFAULT_PERCENTILES
from objectives.slo import Slo, is_summary_key, parse_slo
from optimizer.errors import ObjectiveError

__all__ = [
    "CAPACITY_METRICS",
    "FAILED_CONSTRAINT",
    "OBJECTIVE_PRESETS",
    "WORST_MINIMIZE",
    "Direction",
    "Objective",
    "ObjectiveError",
    "ObjectiveSet",
    "load_objectives",
    "parse_objective",
]

Direction = Literal["minimize", "maximize"]

WORST_MINIMIZE: Final[float] = 1.0e9
"""Worst case of a minimized metric (1e9 ms is 11.6 days): large but finite for samplers."""

FAILED_CONSTRAINT: Final[float] = 1.0
"""Constraint value of each SLO for a trial that measured nothing (violated)."""

# Metrics whose worst case is bounded by nature rather than WORST_MINIMIZE.
_BOUNDED_WORST: Final[dict[str, float]] = {"error_rate": 1.0}
_MAXIMIZED: Final[frozenset[str]] = frozenset(
    {
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        "completed",
        "good_completed",
        "capacity_scale",
        "capacity_rps",
        "capacity_output_tps",
    }
)
CAPACITY_METRICS: Final[frozenset[str]] = frozenset(
    {
        "capacity_scale",
        "capacity_rps",
        "capacity_output_tps",
        "nominal_p95_ttft_ms",
        "nominal_p95_tpot_ms",
    }
)
"""Metrics only a capacity search measures: a study with one of them runs capacity trials."""
_NEEDS_SLOS: Final[frozenset[str]] = frozenset(
    {"request_goodput", "good_completed", "capacity_scale", "capacity_rps", "capacity_output_tps"}
)
_DIRECTION_WORDS: Final[dict[str, Direction]] = {
    "min": "minimize",
    "minimize": "minimize",
    "max": "maximize",
    "maximize": "maximize",
}
_PERCENTILE_RE: Final[re.Pattern[str]] = re.compile(r"^p(?P<p>[0-9]+(?:\.[0-9]+)?)_")
# Listed in messages (every pNN_ percentile is valid too).
_COMMON_METRICS: Final[tuple[str, ...]] = (
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p95_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "p95_tpot_ms",
    "p99_tpot_ms",
    "mean_tpot_ms",
    "p95_itl_ms",
    "p99_itl_ms",
    "p95_e2el_ms",
    "p99_e2el_ms",
    "mean_e2el_ms",
    "p95_ttft_from_scheduled_ms",
    "output_throughput",
    "request_throughput",
    "total_token_throughput",
    "request_goodput",
    "error_rate",
    "capacity_rps",
    "capacity_output_tps",
    "nominal_p95_ttft_ms",
    "nominal_p95_tpot_ms",
)
_VALID_METRICS: Final[str] = (
    "valid metrics are summary keys such as "
    + ", ".join(_COMMON_METRICS)
    + " (any pNN_ / mean_ / median_ / std_ of ttft, tpot, itl, e2el, ttft_from_scheduled)"
)


@dataclass(frozen=True, slots=True)
class Objective:
    """One value a study optimizes.

    Attributes:
        metric: A key of the summary, e.g. ``"p95_ttft_ms"``.
        direction: ``"minimize"`` or ``"maximize"``.
        worst: The value a failed or unmeasured trial gets; by default 1e9 for a minimized
            metric (1.0 for ``error_rate``) and 0.0 for a maximized one.

    Raises:
        ObjectiveError: Unknown metric, unknown direction, a direction that makes no sense
            for the metric (maximizing a latency), or a non-finite worst case.
    """

    metric: str
    direction: Direction
    worst: float = math.nan

    def __post_init__(self) -> None:
        if self.direction not in ("minimize", "maximize"):
            raise ObjectiveError(
                f"objective {self.metric!r}: direction must be 'minimize' or 'maximize', "
                f"not {self.direction!r}"
            )
        if not is_summary_key(self.metric):
            raise ObjectiveError(_unknown_metric(self.metric))
        natural: Direction = "maximize" if self.metric in _MAXIMIZED else "minimize"
        if self.direction != natural:
            verb = "min" if natural == "minimize" else "max"
            raise ObjectiveError(
                f"objective {self.metric!r}: it makes no sense to {self.direction} it; "
                f"write {verb}:{self.metric}"
            )
        if math.isnan(self.worst):
            default = (
                _BOUNDED_WORST.get(self.metric, WORST_MINIMIZE)
                if self.direction == "minimize"
                else 0.0
            )
            object.__setattr__(self, "worst", default)
        elif not math.isfinite(self.worst):
            raise ObjectiveError(f"objective {self.metric!r}: worst must be finite")

    def __str__(self) -> str:
        return f"{self.direction[:3]}:{self.metric}"

    def value(self, summary: Mapping[str, float]) -> float:
        """This objective's value in a summary; NaN or infinite becomes :attr:`worst`.

        Args:
            summary: A summary from :func:`objectives.summarize`.

        Returns:
            A finite value for Optuna.

        Raises:
            KeyError: The summary lacks the metric (a percentile summarize was not asked for).
        """
        try:
            value = float(summary[self.metric])
        except KeyError:
            raise KeyError(
                f"objective {self}: the summary has no {self.metric!r}; ask summarize() for "
                "that percentile (see ObjectiveSet.percentiles)"
            ) from None
        return value if math.isfinite(value) else self.worst


@dataclass(frozen=True, slots=True)
class ObjectiveSet:
    """The objectives of a study and its SLOs.

    Attributes:
        objectives: One or more objectives, distinct metrics, in Optuna's order.
        slos: Constraints; a trial is feasible when every margin is <= 0.

    Raises:
        ObjectiveError: No objective, a repeated metric, or a goodput objective without SLOs.
    """

    objectives: tuple[Objective, ...]
    slos: tuple[Slo, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.objectives:
            raise ObjectiveError("a study needs at least one objective, e.g. min:p95_ttft_ms")
        metrics = [o.metric for o in self.objectives]
        repeated = sorted({m for m in metrics if metrics.count(m) > 1})
        if repeated:
            raise ObjectiveError(f"objective metric listed twice: {', '.join(repeated)}")
        needing = [m for m in metrics if m in _NEEDS_SLOS]
        if needing and not self.slos:
            raise ObjectiveError(
                f"objective {needing[0]!r} counts what is served within the SLOs, but no SLO "
                "is given; add one, e.g. p95_ttft_ms<=500 and p95_tpot_ms<=50"
            )
        capacity = [m for m in metrics if m in CAPACITY_METRICS]
        if capacity and not any(_bounds_queueing(s) for s in self.slos):
            raise ObjectiveError(
                f"objective {capacity[0]!r} searches the highest load at which the SLOs hold, "
                "but no SLO bounds the time a request waits (TTFT or E2EL): a server that "
                "queues requests for minutes would still meet "
                + ", ".join(str(s) for s in self.slos)
                + " at any load. Add one, e.g. p95_ttft_ms<=2000"
            )

    @property
    def is_capacity(self) -> bool:
        """True when an objective is only measured by a capacity search."""
        return any(o.metric in CAPACITY_METRICS for o in self.objectives)

    @property
    def directions(self) -> list[str]:
        """Directions for ``optuna.create_study(directions=...)``."""
        return [o.direction for o in self.objectives]

    @property
    def metrics(self) -> list[str]:
        """The objectives' summary keys, in order."""
        return [o.metric for o in self.objectives]

    def percentiles(self) -> tuple[float, ...]:
        """Percentiles summarize() must report for these objectives and SLOs.

        Returns:
            :data:`~objectives.metrics.DEFAULT_PERCENTILES` plus any other ``pNN_`` used.
        """
        wanted = list(DEFAULT_PERCENTILES)
        for name in (*self.metrics, *(s.metric for s in self.slos)):
            match = _PERCENTILE_RE.match(name)
            if match is not None:
                wanted.append(float(match["p"]))
        return tuple(sorted(dict.fromkeys(wanted)))

    def values(self, summary: Mapping[str, float]) -> list[float]:
        """Objective values of a measured trial, NaN replaced by each objective's worst case.

        Args:
            summary: A summary from :func:`objectives.summarize`.

        Returns:
            One finite value per objective.

        Raises:
            KeyError: The summary lacks an objective's metric.
        """
        return [o.value(summary) for o in self.objectives]

    def worst(self) -> list[float]:
        """Objective values for a trial that measured nothing (engine failed)."""
        return [o.worst for o in self.objectives]

    def constraints(self, summary: Mapping[str, float]) -> list[float]:
        """Constraint values in Optuna's convention (<= 0 met), one per SLO.

        Args:
            summary: A summary from :func:`objectives.summarize` (with the SLOs passed to it
                when one is on ``request_goodput``).

        Returns:
            :meth:`Slo.margin` of each SLO; empty without SLOs.

        Raises:
            KeyError: The summary lacks an SLO's metric.
        """
        return [slo.margin(summary) for slo in self.slos]

    def failed_constraints(self) -> list[float]:
        """Constraint values for a trial that measured nothing: every SLO violated."""
        return [FAILED_CONSTRAINT] * len(self.slos)


def _bounds_queueing(slo: Slo) -> bool:
    """True for an upper bound on a latency that includes queueing (TTFT, E2EL)."""
    return slo.op in ("<=", "<") and slo.per_request_metric in (
        "ttft_ms",
        "e2el_ms",
        "ttft_from_scheduled_ms",
    )


def _objectives(*specs: tuple[str, Direction]) -> tuple[Objective, ...]:
    return tuple(Objective(metric, direction) for metric, direction in specs)


OBJECTIVE_PRESETS: Final[Mapping[str, tuple[Objective, ...]]] = {
    "default": _objectives(
        ("p95_ttft_ms", "minimize"),
        ("p95_tpot_ms", "minimize"),
        ("output_throughput", "maximize"),
    ),
    "latency": _objectives(("p95_ttft_ms", "minimize"), ("p95_tpot_ms", "minimize")),
    "throughput": _objectives(("output_throughput", "maximize"), ("p95_ttft_ms", "minimize")),
    "goodput": _objectives(("request_goodput", "maximize")),
    "capacity": _objectives(("capacity_rps", "maximize")),
    "capacity-latency": _objectives(
        ("capacity_rps", "maximize"),
        ("nominal_p95_ttft_ms", "minimize"),
        ("nominal_p95_tpot_ms", "minimize"),
    ),
}
"""Named objective lists; ``goodput``, ``capacity`` and ``capacity-latency`` need SLOs."""


def parse_objective(text: str) -> Objective:
    """Parse ``"min:p95_ttft_ms"`` or ``"max:output_throughput"`` into an :class:`Objective`.

    ``minimize:`` / ``maximize:`` are accepted too; spaces around the colon are ignored.

    Args:
        text: The objective string.

    Returns:
        The objective, with its default worst case.

    Raises:
        ObjectiveError: Not ``DIRECTION:METRIC``, or an unknown metric; the message lists the
            valid forms and metrics.
    """
    direction_word, colon, metric = (part.strip() for part in text.partition(":"))
    if not colon or not metric:
        raise ObjectiveError(
            f"cannot parse objective {text!r}: write min:METRIC or max:METRIC, e.g. "
            f"min:p95_ttft_ms or max:output_throughput; {_VALID_METRICS}"
        )
    direction = _DIRECTION_WORDS.get(direction_word.lower())
    if direction is None:
        raise ObjectiveError(
            f"objective {text!r}: direction {direction_word!r} is not min or max "
            "(e.g. min:p95_ttft_ms)"
        )
    if not is_summary_key(metric):
        raise ObjectiveError(f"objective {text!r}: {_unknown_metric(metric)}")
    return Objective(metric, direction)


def load_objectives(
    preset: str | None,
    objectives: Sequence[str] | None,
    slos: Sequence[str],
) -> ObjectiveSet:
    """Build a study's objectives and SLOs from a job's settings.

    Explicit ``objectives`` win over ``preset``; with neither, the ``default`` preset.

    Args:
        preset: A name of :data:`OBJECTIVE_PRESETS`, or None.
        objectives: Objective strings such as ``"min:p95_ttft_ms"``, or None.
        slos: SLO strings such as ``"p95_ttft_ms<=500"``.

    Returns:
        The objective set.

    Raises:
        ObjectiveError: Unknown preset or metric, malformed string, repeated metric, or a
            goodput objective without SLOs.
        SloError: A malformed SLO (also a :class:`~optimizer.errors.ConfigError`).
    """
    parsed_slos = tuple(parse_slo(text) for text in slos)
    if objectives:
        chosen = tuple(parse_objective(text) for text in objectives)
    else:
        name = preset or "default"
        if name not in OBJECTIVE_PRESETS:
            close = difflib.get_close_matches(name, list(OBJECTIVE_PRESETS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ObjectiveError(
                f"unknown objective preset {name!r}; {hint}valid: "
                f"{', '.join(OBJECTIVE_PRESETS)} (or list objectives like min:p95_ttft_ms)"
            )
        chosen = OBJECTIVE_PRESETS[name]
    return ObjectiveSet(objectives=chosen, slos=parsed_slos)


def _unknown_metric(metric: str) -> str:
    close = difflib.get_close_matches(metric, _COMMON_METRICS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown metric {metric!r}; {hint}{_VALID_METRICS}"
