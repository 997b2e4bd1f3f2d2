"""Synthetic traces: reproducible, and with the rate, burstiness, mix and prefixes asked for."""

from __future__ import annotations

import numpy as np
import pytest

from optimizer.errors import ConfigError
from optimizer.workload.stats import inspect_trace
from optimizer.workload.synthetic import Lengths, MixComponent, synthesize


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = synthesize(
        500,
        rate_rps=4.0,
        burstiness_cv=2.0,
        prefix_groups=3,
        prefix_fraction=0.5,
        prefix_tokens=512,
        seed=7,
    )
    b = synthesize(
        500,
        rate_rps=4.0,
        burstiness_cv=2.0,
        prefix_groups=3,
        prefix_fraction=0.5,
        prefix_tokens=512,
        seed=7,
    )
    c = synthesize(
        500,
        rate_rps=4.0,
        burstiness_cv=2.0,
        prefix_groups=3,
        prefix_fraction=0.5,
        prefix_tokens=512,
        seed=8,
    )
    assert a == b
    assert a.requests != c.requests


def test_poisson_arrivals_have_the_rate_and_unit_cv() -> None:
    trace = synthesize(20_000, rate_rps=5.0, seed=1)
    stats = inspect_trace(trace)
    assert trace.requests[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert stats["mean_rate_rps"] == pytest.approx(5.0, rel=0.03)
    assert stats["burstiness_cv"] == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.25, 2.0])
def test_gamma_arrivals_have_the_burstiness(cv: float) -> None:
    stats = inspect_trace(synthesize(50_000, rate_rps=10.0, burstiness_cv=cv, seed=2))
    assert stats["mean_rate_rps"] == pytest.approx(10.0, rel=0.05)
    assert stats["burstiness_cv"] == pytest.approx(cv, rel=0.1)


def test_duration_mode_fills_the_duration() -> None:
    trace = synthesize(rate_rps=20.0, duration_s=300.0, seed=3)
    assert all(0 <= r.arrival_s < 300.0 for r in trace.requests)
    assert len(trace) == pytest.approx(6000, rel=0.06)
    assert trace.requests[-1].arrival_s > 290.0


def test_mix_weights_and_fixed_lengths() -> None:
    mix = [
        MixComponent(3.0, Lengths.fixed(100), Lengths.fixed(10)),
        MixComponent(1.0, Lengths.fixed(2000), Lengths.fixed(300)),
    ]
    trace = synthesize(8000, rate_rps=1.0, mix=mix, seed=4)
    pairs = {(r.input_tokens, r.output_tokens) for r in trace.requests}
    assert pairs == {(100, 10), (2000, 300)}
    short = sum(1 for r in trace.requests if r.input_tokens == 100) / len(trace)
    assert short == pytest.approx(0.75, abs=0.02)


def test_lognormal_lengths_have_the_median_and_respect_the_clip() -> None:
    mix = [
        MixComponent(
            1.0, Lengths(1000, sigma=0.5, max_tokens=2500), Lengths(50, sigma=1.0, max_tokens=400)
        )
    ]
    trace = synthesize(20_000, rate_rps=1.0, mix=mix, seed=5)
    inputs = np.array([r.input_tokens for r in trace.requests])
    outputs = np.array([r.output_tokens for r in trace.requests])
    assert np.median(inputs) == pytest.approx(1000, rel=0.03)
    assert np.median(outputs) == pytest.approx(50, rel=0.05)
    assert inputs.max() == 2500 and outputs.max() == 400
    assert inputs.min() >= 1 and outputs.min() >= 1


def test_shared_prefixes() -> None:
    trace = synthesize(
        4000,
        rate_rps=2.0,
        mix=[MixComponent(1.0, Lengths.fixed(300), Lengths.fixed(20))],
        prefix_groups=4,
        prefix_fraction=0.25,
        prefix_tokens=1024,
        block_size=512,
        seed=6,
    )
    with_prefix = [r for r in trace.requests if r.prefix_blocks]
    assert len(with_prefix) / len(trace) == pytest.approx(0.25, abs=0.03)
    assert {r.prefix_blocks for r in with_prefix} == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert all(r.input_tokens == 1024 + 300 for r in with_prefix)
    assert all(r.input_tokens == 300 for r in trace.requests if not r.prefix_blocks)
    # Every prefix use but the first of each group can come from the cache.
    block_tokens = len(with_prefix) * 1024
    assert inspect_trace(trace)["prefix_reuse_ratio"] == pytest.approx(
        (block_tokens - 4 * 1024) / block_tokens
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_requests": 10, "duration_s": 5.0, "rate_rps": 1.0},
        {"rate_rps": 1.0},
        {"num_requests": 10, "rate_rps": 0.0},
        {"num_requests": 10, "rate_rps": 1.0, "burstiness_cv": 0.0},
        {"num_requests": 10, "rate_rps": 1.0, "mix": []},
        {
            "num_requests": 10,
            "rate_rps": 1.0,
            "mix": [MixComponent(0.0, Lengths.fixed(1), Lengths.fixed(1))],
        },
        {
            "num_requests": 10,
            "rate_rps": 1.0,
            "prefix_groups": 2,
            "prefix_fraction": 0.5,
            "prefix_tokens": 100,
        },
        {"num_requests": 10, "rate_rps": 1.0, "prefix_groups": 2, "prefix_fraction": 0.5},
        {"num_requests": 10, "rate_rps": 1.0, "prefix_fraction": 1.5},
    ],
)
def test_bad_parameters_raise_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        synthesize(**kwargs)  # type: ignore[arg-type]
