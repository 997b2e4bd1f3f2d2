"""Re-validate a chosen configuration: it and the baseline run again, alternating.

A "best" configuration measured once is often not the best once deployed (noise, arrival
order): the chosen configuration and the baseline run N times each with fresh prompts on the
same hardware; the median and spread of each objective and the gain over the baseline with its
range are reported, and an export is refused when the gain is within the noise or an SLO fails
on a re-run (unless forced).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.study import StudyDirection

from optimizer.errors import ConfigError
from optimizer.types import TrialResult, TrialSpec, TrialStatus

__all__ = ["Validation", "primary_metrics", "validate_choice"]


@dataclass
class Validation:
    """Re-measurements of the chosen configuration and the baseline.

    Attributes:
        metrics: Objective names.
        directions: Their directions.
        chosen: Per objective, the values of the chosen configuration's runs.
        baseline: Per objective, the baseline's values.
        slo_failures: Runs of the chosen configuration that missed an SLO (or failed).
        slo_met: Per label (``chosen``, ``baseline``), whether each measured run met every SLO.
    """

    metrics: list[str]
    directions: list[StudyDirection]
    chosen: dict[str, list[float]] = field(default_factory=dict)
    baseline: dict[str, list[float]] = field(default_factory=dict)
    slo_failures: list[str] = field(default_factory=list)
    slo_met: dict[str, list[bool]] = field(default_factory=lambda: {"chosen": [], "baseline": []})

    def slo_win(self) -> bool:
        """True when the chosen configuration met the SLOs in every re-run and the baseline in
        none: a separation no noise explains, whatever the objectives' medians say."""
        chosen, base = self.slo_met["chosen"], self.slo_met["baseline"]
        return bool(chosen) and bool(base) and all(chosen) and not any(base)

    def gain_pct(self, metric: str) -> tuple[float, float, float]:
        """Median gain over the baseline and its range (worst, best), in percent."""
        d = self.directions[self.metrics.index(metric)]
        sign = -1.0 if d == StudyDirection.MINIMIZE else 1.0
        base = statistics.median(self.baseline[metric])
        if base == 0:
            return (math.nan, math.nan, math.nan)

        def g(v: float, b: float) -> float:
            # One baseline run at 0 (its median is not): that bound of the range is unknown.
            return sign * (v - b) / abs(b) * 100.0 if b != 0 else math.nan

        med = g(statistics.median(self.chosen[metric]), base)
        # The range pits the chosen's worst run against the baseline's best, and vice versa.
        worst_c = max(self.chosen[metric]) if sign < 0 else min(self.chosen[metric])
        best_c = min(self.chosen[metric]) if sign < 0 else max(self.chosen[metric])
        worst_b = max(self.baseline[metric]) if sign < 0 else min(self.baseline[metric])
        best_b = min(self.baseline[metric]) if sign < 0 else max(self.baseline[metric])
        return med, g(worst_c, best_b), g(best_c, worst_b)

    def within_noise(self, metric: str, min_gain_pct: float = 1.0) -> bool:
        """True when the re-runs do not separate the two: the gain's worst pairing (the
        chosen's worst run against the baseline's best) is below ``min_gain_pct``. A gain must
        be both real and worth deploying; a consistent 0.05% is neither."""
        _med, low, _high = self.gain_pct(metric)
        return not low > min_gain_pct

    def problems(self, primary: Sequence[str]) -> list[str]:
        """Why an export should be refused: no primary objective gained beyond the noise of
        the re-runs (a load-bound objective that cannot move does not veto a real gain
        elsewhere), or an SLO failed on a re-run. Empty when the export may go ahead."""
        out = []
        if all(self.within_noise(m) for m in primary):
            # Meeting SLOs the baseline always missed is a gain of its own, unless it was paid
            # for with a primary objective that got worse in every pairing.
            worse = [m for m in primary if self.gain_pct(m)[2] < -1.0]
            if not self.slo_win():
                out.append(f"the gain on {', '.join(primary)} is within the noise of the re-runs")
            elif worse:
                out.append(
                    "the SLOs are met where the baseline missed them, but "
                    + ", ".join(f"{m} is worse in every pairing" for m in worse)
                )
        if self.slo_failures:
            out.append("SLOs failed on re-run: " + "; ".join(self.slo_failures))
        return out

    def gain_text(self) -> str:
        """One line for export headers: each objective's median gain and its range."""
        runs = min(len(v) for v in self.chosen.values())

        def one(r: dict[str, Any]) -> str:
            if r["baseline_median"] == 0 and not math.isfinite(r["gain_pct"]):
                # A capacity of 0 (or any zero baseline) has no percentage: say the values.
                lo, hi = r["chosen_range"]
                return f"{r['metric']} {r['chosen_median']:.3g} ({lo:.3g}..{hi:.3g}) vs 0"
            return "{} {:+.1f}% ({:+.1f}%..{:+.1f}%)".format(
                r["metric"], r["gain_pct"], *r["gain_range_pct"]
            )

        return (
            "; ".join(one(r) for r in self.table())
            + f" vs baseline, {runs} re-runs each"
            + (
                f"; SLOs met in {sum(self.slo_met['chosen'])}/{len(self.slo_met['chosen'])}"
                f" re-runs (baseline {sum(self.slo_met['baseline'])}"
                f"/{len(self.slo_met['baseline'])})"
                # Only news when some run missed them (a study without SLOs meets them all).
                if not all(self.slo_met["chosen"] + self.slo_met["baseline"])
                else ""
            )
        )

    def table(self) -> list[dict[str, Any]]:
        """Rows for display: medians, spreads and gains."""
        rows = []
        for m in self.metrics:
            med, low, high = self.gain_pct(m)
            rows.append(
                {
                    "metric": m,
                    "baseline_median": statistics.median(self.baseline[m]),
                    "baseline_range": [min(self.baseline[m]), max(self.baseline[m])],
                    "chosen_median": statistics.median(self.chosen[m]),
                    "chosen_range": [min(self.chosen[m]), max(self.chosen[m])],
                    "gain_pct": med,
                    "gain_range_pct": [low, high],
                }
            )
        return rows


_PRIMARY = {
    "max-throughput": "output_throughput",
    "max-capacity": "capacity_rps",
    "min-ttft": "p95_ttft_ms",
    "min-tpot": "p95_tpot_ms",
}


def primary_metrics(policy: str, metrics: Sequence[str]) -> list[str]:
    """The objectives a policy's choice must improve: its own one, else all of them."""
    own = _PRIMARY.get(policy)
    return [own] if own is not None and own in metrics else list(metrics)


def validate_choice(
    run: Callable[[TrialSpec], TrialResult],
    make_spec: Callable[[str, dict[str, Any], int], TrialSpec],
    chosen_args: dict[str, Any],
    baseline_args: dict[str, Any],
    *,
    metrics: list[str],
    directions: list[StudyDirection],
    values: Callable[[Mapping[str, float]], list[float]],
    feasible: Callable[[Mapping[str, float]], bool],
    runs: int = 3,
    retries: int = 2,
    progress: Callable[[str], None] | None = None,
) -> Validation:
    """Re-run the chosen configuration and the baseline ``runs`` times each, alternating.

    Args:
        run: Runs one trial spec to completion (a runner's submit + wait, or run_trial).
        make_spec: (label, engine args, run index) -> spec with a fresh seed.
        chosen_args: The chosen configuration.
        baseline_args: The baseline configuration.
        metrics: Objective names.
        directions: Their directions.
        values: Summary -> objective values.
        feasible: Summary -> all SLOs met.
        runs: Re-runs of each.
        retries: Extra attempts for a run whose replay could not keep its schedule.
        progress: Called with a line per finished run.
    """
    val = Validation(
        metrics=metrics,
        directions=directions,
        chosen={m: [] for m in metrics},
        baseline={m: [] for m in metrics},
    )
    for k in range(runs):
        # Alternate so slow drift of the machine hits both alike.
        for label, args, bucket in (
            ("baseline", baseline_args, val.baseline),
            ("chosen", chosen_args, val.chosen),
        ):
            # A replay the client could not keep on schedule is re-run, never scored (as in
            # the study); each attempt gets fresh prompts.
            for attempt in range(retries + 1):
                result = run(make_spec(label, args, k + 100 * attempt))
                if result.status is not TrialStatus.INVALID_REPLAY:
                    break
            ok = result.status is TrialStatus.COMPLETE
            if ok:
                for m, v in zip(metrics, values(result.summary), strict=True):
                    bucket[m].append(v)
                val.slo_met[label].append(bool(feasible(result.summary)))
            if label == "chosen" and (not ok or not feasible(result.summary)):
                val.slo_failures.append(
                    f"run {k + 1}: {result.status.value}"
                    + (f" ({result.failure_class.value})" if result.failure_class else "")
                    + ("" if not ok else ": an SLO was missed")
                )
            if progress:
                progress(f"{label} run {k + 1}/{runs}: {result.status.value}")
    missing = [m for m in metrics if not val.chosen[m] or not val.baseline[m]]
    if missing:
        raise ConfigError(f"re-validation measured nothing for {missing}: see the trial logs")
    return val
