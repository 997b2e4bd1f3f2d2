"""Synthetic traces: seeded arrivals, a mix of length distributions, optional shared prefixes.

When no production trace is at hand (or to probe one dimension of a workload on purpose),
:func:`synthesize` builds a :class:`~optimizer.types.Trace` from a few parameters: Poisson or
gamma arrivals at a mean rate with a chosen burstiness (coefficient of variation of the gaps),
request lengths drawn from a weighted mix of lognormal or fixed components, and optional groups
of requests that share a prompt prefix (a system prompt, a few-shot preamble). Everything is
drawn from one ``numpy.random.Generator`` seeded by ``seed`` in a fixed order, so the same
arguments always give the same trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from optimizer.errors import ConfigError
from optimizer.types import Trace, TraceRequest

__all__ = ["DEFAULT_MIX", "Lengths", "MixComponent", "synthesize"]


@dataclass(frozen=True, slots=True)
class Lengths:
    """A token-length distribution: lognormal around a median, or fixed when ``sigma`` is 0.

    Attributes:
        median_tokens: Median length (``exp(mu)`` of the lognormal), > 0.
        sigma: Standard deviation of the log length; 0 gives ``median_tokens`` every time.
        max_tokens: Upper clip, if any. Draws are rounded and clipped to at least 1.
    """

    median_tokens: float
    sigma: float = 0.0
    max_tokens: int | None = None

    @classmethod
    def fixed(cls, tokens: int) -> Lengths:
        """Always ``tokens``."""
        return cls(median_tokens=float(tokens))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Draw ``size`` integer lengths (always ``size`` normal draws, for reproducibility)."""
        normal = rng.standard_normal(size)
        values = np.rint(self.median_tokens * np.exp(self.sigma * normal))
        upper = self.max_tokens if self.max_tokens is not None else np.inf
        return np.clip(values, 1, upper).astype(np.int64)


@dataclass(frozen=True, slots=True)
class MixComponent:
    """One kind of request in the mix.

    Attributes:
        weight: Relative share of requests (weights are normalized over the mix).
        input: Prompt length distribution.
        output: Output length distribution.
    """

    weight: float
    input: Lengths
    output: Lengths


DEFAULT_MIX: tuple[MixComponent, ...] = (
    MixComponent(
        1.0,
        Lengths(median_tokens=512, sigma=0.8, max_tokens=8192),
        Lengths(median_tokens=128, sigma=0.8, max_tokens=2048),
    ),
)
"""A single chat-like component: ~512-token prompts and ~128-token answers, long-tailed."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _arrivals_s(
    rng: np.random.Generator,
    rate_rps: float,
    burstiness_cv: float,
    num_requests: int | None,
    duration_s: float | None,
) -> np.ndarray:
    """Arrival times starting at 0 s with gamma gaps of mean 1/rate and the given CV."""
    shape = 1.0 / (burstiness_cv * burstiness_cv)
    scale = 1.0 / (rate_rps * shape)
    if num_requests is not None:
        gaps = rng.gamma(shape, scale, size=max(num_requests - 1, 0))
        return np.concatenate(([0.0], np.cumsum(gaps)))[:num_requests]
    assert duration_s is not None
    chunks = [np.zeros(1)]
    last = 0.0
    chunk = max(int(rate_rps * duration_s * 1.2), 16)
    while last < duration_s:
        times = last + np.cumsum(rng.gamma(shape, scale, size=chunk))
        chunks.append(times)
        last = float(times[-1])
    arrivals = np.concatenate(chunks)
    return arrivals[arrivals < duration_s]


def _check_mix(mix: Sequence[MixComponent]) -> None:
    """Raise ConfigError naming the first out-of-range field of the mix."""
    _check(len(mix) > 0, "mix needs at least one component")
    for index, component in enumerate(mix):
        _check(component.weight > 0, f"mix[{index}].weight must be > 0")
        for name, lengths in (("input", component.input), ("output", component.output)):
            _check(lengths.median_tokens > 0, f"mix[{index}].{name}.median_tokens must be > 0")
            _check(lengths.sigma >= 0, f"mix[{index}].{name}.sigma must be >= 0")
            _check(
                lengths.max_tokens is None or lengths.max_tokens >= 1,
                f"mix[{index}].{name}.max_tokens must be >= 1",
            )


def _check_prefixes(
    block_size: int, prefix_fraction: float, prefix_groups: int, prefix_tokens: int
) -> bool:
    """Raise ConfigError for out-of-range prefix settings; True when requests share prefixes."""
    _check(block_size > 0, "block_size must be > 0")
    _check(0.0 <= prefix_fraction <= 1.0, "prefix_fraction must be in [0, 1]")
    _check(prefix_groups >= 0, "prefix_groups must be >= 0")
    _check(
        prefix_tokens >= 0 and prefix_tokens % block_size == 0,
        f"prefix_tokens must be a non-negative multiple of block_size ({block_size})",
    )
    sharing = prefix_groups > 0 and prefix_fraction > 0 and prefix_tokens > 0
    _check(
        not (prefix_groups > 0 and prefix_fraction > 0 and prefix_tokens == 0),
        "prefix_tokens must be > 0 when prefix_groups and prefix_fraction are set",
    )
    return sharing


def _lengths(
    rng: np.random.Generator, mix: Sequence[MixComponent], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each request's input and output length, drawn from a component picked by weight."""
    weights = np.array([c.weight for c in mix], dtype=np.float64)
    choice = rng.choice(len(mix), size=n, p=weights / weights.sum())
    inputs = np.zeros(n, dtype=np.int64)
    outputs = np.zeros(n, dtype=np.int64)
    for index, component in enumerate(mix):
        # Draw for every request and keep the chosen ones: the stream of draws does not
        # depend on the choice, so changing one component leaves the others' draws alone.
        inputs = np.where(choice == index, component.input.sample(rng, n), inputs)
        outputs = np.where(choice == index, component.output.sample(rng, n), outputs)
    return inputs, outputs


def _requests(
    arrivals_s: np.ndarray,
    inputs: np.ndarray,
    outputs: np.ndarray,
    prefixed: np.ndarray,
    groups: np.ndarray,
    prefix_tokens: int,
    block_size: int,
) -> tuple[TraceRequest, ...]:
    """The trace's requests; a prefixed one starts with its group's shared prefix blocks."""
    blocks_per_prefix = prefix_tokens // block_size
    requests = []
    for i in range(len(arrivals_s)):
        blocks: tuple[int, ...] = ()
        input_tokens = int(inputs[i])
        if prefixed[i]:
            first = int(groups[i]) * blocks_per_prefix
            blocks = tuple(range(first, first + blocks_per_prefix))
            input_tokens += prefix_tokens
        requests.append(
            TraceRequest(
                arrival_s=float(arrivals_s[i]),
                input_tokens=input_tokens,
                output_tokens=int(outputs[i]),
                prefix_blocks=blocks,
            )
        )
    return tuple(requests)


def synthesize(
    num_requests: int | None = None,
    *,
    rate_rps: float,
    duration_s: float | None = None,
    burstiness_cv: float = 1.0,
    mix: Sequence[MixComponent] = DEFAULT_MIX,
    prefix_groups: int = 0,
    prefix_fraction: float = 0.0,
    prefix_tokens: int = 0,
    block_size: int = 512,
    seed: int = 0,
) -> Trace:
    """Generate a reproducible synthetic trace.

    Gaps between arrivals follow a gamma distribution with mean ``1 / rate_rps`` and shape
    ``1 / burstiness_cv**2`` (``burstiness_cv == 1`` is a Poisson process; larger is
    burstier, smaller more regular; vLLM's ``--burstiness`` is that shape). The first request
    arrives at 0 s. Each request picks a mix component by weight, then draws its input and
    output lengths from it. With shared prefixes, ``prefix_fraction`` of the requests (each
    independently) belong to one of ``prefix_groups`` groups chosen uniformly; such a request
    starts with its group's ``prefix_tokens`` shared tokens, placed in front of its sampled
    prompt (``input_tokens = prefix_tokens + sampled``), and lists the group's block ids as
    ``prefix_blocks``.

    Args:
        num_requests: How many requests; give this or ``duration_s``.
        rate_rps: Mean arrival rate, requests per second (> 0).
        duration_s: Generate arrivals in ``[0, duration_s)`` instead of a fixed count.
        burstiness_cv: Coefficient of variation of the inter-arrival gaps (> 0).
        mix: The length components (weights > 0).
        prefix_groups: Number of shared-prefix groups (0 for none).
        prefix_fraction: Fraction of requests that use a shared prefix, in [0, 1].
        prefix_tokens: Length of each group's shared prefix, a multiple of ``block_size``.
        block_size: Tokens per prefix block.
        seed: Seed of the ``numpy.random.Generator``.

    Returns:
        The trace, with ``source`` describing the parameters.

    Raises:
        ConfigError: A parameter is out of range; the message names it.
    """
    _check(
        (num_requests is None) != (duration_s is None),
        "give exactly one of num_requests and duration_s",
    )
    _check(num_requests is None or num_requests > 0, "num_requests must be > 0")
    _check(duration_s is None or duration_s > 0, "duration_s must be > 0")
    _check(rate_rps > 0 and np.isfinite(rate_rps), "rate_rps must be a finite number > 0")
    _check(burstiness_cv > 0 and np.isfinite(burstiness_cv), "burstiness_cv must be > 0")
    _check_mix(mix)
    sharing = _check_prefixes(block_size, prefix_fraction, prefix_groups, prefix_tokens)

    rng = np.random.default_rng(seed)
    arrivals_s = _arrivals_s(rng, rate_rps, burstiness_cv, num_requests, duration_s)
    n = len(arrivals_s)
    inputs, outputs = _lengths(rng, mix, n)
    uses_prefix = rng.random(n) < prefix_fraction
    groups = rng.integers(0, max(prefix_groups, 1), size=n)
    prefixed = uses_prefix if sharing else np.zeros(n, dtype=bool)
    requests = _requests(arrivals_s, inputs, outputs, prefixed, groups, prefix_tokens, block_size)
    source = (
        f"synthetic(rate_rps={rate_rps}, burstiness_cv={burstiness_cv}, "
        f"components={len(mix)}, prefix_groups={prefix_groups if sharing else 0}, "
        f"seed={seed})"
    )
    return Trace(requests=requests, block_size=block_size, source=source)
