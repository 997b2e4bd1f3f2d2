"""What a user chose for a stability check: the ``stability`` command's flags and a job's
``stability`` section, with one set of defaults (a record: the job file's schema builds it
without importing the check's workflow)."""

from __future__ import annotations

from dataclasses import dataclass, field

from optimizer.stability.plan import PlanSettings

__all__ = ["StabilityOptions", "stability_options"]


@dataclass(frozen=True)
class StabilityOptions:
    """What the user chose: the trial (None: export's default policy), the load's fraction of
    capacity, the burst factor, the phases, and whether to run the baseline too.

    ``auto_recovery``: a capacity study's recovery phase lasts 1.5 times the time the burst's
    backlog takes to drain at capacity (:func:`~optimizer.stability.plan.drain_time_s`), at
    least ``settings.recovery_s``: a recovery phase shorter than the drain would fail every
    configuration by construction."""

    trial: int | None = None
    fraction: float = 0.7
    burst_factor: float = 3.0
    settings: PlanSettings = field(default_factory=PlanSettings)
    auto_recovery: bool = True
    baseline: bool = True
    seed: int = 7_000


def stability_options(
    *,
    trial: int | None = None,
    minutes: float = 3.0,
    fraction: float = 0.7,
    burst_factor: float = 3.0,
    burst_s: float = 20.0,
    recovery_s: float | None = None,
    long_s: float = 30.0,
    window_s: float = 10.0,
    baseline: bool = True,
) -> StabilityOptions:
    """The options of the ``stability`` command's flags and of a job's ``stability`` section
    (one set of defaults): ``recovery_s`` None sizes the recovery phase to the burst's backlog
    (at least 30 s)."""
    return StabilityOptions(
        trial=trial,
        fraction=fraction,
        burst_factor=burst_factor,
        settings=PlanSettings(
            sustained_s=minutes * 60,
            burst_s=burst_s,
            recovery_s=30.0 if recovery_s is None else recovery_s,
            long_input_s=long_s,
            window_s=window_s,
        ),
        auto_recovery=recovery_s is None,
        baseline=baseline,
    )
