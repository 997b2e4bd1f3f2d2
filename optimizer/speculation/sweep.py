"""The break-even sweep: below which acceptance does speculative decoding lose at this load?

A study measured speculation at one stated acceptance (``engine.speculation``). The sweep
re-measures the chosen configuration now at several acceptance lengths (vLLM's synthetic
rejection sampler) and once with speculation off, on the study's own trace, SLOs and capacity
search, and answers in a user's terms:

- capacity studies: capacity at SLO (req/s) per acceptance length beside speculation off, and
  the break-even length where the capacity with speculation reaches the capacity without it;
  beside each, P95 TPOT at the nominal load (the capacity search's first step, at
  ``capacity.start_scale``: one load for every row);
- fixed-load studies: P95 TPOT at the study's load, the break-even where it drops to the P95
  TPOT without speculation.

The break-even is read off the measured points by linear interpolation between the last length
that lost and the first that won (:func:`break_even`); "below the lowest" and "above the
highest" are said as such, never extrapolated. Written to the study folder's ``spec_sweep.json``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from optimizer.errors import ConfigError
from optimizer.trial_view import TrialView, gpus_per_server
from optimizer.types import TrialResult, TrialStatus
from search_spaces.speculation import FLAG, speculation_on, with_acceptance, without_synthetic

if TYPE_CHECKING:
    from optimizer.runners import TrialRunner
    from optimizer.study import StudyPlan

__all__ = ["SWEEP_FILE", "BreakEven", "break_even", "run_sweep", "sweep_points"]

SWEEP_FILE = "spec_sweep.json"


@dataclass(frozen=True)
class BreakEven:
    """Where speculation stops losing, read off the sweep.

    Attributes:
        length: The interpolated break-even acceptance length (None when not bracketed).
        text: The answer in words.
    """

    length: float | None
    text: str


def break_even(
    off: float, points: Sequence[tuple[float, float]], *, higher_is_better: bool = True
) -> BreakEven:
    """The acceptance length at which the figure with speculation equals ``off`` (without).

    Args:
        off: The figure with speculation off.
        points: (acceptance length, figure) measured with speculation, any order; NaN for a
            length that could not be measured (skipped).
        higher_is_better: Capacity: True; P95 TPOT: False.
    """
    pts = sorted((x, y) for x, y in points if math.isfinite(y))
    if not pts or not math.isfinite(off):
        return BreakEven(None, "no break-even: nothing to compare (a run was not measured)")

    def wins(y: float) -> bool:
        return y >= off if higher_is_better else y <= off

    for i, (x, y) in enumerate(pts):
        if not wins(y):
            continue
        if i == 0:
            return BreakEven(
                None, f"speculation wins at every length measured (from {x:g}): break-even <= {x:g}"
            )
        x0, y0 = pts[i - 1]
        length = x0 + (x - x0) * (off - y0) / (y - y0) if y != y0 else x
        return BreakEven(
            length,
            f"break-even at an acceptance length of about {length:.2f} (between {x0:g}, "
            f"which lost, and {x:g}, which won); below it speculation loses at this load",
        )
    top = pts[-1][0]
    return BreakEven(
        None, f"speculation loses at every length measured (up to {top:g}): break-even > {top:g}"
    )


def sweep_points(args: Mapping[str, Any], lengths: Sequence[float]) -> list[tuple[str, Any]]:
    """(label, engine arguments) to run: speculation off, then each reachable length.

    Raises:
        ConfigError: The configuration has no speculation, or no length is reachable with its
            number of speculative tokens.
    """
    spec = speculation_on(args)
    if spec is None:
        raise ConfigError(
            "this configuration has no speculative decoding; pick a trial that has "
            "(--trial N) or study with speculation in the space first"
        )
    base = without_synthetic(args)
    n = spec.get("num_speculative_tokens")
    reachable = [x for x in lengths if not isinstance(n, int) or 1 <= x <= n + 1]
    if not reachable:
        raise ConfigError(
            f"no acceptance length of {list(lengths)} can happen with num_speculative_tokens "
            f"{n} (each lies in [1, {n + 1 if isinstance(n, int) else 'n + 1'}])"
        )
    off = {k: v for k, v in base.items() if k != FLAG}
    runs: list[tuple[str, Any]] = [("off", off)]
    runs += [(f"{x:g}", with_acceptance(base, length=x)) for x in reachable]
    return runs


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def _figure(result: TrialResult, capacity: bool) -> float:
    """Capacity (req/s) or P95 TPOT (ms) of a complete run; NaN otherwise."""
    if result.status is not TrialStatus.COMPLETE:
        return math.nan
    if capacity:
        return _number((result.capacity or {}).get("rps"))
    return _number(result.summary.get("p95_tpot_ms"))


def run_sweep(
    folder: Path,
    saved: Mapping[str, Any],
    study: optuna.Study,
    lengths: Sequence[float],
    make_runner: Callable[[StudyPlan], TrialRunner],
    *,
    trial: int | None = None,
    progress: Callable[[str], None] | None = None,
    reuse: bool = True,
) -> dict[str, Any]:
    """Run the sweep on the chosen configuration (or ``trial``); write and return the document.

    ``reuse``: a row whose configuration the study itself measured (a complete trial with exactly
    these engine arguments, the stated acceptance included, and for capacity a full search, not
    a race) is that trial's measurement (said in the row's ``reused_trial``) instead of one more
    server start; typically "off" is the baseline and the study's stated length is the chosen
    trial itself.

    Raises:
        ConfigError: No trial to choose, no speculation in it, no reachable length.
    """
    from optimizer.export import choose
    from optimizer.regress.workflow import prepare_again

    say = progress or (lambda _: None)
    view: TrialView = choose(study, None, trial_number=trial).chosen
    runs = sweep_points(view.engine_args, lengths)
    plan = prepare_again(folder, saved)
    capacity = plan.objectives.is_capacity
    runs_dir = Path(folder) / "spec_sweep" / time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, TrialResult] = {}
    reused: dict[str, int] = {}
    for label, args in runs if reuse else ():
        found = measured_as(study, args, capacity)
        if found is not None:
            results[label], reused[label] = found, found.number
            say(f"acceptance {label}: measured in the study as trial {found.number}")
    runner = make_runner(plan)
    try:
        for i, (label, args) in enumerate(runs):
            if label in results:
                continue
            spec = plan.trial_spec(
                view.number, args, workdir=runs_dir / label, seed=900_000 + i, early_stop=None
            )
            gpus = gpus_per_server(args, cpu_build=plan.context.cpu_build)
            results[label] = runner.submit(spec, gpus).future.result()
            say(f"acceptance {label}: {results[label].status.value} {results[label].message}")
    finally:
        runner.close()
    return _write(folder, view, runs, results, capacity, runs_dir, reused)


def measured_as(study: optuna.Study, args: Mapping[str, Any], capacity: bool) -> TrialResult | None:
    """The study's own measurement of ``args`` (exactly these engine arguments), if it has one.

    Only a complete trial counts, and for a capacity study only a full search (a trial that
    lost its race has an upper bound, not a capacity).
    """
    key = json.dumps(dict(args), sort_keys=True, default=str)
    for frozen in study.get_trials(deepcopy=False):
        view = TrialView(frozen)
        if not view.measured or json.dumps(view.engine_args, sort_keys=True, default=str) != key:
            continue
        doc = frozen.user_attrs.get("capacity")
        if capacity and (
            not isinstance(doc, Mapping)
            or doc.get("raced_out")
            or doc.get("race_scale") is not None
        ):
            continue
        return TrialResult(
            number=view.number,
            status=TrialStatus.COMPLETE,
            summary=view.summary,
            capacity=dict(doc) if isinstance(doc, Mapping) else {},
            message=f"measured in the study as trial {view.number} (same engine arguments)",
        )
    return None


def _write(
    folder: Path,
    view: TrialView,
    runs: Sequence[tuple[str, Any]],
    results: Mapping[str, TrialResult],
    capacity: bool,
    runs_dir: Path,
    reused: Mapping[str, int],
) -> dict[str, Any]:
    figure = "capacity_rps" if capacity else "p95_tpot_ms"
    off = _figure(results["off"], capacity)
    points = [(float(label), _figure(results[label], capacity)) for label, _ in runs[1:]]
    answer = break_even(off, points, higher_is_better=capacity)
    doc = {
        "trial": view.number,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "figure": figure,
        "rows": [
            {
                "acceptance_length": None if label == "off" else float(label),
                figure: _figure(results[label], capacity),
                # Capacity: at the search's first step (start_scale, the trace's own rate by
                # default; the sweep never races), the same load for every row; else the study's.
                "p95_tpot_ms": _number(
                    results[label].summary.get("nominal_p95_tpot_ms" if capacity else "p95_tpot_ms")
                ),
                "status": results[label].status.value,
                "message": results[label].message,
                "engine_args": args,
                "reused_trial": reused.get(label),
            }
            for label, args in runs
        ],
        "break_even_length": answer.length,
        "answer": answer.text,
        "runs_dir": str(runs_dir.relative_to(folder)) if runs_dir.is_relative_to(folder) else "",
    }
    clean: dict[str, Any] = _no_nan(doc)
    (Path(folder) / SWEEP_FILE).write_text(json.dumps(clean, indent=2, default=str) + "\n")
    return clean


def _no_nan(value: Any) -> Any:
    """NaN (not measured) as JSON null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value
