"""Decide, while a replay runs, that its SLOs can no longer be met, so the trial can stop early.

A configuration that is hopeless after a third of the trace need not be replayed to the end:
the study records it as ``infeasible`` and moves on. The decision must never stop a trial that
could still meet its SLOs, so it only counts requests that *certainly* miss a threshold: a
completed request whose latency exceeds it, or one still in flight that has already waited
longer than the threshold (its TTFT or E2EL can only grow).

For ``pXX_<metric>_ms <= T`` over ``n`` measured requests: the percentile is taken (numpy,
linear) over the successful ones, at most ``m = n - failed``. Once ``k`` of them exceed ``T``
with ``k >= m - floor((m - 1) * XX / 100)``, the sample at the percentile's lower index already
exceeds ``T``, whatever the others turn out to be. That is "more than (100 - XX)% of the
expected requests", made exact for numpy's interpolation: for P95 of 100 requests, 6 misses.
For ``error_rate <= x``: hopeless once ``failed > x * n``. For ``completed >= c``: once
``n - failed < c``. SLOs that cannot be decided early (means, throughput, ITL, ...) are ignored.

Each check is one pass over the observations per decidable SLO (O(n)), with the rules compiled
once per replay by :class:`EarlyStopper`, so it can run a few times per second.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from objectives.slo import Slo
from optimizer.types import RequestRecord

__all__ = ["EarlyStopper", "Observations", "decidable", "hopeless", "misses_to_break"]

_MS_PER_S: Final[float] = 1000.0
_PERCENTILE_RE: Final[re.Pattern[str]] = re.compile(
    r"^(?:p(?P<p>[0-9]+(?:\.[0-9]+)?)|(?P<median>median))_(?P<family>ttft|tpot|e2el)_ms$"
)
_FAMILY_WORDS: Final[dict[str, str]] = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2EL"}


@dataclass(frozen=True, slots=True)
class Observations:
    """What a running replay has seen of its measured (non-warm-up) requests.

    Attributes:
        ttft_ms: TTFT of every request whose first token arrived (completed or streaming).
        tpot_ms: TPOT of completed requests with more than one output token.
        e2el_ms: E2EL of completed requests.
        failed: Measured requests that failed.
        waiting_ms: For in-flight requests still waiting for their first token: time since
            send (a lower bound on their TTFT and E2EL).
        in_flight_ms: For the other in-flight requests (streaming, or first token unknown):
            time since send (a lower bound on their E2EL only).
    """

    ttft_ms: Sequence[float] = ()
    tpot_ms: Sequence[float] = ()
    e2el_ms: Sequence[float] = ()
    failed: int = 0
    waiting_ms: Sequence[float] = ()
    in_flight_ms: Sequence[float] = ()

    @classmethod
    def from_records(
        cls,
        finished: Iterable[RequestRecord],
        *,
        now_s: float,
        in_flight_sent_s: Iterable[float] = (),
        waiting_sent_s: Iterable[float] = (),
    ) -> Observations:
        """Build observations from finished records and in-flight send times.

        Warm-up records are skipped; TTFT, TPOT and E2EL are computed as in
        :func:`objectives.summarize`. The caller passes only measured in-flight requests.

        Args:
            finished: Records of requests that finished so far.
            now_s: The replay clock now.
            in_flight_sent_s: Send times of in-flight requests whose first token arrived, or
                whose state is unknown.
            waiting_sent_s: Send times of in-flight requests known to have no first token.

        Returns:
            The observations.
        """
        ttft: list[float] = []
        tpot: list[float] = []
        e2el: list[float] = []
        failed = 0
        for record in finished:
            if record.warmup:
                continue
            if not record.ok or record.first_token_s is None:
                failed += 1
                continue
            ttft_s = record.first_token_s - record.sent_s
            last_s = record.chunk_times_s[-1] if record.chunk_times_s else record.end_s
            e2el_s = last_s - record.sent_s
            ttft.append(ttft_s * _MS_PER_S)
            e2el.append(e2el_s * _MS_PER_S)
            if record.output_tokens > 1:
                tpot.append((e2el_s - ttft_s) / (record.output_tokens - 1) * _MS_PER_S)
        return cls(
            ttft_ms=ttft,
            tpot_ms=tpot,
            e2el_ms=e2el,
            failed=failed,
            waiting_ms=[(now_s - s) * _MS_PER_S for s in waiting_sent_s],
            in_flight_ms=[(now_s - s) * _MS_PER_S for s in in_flight_sent_s],
        )


def misses_to_break(percentile: float, successful: int) -> int:
    """How many of ``successful`` samples above a threshold put the percentile above it.

    With numpy's linear percentile over ``m`` samples, the value lies between the samples at
    sorted indices ``floor(h)`` and ``ceil(h)``, ``h = (m - 1) * percentile / 100``; it
    certainly exceeds the threshold once the sample at ``floor(h)`` does, that is once
    ``m - floor(h)`` samples do.

    Args:
        percentile: 0 to 100.
        successful: The number of samples, ``m`` (>= 0).

    Returns:
        The smallest count of misses that decides the percentile (``0`` for ``m = 0``).
    """
    if successful <= 0:
        return 0
    # Same float operations as numpy's virtual index, so the two agree at exact boundaries.
    return successful - math.floor(percentile / 100.0 * (successful - 1))


def decidable(slo: Slo) -> bool:
    """Tell whether :func:`hopeless` can decide ``slo`` before the replay ends.

    Args:
        slo: An SLO.

    Returns:
        True for upper bounds on a TTFT / TPOT / E2EL percentile or median, upper bounds on
        ``error_rate`` or ``failed``, and lower bounds on ``completed``.
    """
    return _rule(slo) is not None


def hopeless(slos: Sequence[Slo], expected: int, observations: Observations) -> str | None:
    """Tell whether a running replay can no longer meet its SLOs.

    Args:
        slos: The study's SLOs; those that cannot be decided early are ignored.
        expected: Measured (non-warm-up) requests the replay will send.
        observations: What it has seen so far.

    Returns:
        None while every SLO can still be met; otherwise one sentence naming the first SLO
        that cannot and why.
    """
    for slo in slos:
        rule = _rule(slo)
        if rule is not None:
            reason = rule(expected, observations)
            if reason is not None:
                return reason
    return None


class EarlyStopper:
    """:func:`hopeless` with its SLOs and expected count fixed for one replay.

    Args:
        slos: The study's SLOs.
        expected: Measured (non-warm-up) requests the replay will send (>= 0).

    Raises:
        ValueError: ``expected`` is negative.
    """

    def __init__(self, slos: Sequence[Slo], expected: int) -> None:
        if expected < 0:
            raise ValueError(f"expected must be >= 0, got {expected}")
        self.expected = expected
        self.slos = tuple(slos)
        self._rules = [rule for slo in self.slos if (rule := _rule(slo)) is not None]

    def active(self) -> bool:
        """True when at least one SLO can be decided early (else checking is pointless)."""
        return bool(self._rules) and self.expected > 0

    def check(self, observations: Observations) -> str | None:
        """Return why the SLOs can no longer be met, or None.

        Args:
            observations: What the replay has seen so far.

        Returns:
            A reason, or None.
        """
        for rule in self._rules:
            reason = rule(self.expected, observations)
            if reason is not None:
                return reason
        return None


_Rule = Callable[[int, Observations], str | None]


def _rule(slo: Slo) -> _Rule | None:
    if slo.op not in ("<=", "<"):
        if slo.metric == "completed" and slo.op in (">=", ">"):
            return _completed_rule(slo)
        return None
    if slo.metric in ("error_rate", "failed"):
        return _failure_rule(slo)
    match = _PERCENTILE_RE.match(slo.metric)
    if match is None:
        return None
    percentile = 50.0 if match["median"] else float(match["p"])
    return _percentile_rule(slo, percentile, match["family"])


def _percentile_rule(slo: Slo, percentile: float, family: str) -> _Rule:
    threshold = slo.threshold
    strict = slo.op == "<"
    word = _FAMILY_WORDS[family]

    def count(values: Sequence[float]) -> int:
        # A value equal to T meets "<= T" but misses "< T".
        if strict:
            return sum(1 for v in values if v >= threshold)
        return sum(1 for v in values if v > threshold)

    def rule(expected: int, obs: Observations) -> str | None:
        successful = expected - obs.failed
        if successful <= 0:
            return None  # nothing left to measure: the error-rate SLOs decide this trial
        if family == "ttft":
            misses = count(obs.ttft_ms) + count(obs.waiting_ms)
        elif family == "tpot":
            misses = count(obs.tpot_ms)
        else:
            misses = count(obs.e2el_ms) + count(obs.waiting_ms) + count(obs.in_flight_ms)
        needed = misses_to_break(percentile, successful)
        if misses < needed:
            return None
        return (
            f"{slo} can no longer be met: {misses} of at most {successful} successful "
            f"requests already have {word} {'>=' if strict else '>'} {threshold:g} ms "
            f"({needed} put the {slo.metric.split('_')[0]} above it)"
        )

    return rule


def _failure_rule(slo: Slo) -> _Rule:
    # summarize() divides by the measured count, so the same division decides here.
    def rule(expected: int, obs: Observations) -> str | None:
        if expected <= 0:
            return None
        value = obs.failed / expected if slo.metric == "error_rate" else float(obs.failed)
        if slo.holds(value):
            return None
        return (
            f"{slo} can no longer be met: {obs.failed} of {expected} measured requests "
            "already failed"
        )

    return rule


def _completed_rule(slo: Slo) -> _Rule:
    def rule(expected: int, obs: Observations) -> str | None:
        best = expected - obs.failed
        if slo.holds(float(best)):
            return None
        return (
            f"{slo} can no longer be met: {obs.failed} of {expected} measured requests "
            f"failed, at most {best} can complete"
        )

    return rule
