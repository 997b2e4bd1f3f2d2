"""Pure scoring: metrics from request records, objectives and SLO constraints.

Nothing here does I/O or imports ray, mlflow, vllm or torch.
"""

from objectives.early_stop import (
    EarlyStopper,
    Observations,
    decidable,
    hopeless,
    misses_to_break,
)
from objectives.metrics import DEFAULT_PERCENTILES, LATENCY_METRICS, percentile_key, summarize
from objectives.presets import (
    CAPACITY_METRICS,
    FAILED_CONSTRAINT,
    OBJECTIVE_PRESETS,
    WORST_MINIMIZE,
    Direction,
    Objective,
    ObjectiveError,
    ObjectiveSet,
    load_objectives,
    parse_objective,
)
from objectives.slo import (
    PER_REQUEST_METRICS,
    SLO_OPS,
    UNMEASURED_MARGIN,
    Slo,
    SloError,
    is_summary_key,
    parse_slo,
)

__all__ = [
    "CAPACITY_METRICS",
    "DEFAULT_PERCENTILES",
    "FAILED_CONSTRAINT",
    "LATENCY_METRICS",
    "OBJECTIVE_PRESETS",
    "PER_REQUEST_METRICS",
    "SLO_OPS",
    "UNMEASURED_MARGIN",
    "WORST_MINIMIZE",
    "Direction",
    "EarlyStopper",
    "Objective",
    "ObjectiveError",
    "ObjectiveSet",
    "Observations",
    "Slo",
    "SloError",
    "decidable",
    "hopeless",
    "is_summary_key",
    "load_objectives",
    "misses_to_break",
    "parse_objective",
    "parse_slo",
    "percentile_key",
    "summarize",
]
