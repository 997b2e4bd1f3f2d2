"""Pure scoring: metrics from request records, objectives and SLO constraints.

Nothing here does I/O or imports ray, mlflow, vllm or torch.
"""

from objectives.metrics import DEFAULT_PERCENTILES, LATENCY_METRICS, percentile_key, summarize
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
    "DEFAULT_PERCENTILES",
    "LATENCY_METRICS",
    "PER_REQUEST_METRICS",
    "SLO_OPS",
    "UNMEASURED_MARGIN",
    "Slo",
    "SloError",
    "is_summary_key",
    "parse_slo",
    "percentile_key",
    "summarize",
]
