"""Serving metrics derived from raw request records, as ``vllm bench serve`` defines them.

:func:`summarize` turns the :class:`~optimizer.types.RequestRecord` list of one replay into a flat
``{key: float}`` summary with vLLM's key names (``p95_ttft_ms``, ``mean_tpot_ms``,
``output_throughput``, ...), so a trial's numbers can be cross-checked against
``vllm bench serve`` on the same server. It adds what an open-loop replay needs on top: TTFT
measured from the *scheduled* arrival (client lag cannot hide there), the send lag of the
replayer itself, the error rate and goodput under SLOs. It is pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Final

import numpy as np

from optimizer.types import RequestRecord

if TYPE_CHECKING:
    from objectives.slo import Slo

__all__ = [
    "DEFAULT_PERCENTILES",
    "LATENCY_METRICS",
    "percentile_key",
    "summarize",
]

DEFAULT_PERCENTILES: Final[tuple[float, ...]] = (50, 90, 95, 99)
"""Percentiles reported for every latency, as ``--metric-percentiles 50,90,95,99``."""

LATENCY_METRICS: Final[tuple[str, ...]] = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "ttft_from_scheduled",
    "send_lag",
)
"""Families reported as ``mean_``/``median_``/``std_``/``pNN_`` + family + ``_ms``."""

# The replay is judged invalid on p99 send lag, so it is reported whatever was asked.
_SEND_LAG_PERCENTILES: Final[tuple[float, ...]] = (50, 99)
_MS_PER_S: Final[float] = 1000.0


def percentile_key(percentile: float, metric: str) -> str:
    """Name a percentile key the way vLLM does: ``p95_ttft_ms``, ``p99.9_itl_ms``.

    Args:
        percentile: The percentile, 0 to 100.
        metric: The family, e.g. ``"ttft"``.

    Returns:
        The summary key.
    """
    word = str(int(percentile)) if int(percentile) == percentile else str(percentile)
    return f"p{word}_{metric}_ms"


def summarize(
    records: Sequence[RequestRecord],
    *,
    slos: Sequence[Slo] = (),
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, float]:
    """Summarize one replay's records with ``vllm bench serve``'s definitions.

    Only records with ``warmup=False`` count (the measured window). A request succeeded when
    it has no ``error`` and received a first token; the others count as ``failed``. Over the
    successful requests, with all times in seconds on the replay clock:

    - TTFT = ``first_token_s - sent_s``; TTFT from scheduled = ``first_token_s - scheduled_s``.
    - E2EL = last token chunk (``chunk_times_s[-1]``, else ``end_s``) - ``sent_s``.
    - TPOT = (E2EL - TTFT) / (``output_tokens`` - 1), only for ``output_tokens > 1``.
    - ITL = gaps between consecutive ``chunk_times_s``, pooled over requests.

    Send lag = ``sent_s - scheduled_s`` over every measured request, failed ones included.
    Duration runs from the first scheduled send to the last ``end_s`` of the measured window;
    throughputs divide successful requests and their tokens by it.

    Each latency family (see :data:`LATENCY_METRICS`) gets ``mean_``, ``median_``, ``std_``
    (population) and one ``pNN_`` key per percentile (``numpy.percentile``, linear), in ms.
    Send lag always includes p50 and p99 and adds ``max_send_lag_ms``.

    Scalar keys: ``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``
    (of successful requests), ``duration_s``, ``request_throughput`` (req/s),
    ``output_throughput`` and ``total_token_throughput`` (tok/s), ``error_rate``
    (failed / (completed + failed)). With ``slos``, also ``good_completed`` and
    ``request_goodput`` (req/s): successful requests whose own TTFT / TPOT / E2EL / TTFT from
    scheduled meet every SLO on those metrics (see :attr:`Slo.per_request_metric`; a request
    with one output token has TPOT 0 there, as in vLLM). SLOs on other keys do not restrict
    goodput.

    Never raises on degenerate input: with no successful request (empty input, all failed)
    the counts are 0, throughputs and goodput are 0.0 and every latency key is NaN (vLLM
    reports 0 there, which would look like a perfect latency to an optimizer). ``error_rate``
    is NaN when nothing was measured, and the send-lag keys are NaN only then.

    Args:
        records: Records of one replay, in any order.
        slos: SLOs whose per-request metrics define goodput.
        percentiles: Percentiles to report, each between 0 and 100.

    Returns:
        The summary, keys as listed above.

    Raises:
        ValueError: A percentile is outside [0, 100] (a programming error).
    """
    wanted = _checked_percentiles(percentiles)
    measured = [r for r in records if not r.warmup]
    succeeded = [r for r in measured if r.ok and r.first_token_s is not None]
    n_failed = len(measured) - len(succeeded)

    ttfts_s: list[float] = []
    ttfts_from_scheduled_s: list[float] = []
    e2els_s: list[float] = []
    tpots_s: list[float] = []
    itls_s: list[float] = []
    goodput_tpots_s: list[float] = []
    for record in succeeded:
        assert record.first_token_s is not None  # filtered above; narrows the type
        ttft_s = record.first_token_s - record.sent_s
        last_token_s = record.chunk_times_s[-1] if record.chunk_times_s else record.end_s
        e2el_s = last_token_s - record.sent_s
        ttfts_s.append(ttft_s)
        ttfts_from_scheduled_s.append(record.first_token_s - record.scheduled_s)
        e2els_s.append(e2el_s)
        tpot_s = 0.0
        if record.output_tokens > 1:
            tpot_s = (e2el_s - ttft_s) / (record.output_tokens - 1)
            tpots_s.append(tpot_s)
        goodput_tpots_s.append(tpot_s)
        itls_s.extend(later - earlier for earlier, later in pairwise(record.chunk_times_s))

    duration_s = 0.0
    if measured:
        duration_s = max(r.end_s for r in measured) - min(r.scheduled_s for r in measured)
        duration_s = max(duration_s, 0.0)
    total_input = sum(r.input_tokens for r in succeeded)
    total_output = sum(r.output_tokens for r in succeeded)

    summary: dict[str, float] = {
        "completed": len(succeeded),
        "failed": n_failed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "duration_s": duration_s,
        "request_throughput": _rate(len(succeeded), duration_s),
        "output_throughput": _rate(total_output, duration_s),
        "total_token_throughput": _rate(total_input + total_output, duration_s),
        "error_rate": n_failed / len(measured) if measured else math.nan,
    }
    if slos:
        per_request = {
            "ttft_ms": ttfts_s,
            "tpot_ms": goodput_tpots_s,
            "e2el_ms": e2els_s,
            "ttft_from_scheduled_ms": ttfts_from_scheduled_s,
        }
        bounded = [(slo, per_request[name]) for slo in slos if (name := slo.per_request_metric)]
        good = sum(
            all(slo.holds(values_s[i] * _MS_PER_S) for slo, values_s in bounded)
            for i in range(len(succeeded))
        )
        summary["good_completed"] = good
        summary["request_goodput"] = _rate(good, duration_s)

    _add_stats(summary, "ttft", ttfts_s, wanted)
    _add_stats(summary, "tpot", tpots_s, wanted)
    _add_stats(summary, "itl", itls_s, wanted)
    _add_stats(summary, "e2el", e2els_s, wanted)
    _add_stats(summary, "ttft_from_scheduled", ttfts_from_scheduled_s, wanted)
    send_lags_s = [r.sent_s - r.scheduled_s for r in measured]
    _add_stats(summary, "send_lag", send_lags_s, _merged(wanted, _SEND_LAG_PERCENTILES))
    summary["max_send_lag_ms"] = max(send_lags_s) * _MS_PER_S if send_lags_s else math.nan
    return summary


def _checked_percentiles(percentiles: Sequence[float]) -> tuple[float, ...]:
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p!r} is outside [0, 100]")
    return tuple(dict.fromkeys(percentiles))


def _merged(first: tuple[float, ...], extra: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(dict.fromkeys((*first, *extra)))


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def _add_stats(
    summary: dict[str, float], metric: str, values_s: list[float], percentiles: tuple[float, ...]
) -> None:
    # Statistics are taken in seconds and scaled afterwards, exactly as vLLM does, so the two
    # agree to the last bit on the same samples.
    if not values_s:
        summary[f"mean_{metric}_ms"] = math.nan
        summary[f"median_{metric}_ms"] = math.nan
        summary[f"std_{metric}_ms"] = math.nan
        for p in percentiles:
            summary[percentile_key(p, metric)] = math.nan
        return
    values = np.asarray(values_s, dtype=np.float64)
    summary[f"mean_{metric}_ms"] = float(np.mean(values)) * _MS_PER_S
    summary[f"median_{metric}_ms"] = float(np.median(values)) * _MS_PER_S
    summary[f"std_{metric}_ms"] = float(np.std(values)) * _MS_PER_S
    for p in percentiles:
        summary[percentile_key(p, metric)] = float(np.percentile(values, p)) * _MS_PER_S
