"""What moved between the study and now: pure comparisons of recorded and re-measured figures.

A figure (an objective or an SLO's metric) of one configuration has *recorded* runs (the study's
trial, and the re-validation runs of the same configuration an export stored) and runs *now*.
It moved beyond the noise when the change of the medians exceeds the larger of

- the floor: ``min_change_pct`` of the recorded median (and a figure's own resolution, e.g. a
  capacity search's bracket width), or an absolute floor for figures near zero (error rate);
- twice the median absolute deviation of the recorded runs, and of the runs now.

The median absolute deviation is used rather than the range: one disturbed run among several
(a capacity of 0 while the machine was busy) widens a range until nothing can ever be told
apart, and barely moves the median deviation.

A configuration also regressed when it met every SLO in the study and meets them in no run
now, or when it no longer runs at all (every run failed).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ABS_FLOORS",
    "ConfigComparison",
    "FigureRow",
    "SloRow",
    "compare_figure",
    "compare_slos",
    "noise_band",
    "verdict",
]

#: Absolute floors of figures whose recorded value is often 0 (a relative floor of 0 is none).
ABS_FLOORS: Mapping[str, float] = {"error_rate": 0.01}

WORSE, BETTER, SAME, NA = "worse", "better", "within noise", "n/a"


def _finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def _mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return float(statistics.median(abs(v - med) for v in values))


def noise_band(
    recorded: Sequence[float],
    now: Sequence[float],
    *,
    floor_pct: float,
    abs_floor: float = 0.0,
) -> float:
    """The absolute change a figure must exceed to have moved (see the module docstring)."""
    ref = abs(statistics.median(recorded)) if recorded else 0.0
    return max(floor_pct / 100.0 * ref, abs_floor, 2 * _mad(recorded), 2 * _mad(now))


@dataclass(frozen=True)
class FigureRow:
    """One figure of one configuration, recorded vs now.

    Attributes:
        figure: Summary key (``capacity_rps``, ``p95_ttft_ms``, ...).
        direction: ``maximize`` or ``minimize`` (which way is better).
        recorded_runs: The recorded values (the study's first).
        now_runs: The values measured now.
        recorded: Median of the recorded runs (NaN: none).
        now: Median of the runs now (NaN: none).
        change_pct: ``now / recorded - 1`` in percent (NaN from 0 or without values).
        noise: The band the change of the medians must exceed, in the figure's units.
        noise_pct: The band relative to the recorded median (NaN from 0).
        moved: ``worse``, ``better``, ``within noise`` or ``n/a`` (nothing to compare).
    """

    figure: str
    direction: str
    recorded_runs: tuple[float, ...]
    now_runs: tuple[float, ...]
    recorded: float
    now: float
    change_pct: float
    noise: float
    noise_pct: float
    moved: str

    def doc(self) -> dict[str, Any]:
        """JSON-safe (NaN as None)."""
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            if isinstance(value, float):
                value = value if math.isfinite(value) else None
            elif isinstance(value, tuple):
                value = list(value)
            out[key] = value
        return out


def compare_figure(
    figure: str,
    direction: str,
    recorded_runs: Sequence[float],
    now_runs: Sequence[float],
    *,
    floor_pct: float = 5.0,
    abs_floor: float | None = None,
) -> FigureRow:
    """Compare one figure's recorded runs with its runs now (NaN and None values dropped).

    Raises:
        ValueError: An unknown direction or a negative floor.
    """
    if direction not in ("maximize", "minimize"):
        raise ValueError(f"direction must be maximize or minimize, got {direction!r}")
    if floor_pct < 0:
        raise ValueError(f"the floor must be >= 0 %, got {floor_pct}")
    rec, now = _finite(recorded_runs), _finite(now_runs)
    nan = math.nan
    if not rec or not now:
        med_rec = statistics.median(rec) if rec else nan
        med_now = statistics.median(now) if now else nan
        return FigureRow(
            figure, direction, tuple(rec), tuple(now), med_rec, med_now, nan, nan, nan, NA
        )
    med_rec, med_now = statistics.median(rec), statistics.median(now)
    band = noise_band(
        rec,
        now,
        floor_pct=floor_pct,
        abs_floor=ABS_FLOORS.get(figure, 0.0) if abs_floor is None else abs_floor,
    )
    delta = med_now - med_rec
    moved = SAME
    if abs(delta) > band:
        up_is_better = direction == "maximize"
        moved = BETTER if (delta > 0) == up_is_better else WORSE
    return FigureRow(
        figure=figure,
        direction=direction,
        recorded_runs=tuple(rec),
        now_runs=tuple(now),
        recorded=med_rec,
        now=med_now,
        change_pct=delta / abs(med_rec) * 100.0 if med_rec else nan,
        noise=band,
        noise_pct=band / abs(med_rec) * 100.0 if med_rec else nan,
        moved=moved,
    )


@dataclass(frozen=True)
class SloRow:
    """Whether a configuration met every SLO: in the study, and in each run now.

    Attributes:
        recorded: The study's trial met them (None: the study did not measure it).
        now: Per run now, met or not.
        moved: ``worse`` (met then, in no run now), ``better`` (missed then, met in every run
            now), ``within noise`` (the same, or mixed), ``n/a`` (nothing to compare).
    """

    recorded: bool | None
    now: tuple[bool, ...]
    moved: str

    def doc(self) -> dict[str, Any]:
        """JSON-safe."""
        return {"recorded": self.recorded, "now": list(self.now), "moved": self.moved}


def compare_slos(recorded: bool | None, now: Sequence[bool]) -> SloRow:
    """The SLO row: a mixed result now is not a verdict either way."""
    runs = tuple(bool(x) for x in now)
    if recorded is None or not runs:
        return SloRow(recorded, runs, NA)
    if recorded and not any(runs):
        return SloRow(recorded, runs, WORSE)
    if not recorded and all(runs):
        return SloRow(recorded, runs, BETTER)
    return SloRow(recorded, runs, SAME)


@dataclass(frozen=True)
class ConfigComparison:
    """One configuration (``chosen`` or ``baseline``): its rows and its failed runs now.

    Attributes:
        label: ``chosen`` or ``baseline``.
        trial: Its trial number in the study.
        figures: One row per figure.
        slos: The SLO row.
        runs: Runs attempted now.
        failures: Why runs failed now (one line each): the server's failures.
        unscored: Runs whose replay the client could not keep on schedule (after retries):
            not the server's failure, and not a measurement either.
    """

    label: str
    trial: int
    figures: tuple[FigureRow, ...]
    slos: SloRow
    runs: int
    failures: tuple[str, ...] = field(default_factory=tuple)
    unscored: tuple[str, ...] = field(default_factory=tuple)

    @property
    def measured(self) -> int:
        """Runs now that measured the server."""
        return max(0, self.runs - len(self.failures) - len(self.unscored))

    @property
    def no_longer_runs(self) -> bool:
        """No run now measured anything and the server failed in some: it no longer serves."""
        return self.runs > 0 and self.measured == 0 and bool(self.failures)

    @property
    def not_measured(self) -> bool:
        """No run now measured anything, and not for the server's fault (invalid replays)."""
        return self.runs > 0 and self.measured == 0 and not self.failures

    def worse(self) -> list[str]:
        """What regressed, one line each (empty: nothing)."""
        out = []
        if self.no_longer_runs:
            out.append(f"{self.label}: no run served now ({self.failures[0]})")
        for row in self.figures:
            if row.moved == WORSE:
                out.append(f"{self.label} {row.figure}: {_change_text(row)}")
        if self.slos.moved == WORSE:
            out.append(f"{self.label}: met every SLO in the study, in no run now")
        return out

    def better(self) -> list[str]:
        """What improved beyond the noise, one line each."""
        out = [
            f"{self.label} {r.figure}: {_change_text(r)}" for r in self.figures if r.moved == BETTER
        ]
        if self.slos.moved == BETTER:
            out.append(f"{self.label}: missed an SLO in the study, met them in every run now")
        return out

    def doc(self) -> dict[str, Any]:
        """JSON-safe."""
        return {
            "trial": self.trial,
            "runs": self.runs,
            "measured": self.measured,
            "failures": list(self.failures),
            "unscored": list(self.unscored),
            "figures": [r.doc() for r in self.figures],
            "slos": self.slos.doc(),
            "worse": self.worse(),
            "better": self.better(),
        }


def _change_text(row: FigureRow) -> str:
    if math.isfinite(row.change_pct):
        return (
            f"{row.recorded:.4g} -> {row.now:.4g} ({row.change_pct:+.1f}%, "
            f"noise ±{row.noise_pct:.1f}%)"
        )
    return f"{row.recorded:.4g} -> {row.now:.4g} (noise ±{row.noise:.3g})"


def verdict(configs: Sequence[ConfigComparison]) -> tuple[str, list[str]]:
    """The verdict line and what regressed (empty: nothing moved for the worse; check
    ``not_measured`` too: a configuration nothing was measured of passes nothing)."""
    worse = [line for c in configs for line in c.worse()]
    runs = ", ".join(f"{c.label} {c.measured}/{c.runs}" for c in configs)
    if worse:
        return f"REGRESSION: {len(worse)} figure(s) moved beyond the noise for the worse", worse
    blind = [c.label for c in configs if c.not_measured]
    if blind:
        return (
            f"NOT MEASURED: no replay of {', '.join(blind)} kept its schedule (the client could "
            "not keep up; see the runs' messages): nothing compared",
            worse,
        )
    better = [line for c in configs for line in c.better()]
    line = f"no figure moved beyond the noise for the worse (runs measured now: {runs})"
    if better:
        line += f"; {len(better)} improved"
    return line, worse
