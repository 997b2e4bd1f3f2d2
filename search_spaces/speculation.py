"""Speculative decoding at a stated acceptance: vLLM's synthetic rejection sampler.

With random (dummy) weights a draft model's tokens are accepted at random, so a measurement of
speculation says nothing about a real model. vLLM (0.26 on GPUs) has a synthetic rejection
sampler that runs the real proposer and verification kernels but accepts draft tokens at a rate
the user states (``speculative-config``'s ``rejection_sample_method: synthetic`` with
``synthetic_acceptance_length`` or per-position ``synthetic_acceptance_rates``): the cost of
speculation is real, the acceptance is an assumption, and it must be said wherever a number
measured with it goes.

- :func:`with_acceptance`: a trial's engine arguments with the assumption put into an enabled
  ``speculative-config`` (and nothing changed when speculation is off).
- :func:`rates_problems`: vLLM's rules for per-position rates (the rest of what vLLM refuses
  about the assumption, for a trial's number of speculative tokens, is a constraint in
  :mod:`search_spaces.constraints`, checked before a server starts).
- :func:`without_synthetic` and :func:`synthetic_assumption`: what a deployment gets (the
  sampler's keys removed) and the words that say what the numbers assumed.
- :func:`speculation_possible`: whether a study can turn speculation on at all (for the refusal
  of speculation on random weights without a stated acceptance).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

FLAG = "speculative-config"
SYNTHETIC_KEYS = (
    "rejection_sample_method",
    "synthetic_acceptance_length",
    "synthetic_acceptance_rates",
)


def _as_dict(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return dict(value) if isinstance(value, Mapping) else None


def speculation_on(args: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``speculative-config`` dict when speculation is on (a method or a draft model)."""
    value = _as_dict(args.get(FLAG))
    if value is None or (value.get("method") is None and value.get("model") is None):
        return None
    return value


def with_acceptance(
    args: Mapping[str, Any],
    *,
    length: float | None = None,
    rates: Sequence[float] | None = None,
) -> dict[str, Any]:
    """``args`` with the stated acceptance in its ``speculative-config`` (a copy).

    Speculation off, or no assumption: unchanged. Per-position rates longer than the trial's
    ``num_speculative_tokens`` are cut to it (the positions past it are never drafted); shorter
    ones are left for the constraints (:func:`search_spaces.check_constraints`) to refuse.
    """
    out = dict(args)
    spec = speculation_on(args)
    if spec is None or (length is None and rates is None):
        return out
    for key in SYNTHETIC_KEYS:
        spec.pop(key, None)
    spec["rejection_sample_method"] = "synthetic"
    if rates is not None:
        n = spec.get("num_speculative_tokens")
        cut = isinstance(n, int) and not isinstance(n, bool) and n > 0
        spec["synthetic_acceptance_rates"] = list(rates[:n] if cut else rates)
    else:
        spec["synthetic_acceptance_length"] = length
    out[FLAG] = spec
    return out


def rates_problems(rates: Sequence[float]) -> list[str]:
    """vLLM's rules for per-position acceptance rates: each in [0, 1], none above the one
    before (the job's ``acceptance_rates`` and a trial's ``synthetic_acceptance_rates``)."""
    values = [float(r) for r in rates]
    problems = []
    if any(not 0 <= r <= 1 for r in values):
        problems.append(f"acceptance rates must lie in [0, 1] (got {values})")
    if any(b > a for a, b in itertools.pairwise(values)):
        problems.append(f"acceptance rates must not increase with the position (got {values})")
    return problems


def without_synthetic(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` as a deployment runs them: the synthetic sampler's keys removed (a copy)."""
    out = dict(args)
    spec = _as_dict(args.get(FLAG))
    if spec is not None and any(k in spec for k in SYNTHETIC_KEYS):
        out[FLAG] = {k: v for k, v in spec.items() if k not in SYNTHETIC_KEYS}
    return out


def synthetic_assumption(args: Mapping[str, Any]) -> str | None:
    """One line on the acceptance a configuration was measured at (None: no synthetic sampler)."""
    spec = _as_dict(args.get(FLAG))
    if spec is None or spec.get("rejection_sample_method") != "synthetic":
        return None
    method = spec.get("method") or "draft model"
    tokens = spec.get("num_speculative_tokens")
    if spec.get("synthetic_acceptance_rates") is not None:
        stated = f"per-position acceptance rates {spec['synthetic_acceptance_rates']}"
    else:
        stated = f"mean acceptance length {spec.get('synthetic_acceptance_length')}"
    return (
        f"speculative decoding ({method}, {tokens} tokens) measured at a stated {stated} "
        "(vLLM's synthetic rejection sampler, not a real draft's acceptance)"
    )


def speculation_possible(
    space_params: Mapping[str, Any], fixed: Sequence[Mapping[str, Any]]
) -> bool:
    """True when a study can turn speculation on: a fixed ``speculative-config`` with a method or
    model, or a tuned ``speculative-config.method`` / ``.model`` with a non-null choice.

    Args:
        space_params: The search space's params by name (objects with ``choices`` where
            categorical).
        fixed: Engine-argument mappings every trial (or the baseline) starts from.
    """
    if any(speculation_on(args) is not None for args in fixed):
        return True
    for name, param in space_params.items():
        if name in (f"{FLAG}.method", f"{FLAG}.model"):
            choices = getattr(param, "choices", None)
            if choices is None or any(c is not None for c in choices):
                return True
    return False


def stated_acceptance(plan: Mapping[str, Any]) -> str | None:
    """The acceptance a study's job stated (``plan.json``'s ``job.engine.speculation``), in words;
    None when it stated none."""
    stated: Any = plan
    for key in ("job", "engine", "speculation"):
        stated = stated.get(key) if isinstance(stated, Mapping) else None
    if not isinstance(stated, Mapping):
        return None
    if stated.get("acceptance_rates") is not None:
        return f"per-position acceptance rates {list(stated['acceptance_rates'])}"
    if stated.get("acceptance_length") is not None:
        return f"mean acceptance length {float(stated['acceptance_length']):g}"
    return None
