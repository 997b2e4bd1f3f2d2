"""Engine-argument validation against a FAKE flag table (the real one comes from vLLM: see the
integration tier) and the CLI's KEY=VALUE parsing."""

from __future__ import annotations

import pytest

from optimizer.cli_engine import parse_engine_args
from optimizer.engine.flags import FlagInfo, normalize_flag, validate_engine_args
from optimizer.errors import ConfigError, EngineArgError

FAKE_FLAGS = {
    "max-num-seqs": FlagInfo("value"),
    "max-num-batched-tokens": FlagInfo("value"),
    "enable-prefix-caching": FlagInfo("bool"),
    "no-enable-prefix-caching": FlagInfo("bool"),
    "enforce-eager": FlagInfo("bool"),
    "kv-cache-dtype": FlagInfo("value", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    "model": FlagInfo("value"),
}


def test_misspelled_flag_names_the_closest_valid_one() -> None:
    with pytest.raises(EngineArgError) as info:
        validate_engine_args({"max-num-seq": 8}, FAKE_FLAGS)
    assert info.value.suggestion == "max-num-seqs"
    assert "did you mean 'max-num-seqs'" in str(info.value)


def test_snake_case_and_dashes_are_accepted() -> None:
    validate_engine_args({"max_num_seqs": 8, "--enforce-eager": True}, FAKE_FLAGS)
    assert normalize_flag("--max_num_batched_tokens") == "max-num-batched-tokens"


def test_boolean_flag_needs_a_boolean() -> None:
    with pytest.raises(EngineArgError, match="boolean"):
        validate_engine_args({"enable-prefix-caching": "yes"}, FAKE_FLAGS)
    validate_engine_args({"enable-prefix-caching": False}, FAKE_FLAGS)


def test_choice_outside_the_declared_choices() -> None:
    with pytest.raises(EngineArgError) as info:
        validate_engine_args({"kv-cache-dtype": "fp9"}, FAKE_FLAGS)
    assert info.value.suggestion in ("fp8", "fp8_e4m3", "fp8_e5m2")


def test_reserved_flags_are_refused() -> None:
    with pytest.raises(EngineArgError, match="set by the tuner"):
        validate_engine_args({"model": "x"}, FAKE_FLAGS)


def test_engine_arg_values_keep_their_types() -> None:
    args = parse_engine_args(
        [
            "max-num-seqs=64",
            "enforce-eager=false",
            "gpu-memory-utilization=0.9",
            'speculative-config={"method": "ngram", "num_speculative_tokens": 3}',
            "kv-cache-dtype=fp8",
        ]
    )
    assert args == {
        "max-num-seqs": 64,
        "enforce-eager": False,
        "gpu-memory-utilization": 0.9,
        "speculative-config": {"method": "ngram", "num_speculative_tokens": 3},
        "kv-cache-dtype": "fp8",
    }
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_engine_args(["max-num-seqs"])
