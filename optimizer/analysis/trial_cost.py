"""What a study's trials cost: where each server start went, and the share spent measuring.

Each trial stores its start split into phases (:mod:`optimizer.engine.startup`), its replay
time, and Optuna's start and end times. :func:`study_cost` sums them up for ``show``,
report.md and MLflow: the median seconds per startup phase over the trials whose server
started, and the share of the trials' wall time spent replaying (the rest is starting and
stopping servers, and the tuner's own work). With a GPU per trial, that share is the share of
GPU time that went to measuring.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from optimizer.engine.startup import PHASES, phase_label
from optimizer.trial_view import TrialView

__all__ = ["StudyCost", "study_cost"]


@dataclass(frozen=True)
class StudyCost:
    """The cost account of a study's finished trials.

    Attributes:
        trials: Finished trials counted (complete, failed or pruned, with both times known).
        wall_s: Their summed wall time (Optuna's start to end).
        startup_s: Their summed launch-to-healthy time.
        replay_s: Their summed replay time (every capacity step included).
        started: Trials whose server reached ``/health``.
        median_startup_s: Median launch-to-healthy over ``started``.
        median_phases: Median seconds per startup phase over the started trials that recorded
            phases (a phase a trial did not have counts as 0 s for it).
    """

    trials: int
    wall_s: float
    startup_s: float
    replay_s: float
    started: int
    median_startup_s: float | None
    median_phases: dict[str, float] = field(default_factory=dict)

    @property
    def replay_share(self) -> float | None:
        """Share of the trials' wall time spent replaying (None without trials)."""
        return self.replay_s / self.wall_s if self.wall_s > 0 else None

    @property
    def startup_share(self) -> float | None:
        """Share of the trials' wall time spent starting servers."""
        return self.startup_s / self.wall_s if self.wall_s > 0 else None

    def lines(self) -> list[str]:
        """A few plain lines for the console."""
        if not self.trials:
            return []
        out = [
            f"{self.trials} trials, {self.wall_s / 60:.1f} min of trial time: "
            f"{_pct(self.replay_share)} replaying, {_pct(self.startup_share)} starting servers"
        ]
        if self.median_startup_s is not None:
            out.append(
                f"median server start {self.median_startup_s:.1f} s over {self.started} starts"
            )
        if self.median_phases:
            out.append(
                "  median per phase: "
                + ", ".join(
                    f"{phase_label(p)} {s:.1f} s" for p, s in self.median_phases.items() if s > 0
                )
            )
        return out

    def markdown(self) -> list[str]:
        """report.md's section."""
        if not self.trials:
            return []
        lines = ["", "## Where the trial time went", "", *[f"- {x.strip()}" for x in self.lines()]]
        if self.median_phases:
            lines += ["", "| startup phase | median s |", "|---|---:|"]
            lines += [f"| {phase_label(p)} | {s:.1f} |" for p, s in self.median_phases.items()]
        return lines

    def to_dict(self) -> dict[str, Any]:
        """``show --json``'s ``trial_cost``."""
        return {
            "trials": self.trials,
            "wall_s": round(self.wall_s, 3),
            "startup_s": round(self.startup_s, 3),
            "replay_s": round(self.replay_s, 3),
            "replay_share": self.replay_share,
            "startup_share": self.startup_share,
            "started": self.started,
            "median_startup_s": self.median_startup_s,
            "median_phases": self.median_phases,
        }


def study_cost(trials: Sequence[optuna.trial.FrozenTrial]) -> StudyCost:
    """The cost account of a study's finished trials."""
    wall = startup = replay = 0.0
    counted = 0
    starts: list[float] = []
    phase_docs: list[dict[str, float]] = []
    for t in trials:
        if t.datetime_start is None or t.datetime_complete is None:
            continue
        view = TrialView(t)
        counted += 1
        wall += (t.datetime_complete - t.datetime_start).total_seconds()
        replay += view.replay_s or 0.0
        if view.startup_s is not None:
            startup += view.startup_s
            starts.append(view.startup_s)
            if view.startup_phases:
                phase_docs.append(view.startup_phases)
    medians: dict[str, float] = {}
    if phase_docs:
        for phase in PHASES:
            if any(phase in d for d in phase_docs):
                medians[phase] = round(statistics.median(d.get(phase, 0.0) for d in phase_docs), 2)
    return StudyCost(
        trials=counted,
        wall_s=wall,
        startup_s=startup,
        replay_s=replay,
        started=len(starts),
        median_startup_s=round(statistics.median(starts), 2) if starts else None,
        median_phases=medians,
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
