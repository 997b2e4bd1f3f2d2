"""One reader of a stored trial: what the study wrote into Optuna, decoded in one place.

The study driver stores each trial's outcome as Optuna user attributes (``status``,
``engine_args`` as JSON, ``summary``, ``capacity``, ...). :class:`TrialView` reads them; new
code asks it instead of parsing attributes itself. :func:`gpus_per_server` is the one rule for
how many GPUs a configuration's server takes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial, TrialState

__all__ = ["CapacityView", "TrialView", "gpus_per_server"]


def gpus_per_server(args: Mapping[str, Any], *, cpu_build: bool = False) -> int:
    """GPUs one server of this configuration uses: tensor x pipeline parallel (0 on a CPU)."""
    if cpu_build:
        return 0
    tp = int(args.get("tensor-parallel-size", 1) or 1)
    pp = int(args.get("pipeline-parallel-size", 1) or 1)
    return tp * pp


def _float(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


@dataclass(frozen=True)
class CapacityView:
    """A capacity trial's search, as stored (see ``optimizer.capacity.trial.capacity_doc``).

    Attributes:
        rps: Requests/s of the trace's mix carried within the SLOs (0: none).
        output_tps: The same in output tokens/s.
        scale: The highest passing rate scale.
        lo: Bracket low (highest pass).
        hi: Bracket high (lowest fail above ``lo``; NaN when none failed).
        converged: The bracket is within the tolerance.
        bracket_width: ``hi / lo - 1`` (NaN when open).
        repeat_spread: Largest spread of a repeated step's deciding margin.
        steps: Every step (scale, passed, reason, margins, ...).
        broke_first: The SLO that broke first above the capacity.
        broke_reason: How it broke.
        floors: SLO floors measured when nothing passed.
        isolation: How steps were kept apart.
        stop: Why the search ended.
    """

    rps: float
    output_tps: float
    scale: float
    lo: float
    hi: float
    converged: bool
    bracket_width: float
    repeat_spread: float
    steps: tuple[Mapping[str, Any], ...]
    broke_first: str | None
    broke_reason: str | None
    floors: Mapping[str, float]
    isolation: str
    stop: str
    first_failure: Mapping[str, Any] | None
    first_failure_partial: bool | None

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> CapacityView:
        """Decode the stored document."""
        return cls(
            rps=_float(doc.get("rps", 0.0)),
            output_tps=_float(doc.get("output_tps", 0.0)),
            scale=_float(doc.get("scale", 0.0)),
            lo=_float(doc.get("lo", 0.0)),
            hi=_float(doc.get("hi")),
            converged=bool(doc.get("converged")),
            bracket_width=_float(doc.get("bracket_width")),
            repeat_spread=_float(doc.get("repeat_spread", 0.0)),
            steps=tuple(doc.get("steps") or ()),
            broke_first=doc.get("broke_first"),
            broke_reason=doc.get("broke_reason"),
            floors={k: _float(v) for k, v in (doc.get("floors") or {}).items()},
            isolation=str(doc.get("isolation") or ""),
            stop=str(doc.get("stop") or ""),
            first_failure=doc.get("first_failure"),
            first_failure_partial=doc.get("first_failure_partial"),
        )

    def lowest_step(self) -> Mapping[str, Any] | None:
        """The step at the lowest scale tried."""
        return min(self.steps, key=lambda s: float(s["scale"])) if self.steps else None

    def bracket_text(self) -> str:
        """``[lo, hi]`` in requests/s terms of the scale, e.g. ``x[1.41, 1.5]``."""
        hi = "∞" if math.isnan(self.hi) else f"{self.hi:.3g}"
        return f"x[{self.lo:.3g}, {hi}]"


@dataclass(frozen=True)
class TrialView:
    """A stored trial, decoded.

    Attributes:
        trial: The Optuna trial.
    """

    trial: FrozenTrial

    @property
    def number(self) -> int:
        """The trial number."""
        return self.trial.number

    @property
    def status(self) -> str:
        """How it ended: complete, failed, infeasible, invalid_replay, rejected, running, ..."""
        default = self.trial.state.name.lower()
        return str(self.trial.user_attrs.get("status", default))

    @property
    def is_baseline(self) -> bool:
        """True for the study's baseline (vLLM's defaults)."""
        return bool(self.trial.user_attrs.get("baseline"))

    @property
    def engine_args(self) -> dict[str, Any]:
        """The engine arguments it ran with."""
        raw = self.trial.user_attrs.get("engine_args")
        return dict(json.loads(raw)) if isinstance(raw, str) else {}

    @property
    def measured(self) -> bool:
        """Its objective values are a full measurement (not a failure's placeholders)."""
        return self.trial.state == TrialState.COMPLETE and self.status == "complete"

    @property
    def feasible(self) -> bool:
        """Measured and every SLO constraint met."""
        return self.measured and all(v <= 0 for v in self.trial.constraints.values())

    @property
    def summary(self) -> dict[str, float]:
        """The stored summary (None values as NaN)."""
        raw = self.trial.user_attrs.get("summary") or {}
        return {str(k): _float(v) for k, v in raw.items()}

    @property
    def partial(self) -> bool:
        """The summary covers a window an early stop cut short."""
        return self.status == "infeasible" or bool(self.summary.get("partial"))

    @property
    def capacity(self) -> CapacityView | None:
        """The capacity search, for capacity trials."""
        doc = self.trial.user_attrs.get("capacity")
        return CapacityView.from_doc(doc) if isinstance(doc, Mapping) else None

    @property
    def startup_s(self) -> float | None:
        """Seconds its engine took to start (None: it never started)."""
        value = self.trial.user_attrs.get("startup_s")
        return float(value) if value is not None else None

    @property
    def replay_s(self) -> float | None:
        """Seconds its replay took (None: no replay)."""
        value = self.trial.user_attrs.get("replay_s")
        return float(value) if value is not None else None

    @property
    def message(self) -> str:
        """What happened, in a paragraph."""
        return str(self.trial.user_attrs.get("message") or "")

    def slo_verdicts(self) -> dict[str, bool]:
        """SLO -> met, from the constraints told to Optuna."""
        return {k: v <= 0 for k, v in self.trial.constraints.items()}

    def gpus(self, *, cpu_build: bool = False) -> int:
        """GPUs its server used."""
        return gpus_per_server(self.engine_args, cpu_build=cpu_build)
