"""The tuning guide's diagnosis as proposals: one parameter at a time from the incumbent, in
the direction the incumbent's symptom points.

A serving engineer reads what broke first at the incumbent (the best configuration measured
so far, vLLM's defaults at the start) and moves one knob:

- P95 TPOT broke first: prefill chunks share the decode steps (a large token budget lets a
  long prompt's chunk stall every running decode): a smaller token budget, chunked prefill on,
  fewer sequences;
- P95 TTFT (or the error rate) broke first and the KV cache was full (preemptions, or more
  concurrent tokens than it holds): more KV (a larger cache, a larger memory share, a shorter
  max-model-len, the FP8 KV cache), fewer sequences, prefix caching on;
- P95 TTFT broke first with KV to spare: requests queue for prefill: a larger token budget,
  more sequences, prefix caching on, chunked prefill on.

:data:`RULES` is that table; each rule names the symptom it reads. A move that improved the
incumbent is tried again from the new incumbent (further the same way) before the new
incumbent's own symptom is read; a move that did not is not repeated. Every proposal is one
parameter away from the incumbent; the guide is done when no rule has a move left that the
study does not hold.

:class:`GuidedSampler` is that procedure as an Optuna sampler (stateless: it reads the study's
trials every time, so a resumed study goes on where it stopped). It proposes while the guide
has a move (``max_guided``: at most that many guided trials), then hands every later trial to
``fallback`` (a model-based sampler, which then learns from the guided trials like any other).
Its proposals are marked ``guided`` (:data:`optimizer.sampling.ORIGIN_ATTR`), and each stores
its move (:data:`MOVE_ATTR`).

Imports nothing above :mod:`optimizer.trial_view` and :mod:`optimizer.sampling`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from optimizer.sampling import ORIGIN_ATTR
from optimizer.trial_view import TrialView

__all__ = [
    "MOVE_ATTR",
    "RULES",
    "SYMPTOMS",
    "GuidedSampler",
    "Rule",
    "guide_proposal",
    "symptom_of",
]

MOVE_ATTR = "vllm_autotune:guide_move"
"""A guided trial's move: ``{"from": number, "param": name, "to": value, "symptom": name}``."""

UP, DOWN = "up", "down"
"""Towards a larger or a smaller value (a boolean: True is up)."""


@dataclass(frozen=True)
class Rule:
    """One line of the guide: the symptom it reads, how it is read, and the moves it makes
    (parameter, direction or target value), most promising first."""

    symptom: str
    reads: str
    moves: tuple[tuple[str, Any], ...]


RULES: tuple[Rule, ...] = (
    Rule(
        "tpot_prefill_interference",
        "P95 TPOT broke first: prefill chunks share the decode steps",
        (
            ("max-num-batched-tokens", DOWN),
            ("enable-chunked-prefill", True),
            ("max-num-seqs", DOWN),
        ),
    ),
    Rule(
        "ttft_kv_full",
        "P95 TTFT or errors broke first with the KV cache full (preemptions, or more "
        "concurrent tokens than it holds)",
        (
            ("kv-cache-memory-bytes", UP),
            ("gpu-memory-utilization", UP),
            ("max-model-len", DOWN),
            ("kv-cache-dtype", "fp8"),
            ("max-num-seqs", DOWN),
            ("enable-prefix-caching", True),
            ("block-size", DOWN),
        ),
    ),
    Rule(
        "ttft_queue",
        "P95 TTFT broke first with KV to spare: requests queue for prefill",
        (
            ("max-num-batched-tokens", UP),
            ("max-num-seqs", UP),
            ("enable-prefix-caching", True),
            ("enable-chunked-prefill", True),
            ("block-size", DOWN),
        ),
    ),
)

SYMPTOMS = tuple(r.symptom for r in RULES)

# vLLM's defaults for the params a baseline's recorded arguments may leave out (V1 engine).
_DEFAULTS: dict[str, Any] = {
    "max-num-seqs": 128,
    "max-num-batched-tokens": 2048,
    "enable-chunked-prefill": True,
    "enable-prefix-caching": True,
    "block-size": 16,
    "gpu-memory-utilization": 0.9,
    "kv-cache-dtype": "auto",
}


def symptom_of(trial: FrozenTrial) -> str | None:
    """What broke first at a measured trial, as one of :data:`SYMPTOMS` (None: nothing to
    read: unmeasured, or no SLO broke at any load tried).

    A capacity trial: the SLO that broke first above its capacity (``broke_first``). A
    fixed-load trial: its most violated SLO, else the latency nearer its SLO. TTFT and errors
    read as KV-bound when the server preempted requests or its KV cache held fewer tokens than
    the concurrency it served needed; as queueing otherwise."""
    view = TrialView(trial)
    if not view.measured:
        return None
    broke = _broke_first(trial, view)
    if broke is None:
        return None
    if "tpot" in broke or "itl" in broke:
        return "tpot_prefill_interference"
    return "ttft_kv_full" if _kv_full(view) else "ttft_queue"


def _broke_first(trial: FrozenTrial, view: TrialView) -> str | None:
    cap = view.capacity
    if cap is not None:
        return cap.broke_first
    if not trial.constraints:
        return None
    name, margin = max(trial.constraints.items(), key=lambda kv: kv[1])
    return name if margin > 0 or len(trial.constraints) > 1 else None


def _kv_full(view: TrialView) -> bool:
    """Preemptions, or a KV cache smaller than the tokens its concurrency held (Little's law
    on the summary: request rate x mean end-to-end latency x mean tokens per request)."""
    preempted = view.server_metrics.get("vllm:num_preemptions_total", 0.0)
    if preempted and preempted > 0:
        return True
    s = view.summary
    kv_tokens = view.memory.get("kv_cache_tokens")
    rate, e2el = s.get("request_throughput"), s.get("mean_e2el_ms")
    done = s.get("completed") or 0
    tokens = (s.get("total_input_tokens", 0.0) + s.get("total_output_tokens", 0.0)) / max(done, 1)
    if not kv_tokens or not rate or not e2el or not done:
        return False
    return float(rate) * float(e2el) / 1000.0 * tokens > 0.9 * float(kv_tokens)


def _ordered(dist: BaseDistribution) -> list[Any] | None:
    """A distribution's values in order (None: continuous without a step)."""
    if isinstance(dist, CategoricalDistribution):
        choices = list(dist.choices)
        if all(isinstance(c, bool) for c in choices):
            return sorted(choices)
        if all(isinstance(c, int | float) and not isinstance(c, bool) for c in choices):
            return sorted(choices)
        return choices
    if isinstance(dist, IntDistribution):
        if dist.log:
            out, v = [], dist.low
            while v <= dist.high:
                out.append(v)
                v *= 2
            return out
        return list(range(dist.low, dist.high + 1, dist.step))
    if isinstance(dist, FloatDistribution) and dist.step is not None:
        n = round((dist.high - dist.low) / dist.step)
        return [round(dist.low + i * dist.step, 10) for i in range(n + 1)]
    return None


def _moved(dist: BaseDistribution, value: Any, how: Any) -> Any:
    """The value one step from ``value`` the way ``how`` says (None: no such value)."""
    values = _ordered(dist)
    if values is None:
        if isinstance(dist, FloatDistribution) and how in (UP, DOWN):
            new = value * 1.1 if how == UP else value / 1.1
            return new if dist.low <= new <= dist.high else None
        return None
    if how not in (UP, DOWN):
        return how if how in values and how != value else None
    if value not in values:
        value = _nearest(values, value)
    i = values.index(value) + (1 if how == UP else -1)
    return values[i] if 0 <= i < len(values) else None


def _nearest(values: list[Any], value: Any) -> Any:
    if value in values:
        return value
    numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if not numeric or not isinstance(value, int | float) or isinstance(value, bool):
        return values[0]
    if value > 0 and all(v > 0 for v in numeric):
        return min(numeric, key=lambda v: abs(math.log(v / value)))
    return min(numeric, key=lambda v: abs(v - value))


def start_point(
    space: Mapping[str, BaseDistribution], engine_args: Mapping[str, Any]
) -> dict[str, Any]:
    """The space's configuration nearest a measured set of engine arguments (the baseline's:
    vLLM's defaults, written down), for params it left out vLLM's defaults."""
    out = {}
    for name, dist in space.items():
        values = _ordered(dist)
        value = engine_args.get(name, _DEFAULTS.get(name))
        if values is None:
            out[name] = value if value is not None else getattr(dist, "low", None)
            continue
        out[name] = _nearest(values, value) if value is not None else values[len(values) // 2]
    return out


def _config(trial: FrozenTrial, space: Mapping[str, BaseDistribution]) -> dict[str, Any] | None:
    if set(space) <= set(trial.params):
        return {k: trial.params[k] for k in space}
    if not trial.params:  # the baseline: its recorded engine arguments
        return start_point(space, TrialView(trial).engine_args)
    return None


def _key(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def guide_proposal(
    trials: Sequence[FrozenTrial],
    space: Mapping[str, BaseDistribution],
    direction: optuna.study.StudyDirection,
    symptom: Callable[[FrozenTrial], str | None] = symptom_of,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The guide's next configuration and its move, from the study's trials (None: no rule has
    a move left that no trial holds). The incumbent is the measured trial with the best first
    value (the baseline until a tuned trial beats it)."""
    # The baseline's nearest point of the space is where the guide starts, not a configuration
    # the baseline measured (its own arguments are vLLM's defaults, often off the grid).
    held = {_key(c) for t in trials if t.params and (c := _config(t, space)) is not None}
    told = [
        t
        for t in trials
        if t.state == TrialState.COMPLETE and t.values and _config(t, space) is not None
    ]
    if not told:
        return None
    sign = 1.0 if direction == optuna.study.StudyDirection.MAXIMIZE else -1.0
    best = max(told, key=lambda t: (sign * t.values[0], -t.number))
    here = _config(best, space)
    assert here is not None
    for param, how, rule in _moves(best, symptom):
        if param not in space:
            continue
        new = _moved(space[param], here[param], how)
        if new is None:
            continue
        candidate = {**here, param: new}
        if _key(candidate) in held:
            continue
        move = {"from": best.number, "param": param, "to": new, "how": how, "symptom": rule}
        return candidate, move
    return None


def _moves(
    best: FrozenTrial, symptom: Callable[[FrozenTrial], str | None]
) -> list[tuple[str, Any, str]]:
    """The incumbent's moves in order: the move that made it (once more, the same way), then
    its symptom's rule, then the other rules' (every one-parameter neighbour the guide
    knows)."""
    out: list[tuple[str, Any, str]] = []
    made = best.system_attrs.get(MOVE_ATTR)
    if isinstance(made, dict) and made.get("how") in (UP, DOWN):
        out.append((str(made["param"]), made["how"], str(made.get("symptom"))))
    read = symptom(best)
    ordered = sorted(RULES, key=lambda r: r.symptom != read)
    for rule in ordered:
        out += [(p, how, rule.symptom) for p, how in rule.moves]
    return out


class GuidedSampler(BaseSampler):
    """The guide as an Optuna sampler over ``space``; ``fallback`` proposes once the guide is
    done or has made ``max_guided`` proposals (see the module docstring).

    Args:
        space: The study's search space (every param the driver suggests).
        fallback: The sampler of every trial the guide does not propose.
        max_guided: At most this many guided trials (None: until the guide is done).
        symptom: Reads a trial's symptom (:func:`symptom_of`; the offline benchmark passes
            its table's reading).
    """

    def __init__(
        self,
        space: Mapping[str, BaseDistribution],
        fallback: BaseSampler,
        max_guided: int | None = None,
        symptom: Callable[[FrozenTrial], str | None] = symptom_of,
    ) -> None:
        self.space = {k: v for k, v in space.items() if not v.single()}
        self.fallback = fallback
        self.max_guided = max_guided
        self.symptom = symptom
        self.guided = 0
        """Guided proposals made by this sampler object (for tests and benchmarks)."""
        self._proposals: dict[int, dict[str, Any]] = {}  # {}: the fallback's trial

    def _propose(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any] | None:
        """The guide's configuration for ``trial`` (None: the fallback's trial), worked out
        once per trial."""
        if trial.number not in self._proposals:
            self._proposals[trial.number] = self._work_out(study, trial)
        return self._proposals[trial.number] or None

    def _work_out(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:
            return {}
        trials = study._get_trials(deepcopy=False, use_cache=False)
        done = sum(1 for t in trials if MOVE_ATTR in t.system_attrs)
        if self.max_guided is not None and done >= self.max_guided:
            return {}
        others = [t for t in trials if t.number != trial.number]
        found = guide_proposal(others, self.space, study.directions[0], self.symptom)
        if found is None:
            return {}
        config, move = found
        study._storage.set_trial_system_attr(trial._trial_id, MOVE_ATTR, move)
        study._storage.set_trial_system_attr(trial._trial_id, ORIGIN_ATTR, "guided")
        self.guided += 1
        return config

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        if self._propose(study, trial) is not None:
            return dict(self.space)
        return self.fallback.infer_relative_search_space(study, trial)

    def sample_relative(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        search_space: dict[str, BaseDistribution],
    ) -> dict[str, Any]:
        config = self._propose(study, trial)
        if config is not None:
            return {k: v for k, v in config.items() if k in search_space}
        return self.fallback.sample_relative(study, trial, search_space)

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        config = self._propose(study, trial)
        if config is not None and param_name in config:
            return config[param_name]
        return self.fallback.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.fallback.before_trial(study, trial)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self._proposals.pop(trial.number, None)
        self.fallback.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.fallback.reseed_rng()
