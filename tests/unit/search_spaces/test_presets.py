"""Every shipped search-space preset loads, suggests valid values and passes its own checks."""

from __future__ import annotations

import optuna
import pytest

from search_spaces import ConstraintContext, check_constraints, list_presets, load_space

optuna.logging.set_verbosity(optuna.logging.WARNING)

PRESETS = ("default", "memory", "latency", "parallel", "cpu-small")


def test_all_presets_are_listed() -> None:
    assert set(PRESETS) <= set(list_presets())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_suggests(name: str) -> None:
    space = load_space(name)
    assert space.name == name
    assert space.description
    assert space.params
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(30):
        trial = study.ask()
        args = space.suggest(trial)
        assert set(args) <= set(space.flag_values())
        assert space.enqueue_params(args) == pytest.approx(trial.params)
        problems = check_constraints(args, ConstraintContext(8, longest_request_tokens=1))
        assert not [p for p in problems if "speculative" in p]
        study.tell(trial, 0.0)
    # Fixed flags are validated one by one against vLLM's parser, so none is dotted.
    assert all("." not in flag for flag in space.fixed)
    for flag, values in space.flag_values().items():
        assert flag == flag.lower() and "_" not in flag, flag
        assert values, flag


def test_default_block_sizes_are_multiples_of_16() -> None:
    choices = load_space("default").flag_values()["block-size"]
    assert choices and all(v % 16 == 0 for v in choices)


def test_cpu_small_satisfies_cpu_block_rule() -> None:
    space = load_space("cpu-small")
    ctx = ConstraintContext(gpus_per_trial=1, longest_request_tokens=256, cpu_build=True)
    for block in space.flag_values()["block-size"]:
        assert check_constraints({"block-size": block}, ctx) == []
    assert space.flag_values()["max-num-seqs"] == [1, 64]


def test_latency_speculation_is_conditional() -> None:
    space = load_space("latency")
    off = space.suggest(optuna.trial.FixedTrial(_latency_params(method=None)))
    assert "speculative-config" not in off
    on = space.suggest(optuna.trial.FixedTrial(_latency_params(method="ngram")))
    assert on["speculative-config"] == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 5,
    }
    ctx = ConstraintContext(gpus_per_trial=1, longest_request_tokens=100)
    assert check_constraints(on, ctx) == []


def test_memory_quantization_null_is_left_out() -> None:
    values = load_space("memory").flag_values()
    assert values["quantization"] == [None, "fp8"]
    assert values["kv-cache-dtype"] == ["auto", "fp8"]


def test_parallel_sizes() -> None:
    values = load_space("parallel").flag_values()
    assert values["tensor-parallel-size"] == [1, 2, 4, 8]
    assert values["pipeline-parallel-size"] == [1, 2]


def _latency_params(method: str | None) -> dict[str, object]:
    params: dict[str, object] = {
        "max-num-seqs": 64,
        "max-num-batched-tokens": 2048,
        "enable-chunked-prefill": True,
        "gpu-memory-utilization": 0.9,
        "enable-prefix-caching": True,
        "enforce-eager": False,
        "speculative-config.method": method,
    }
    if method is not None:
        params["speculative-config.num_speculative_tokens"] = 4
        params["speculative-config.prompt_lookup_min"] = 1
        params["speculative-config.prompt_lookup_max"] = 5
    return params
