"""Tests for search_spaces.schema: validation messages, conditional suggestion, dotted flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.errors import ConfigError
from search_spaces import SearchSpace, SearchSpaceError, load_space, normalize_flag

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(seed: int = 0) -> optuna.Study:
    return optuna.create_study(
        storage=optuna.storages.InMemoryStorage(),
        sampler=optuna.samplers.RandomSampler(seed=seed),
    )


def _run(space: SearchSpace, n: int = 200, seed: int = 0) -> list[tuple[dict[str, Any], Any]]:
    study = _study(seed)
    out = []
    for _ in range(n):
        trial = study.ask()
        args = space.suggest(trial)
        out.append((args, trial.params))
        study.tell(trial, 0.0)
    return out


CHUNKED = {
    "name": "chunked",
    "params": {
        "enable-chunked-prefill": {"type": "categorical", "choices": [True, False]},
        "long-prefill-token-threshold": {
            "type": "int",
            "low": 64,
            "high": 1024,
            "step": 64,
            "when": {"enable-chunked-prefill": True},
        },
    },
}

SPEC = {
    "name": "spec",
    "fixed": {"speculative-config.prompt_lookup_min": 2, "max-num-seqs": 64},
    "params": {
        "speculative-config.method": {"type": "categorical", "choices": [None, "ngram"]},
        "speculative-config.num_speculative_tokens": {
            "type": "int",
            "low": 1,
            "high": 8,
            "when": {"speculative-config.method": "ngram"},
        },
        "speculative_config.prompt-lookup-max": {
            "type": "int",
            "low": 2,
            "high": 8,
            "when": {"speculative-config.method": ["ngram"]},
        },
    },
}


class TestNormalize:
    @pytest.mark.parametrize(
        ("raw", "expected"),
        [
            ("max_num_seqs", "max-num-seqs"),
            ("--max-num-seqs", "max-num-seqs"),
            (
                "speculative_config.num-speculative-tokens",
                "speculative-config.num_speculative_tokens",
            ),
        ],
    )
    def test_flag(self, raw: str, expected: str) -> None:
        assert normalize_flag(raw) == expected

    def test_snake_case_keys_are_normalized_on_load(self) -> None:
        space = load_space(
            {
                "fixed": {"enable_prefix_caching": True},
                "params": {
                    "max_num_seqs": {"type": "int", "low": 1, "high": 8},
                    "max_num_batched_tokens": {
                        "type": "categorical",
                        "choices": [512, 1024],
                        "when": {"enable_prefix_caching": True},
                    },
                },
            }
        )
        assert list(space.params) == ["max-num-seqs", "max-num-batched-tokens"]
        assert space.fixed == {"enable-prefix-caching": True}

    def test_repeated_flag_after_normalizing(self) -> None:
        with pytest.raises(SearchSpaceError, match="repeats the flag 'max-num-seqs'"):
            load_space({"fixed": {"max_num_seqs": 1, "max-num-seqs": 2}})


class TestValidation:
    @pytest.mark.parametrize(
        ("space", "pattern"),
        [
            ({"parms": {}}, r"unknown key 'parms'; did you mean 'params'\?"),
            (
                {"params": {"max-num-seqs": {"type": "int", "low": 1, "hgih": 5}}},
                r"params\.max-num-seqs: unknown key 'hgih'; did you mean 'high'\?",
            ),
            (
                {"params": {"block-size": {"type": "categorical", "choice": [16]}}},
                r"params\.block-size: unknown key 'choice'; did you mean 'choices'\?",
            ),
            (
                {"params": {"x": {"type": "integer", "low": 1, "high": 5}}},
                r"unknown type 'integer'; did you mean 'int'\?",
            ),
            ({"params": {"x": {"low": 1, "high": 5}}}, r"params\.x: missing `type`"),
            ({"params": {"x": {"type": "int", "low": 5, "high": 5}}}, r"low \(5\) must be < high"),
            ({"params": {"x": {"type": "float", "low": 1.0, "high": 0.5}}}, "must be < high"),
            ({"params": {"x": {"type": "int", "low": 0, "high": 5, "log": True}}}, "low > 0"),
            (
                {"params": {"x": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}},
                "low > 0",
            ),
            (
                {"params": {"x": {"type": "int", "low": 1, "high": 10, "step": 4}}},
                r"step 4 does not divide high - low = 9",
            ),
            (
                {"params": {"x": {"type": "float", "low": 0.0, "high": 1.0, "step": 0.3}}},
                "step 0.3 does not divide",
            ),
            (
                {"params": {"x": {"type": "int", "low": 1, "high": 8, "step": 7, "log": True}}},
                "log: true cannot be combined",
            ),
            ({"params": {"x": {"type": "int", "low": 1.5, "high": 8}}}, r"params\.x\.low"),
            ({"params": {"x": {"type": "categorical", "choices": []}}}, r"params\.x\.choices"),
            (
                {"params": {"x": {"type": "categorical", "choices": [True, 1, True]}}},
                "choice True is listed twice",
            ),
            ({"params": {"model": {"type": "int", "low": 1, "high": 2}}}, "set by the tuner"),
            (
                {
                    "fixed": {"max-num-seqs": 4},
                    "params": {"max_num_seqs": {"type": "int", "low": 1, "high": 2}},
                },
                "both fixed and a param",
            ),
            (
                {"params": {"speculative-config.x.y": {"type": "int", "low": 1, "high": 2}}},
                "not a vllm serve flag name",
            ),
            (
                {
                    "params": {
                        "speculative-config": {"type": "categorical", "choices": ["a"]},
                        "speculative-config.method": {"type": "categorical", "choices": ["b"]},
                    }
                },
                "also has dotted keys",
            ),
        ],
    )
    def test_error_names_key_and_fix(self, space: dict[str, Any], pattern: str) -> None:
        with pytest.raises(SearchSpaceError, match=pattern):
            load_space(space)

    def test_error_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError):
            load_space({"nmae": "x"})

    def test_when_must_refer_to_an_earlier_param(self) -> None:
        space = {
            "params": {
                "x": {"type": "int", "low": 1, "high": 2, "when": {"y": 1}},
                "y": {"type": "categorical", "choices": [1, 2]},
            }
        }
        with pytest.raises(SearchSpaceError, match="move 'y' before 'x'"):
            load_space(space)

    def test_when_on_itself(self) -> None:
        space = {"params": {"x": {"type": "categorical", "choices": [1], "when": {"x": 1}}}}
        with pytest.raises(SearchSpaceError, match="cannot depend on itself"):
            load_space(space)

    def test_when_unknown_name_suggests_closest(self) -> None:
        space = {
            "fixed": {"enable-chunked-prefill": True},
            "params": {
                "x": {
                    "type": "int",
                    "low": 1,
                    "high": 2,
                    "when": {"enable-chunked-prefil": True},
                }
            },
        }
        with pytest.raises(SearchSpaceError, match="did you mean 'enable-chunked-prefill'"):
            load_space(space)

    def test_when_value_outside_choices(self) -> None:
        space = {
            "params": {
                "y": {"type": "categorical", "choices": [True, False]},
                "x": {"type": "int", "low": 1, "high": 2, "when": {"y": "true"}},
            }
        }
        with pytest.raises(SearchSpaceError, match="'true' is not a value 'y' can take"):
            load_space(space)

    def test_when_never_true_on_fixed(self) -> None:
        space = {
            "fixed": {"a": 4},
            "params": {"x": {"type": "categorical", "choices": [1, 2], "when": {"a": 5}}},
        }
        with pytest.raises(SearchSpaceError, match="would never be suggested"):
            load_space(space)


class TestLoad:
    def test_unknown_preset_suggests_closest(self) -> None:
        with pytest.raises(SearchSpaceError, match="did you mean 'default'"):
            load_space("defualt")

    def test_yaml_file(self, tmp_path: Path) -> None:
        path = tmp_path / "mine.yaml"
        path.write_text(
            "name: mine\nparams:\n  max_num_seqs: {type: int, low: 1, high: 16, log: true}\n"
        )
        space = load_space(path)
        assert space.name == "mine"
        assert list(space.params) == ["max-num-seqs"]
        assert load_space(str(path)) == space

    def test_yaml_error_names_the_file(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.yaml"
        path.write_text("params:\n  x: {type: int, low: 1, hihg: 2}\n")
        with pytest.raises(SearchSpaceError, match=r"bad\.yaml: params\.x: unknown key 'hihg'"):
            load_space(path)

    def test_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(SearchSpaceError, match="cannot read"):
            load_space(tmp_path / "none.yaml")

    def test_not_a_mapping(self, tmp_path: Path) -> None:
        path = tmp_path / "list.yaml"
        path.write_text("- a\n- b\n")
        with pytest.raises(SearchSpaceError, match="a search space is a mapping"):
            load_space(path)


class TestSuggest:
    def test_conditional_only_when_condition_holds(self) -> None:
        space = load_space(CHUNKED)
        seen = {True: 0, False: 0}
        for args, params in _run(space):
            on = args["enable-chunked-prefill"]
            seen[on] += 1
            assert ("long-prefill-token-threshold" in args) is on
            assert ("long-prefill-token-threshold" in params) is on
            if on:
                assert args["long-prefill-token-threshold"] % 64 == 0
        assert seen[True] > 0 and seen[False] > 0

    def test_condition_on_fixed_flag(self) -> None:
        space = load_space(
            {
                "fixed": {"enable-chunked-prefill": False},
                "params": {
                    "x": {
                        "type": "int",
                        "low": 1,
                        "high": 2,
                        "when": {"enable-chunked-prefill": [False]},
                    },
                    "y": {"type": "int", "low": 1, "high": 2, "when": {"x": 2}},
                },
            }
        )
        results = _run(space, n=50)
        assert all(args["enable-chunked-prefill"] is False and "x" in args for args, _ in results)
        assert {"y" in args for args, _ in results} == {True, False}
        assert all(("y" in args) == (args["x"] == 2) for args, _ in results)

    def test_dotted_flags_assemble_into_one_dict(self) -> None:
        space = load_space(SPEC)
        results = _run(space)
        off = on = 0
        for args, params in results:
            assert args["max-num-seqs"] == 64
            assert not any("." in key for key in args)
            if params["speculative-config.method"] is None:
                off += 1
                assert "speculative-config" not in args
                assert set(params) == {"speculative-config.method"}
            else:
                on += 1
                spec = args["speculative-config"]
                assert spec["method"] == "ngram"
                assert spec["prompt_lookup_min"] == 2
                assert 1 <= spec["num_speculative_tokens"] <= 8
                assert 2 <= spec["prompt_lookup_max"] <= 8
                assert set(spec) == {
                    "method",
                    "num_speculative_tokens",
                    "prompt_lookup_max",
                    "prompt_lookup_min",
                }
        assert off > 0 and on > 0

    def test_fixed_trial(self) -> None:
        space = load_space(SPEC)
        trial = optuna.trial.FixedTrial(
            {
                "speculative-config.method": "ngram",
                "speculative-config.num_speculative_tokens": 3,
                "speculative-config.prompt_lookup_max": 4,
            }
        )
        assert space.suggest(trial) == {
            "speculative-config": {
                "prompt_lookup_min": 2,
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 4,
            },
            "max-num-seqs": 64,
        }

    def test_null_choice_leaves_the_flag_out(self) -> None:
        space = load_space({"params": {"quantization": {"type": "categorical", "choices": [None]}}})
        assert space.suggest(optuna.trial.FixedTrial({"quantization": None})) == {}

    def test_float_grid_values_are_clean(self) -> None:
        space = load_space(
            {
                "params": {
                    "gpu-memory-utilization": {
                        "type": "float",
                        "low": 0.8,
                        "high": 0.95,
                        "step": 0.01,
                    }
                }
            }
        )
        for args, _ in _run(space, n=50):
            value = args["gpu-memory-utilization"]
            assert value == round(value, 2)
            assert 0.8 <= value <= 0.95

    def test_fixed_dict_merges_with_dotted_keys(self) -> None:
        space = load_space(
            {
                "fixed": {"speculative-config": {"method": "ngram", "prompt_lookup_max": 4}},
                "params": {
                    "speculative-config.num_speculative_tokens": {
                        "type": "int",
                        "low": 1,
                        "high": 4,
                    }
                },
            }
        )
        args = space.suggest(
            optuna.trial.FixedTrial({"speculative-config.num_speculative_tokens": 2})
        )
        assert args == {
            "speculative-config": {
                "method": "ngram",
                "prompt_lookup_max": 4,
                "num_speculative_tokens": 2,
            }
        }


class TestEnqueue:
    @pytest.mark.parametrize("space_ref", [CHUNKED, SPEC, "default", "latency", "memory"])
    def test_round_trip(self, space_ref: Any) -> None:
        space = load_space(space_ref)
        for args, params in _run(space, n=60, seed=3):
            assert space.enqueue_params(args) == pytest.approx(params)

    def test_enqueued_trial_reproduces_args(self) -> None:
        space = load_space(SPEC)
        wanted = {
            "max-num-seqs": 64,
            "speculative-config": {
                "method": "ngram",
                "num_speculative_tokens": 5,
                "prompt_lookup_max": 3,
                "prompt_lookup_min": 2,
            },
        }
        study = _study()
        study.enqueue_trial(space.enqueue_params(wanted))
        trial = study.ask()
        assert space.suggest(trial) == wanted

    def test_absent_null_choice_maps_to_null(self) -> None:
        space = load_space(SPEC)
        assert space.enqueue_params({"max-num-seqs": 64}) == {"speculative-config.method": None}

    def test_only_params_inactive_skipped(self) -> None:
        space = load_space(CHUNKED)
        params = space.enqueue_params(
            {"enable_chunked_prefill": False, "long-prefill-token-threshold": 128, "other": 1}
        )
        assert params == {"enable-chunked-prefill": False}

    def test_out_of_domain_value(self) -> None:
        space = load_space(CHUNKED)
        with pytest.raises(SearchSpaceError, match="long-prefill-token-threshold = 100"):
            space.enqueue_params(
                {"enable-chunked-prefill": True, "long-prefill-token-threshold": 100}
            )


class TestFlagValues:
    def test_top_level_flags_and_representatives(self) -> None:
        space = load_space(SPEC)
        values = space.flag_values()
        assert set(values) == {"speculative-config", "max-num-seqs"}
        assert values["max-num-seqs"] == [64]
        assert values["speculative-config"] == [
            {
                "prompt_lookup_min": 2,
                "method": "ngram",
                "num_speculative_tokens": 1,
                "prompt_lookup_max": 2,
            },
            {
                "prompt_lookup_min": 2,
                "method": "ngram",
                "num_speculative_tokens": 8,
                "prompt_lookup_max": 8,
            },
        ]

    def test_choices_and_bounds(self) -> None:
        values = load_space(CHUNKED).flag_values()
        assert values == {
            "enable-chunked-prefill": [True, False],
            "long-prefill-token-threshold": [64, 1024],
        }

    def test_fixed_base_dict_is_merged_not_listed_alone(self) -> None:
        space = load_space(
            {
                "fixed": {"speculative-config": {"method": "ngram"}},
                "params": {
                    "speculative-config.num_speculative_tokens": {
                        "type": "int",
                        "low": 1,
                        "high": 4,
                    }
                },
            }
        )
        assert space.flag_values() == {
            "speculative-config": [
                {"method": "ngram", "num_speculative_tokens": 1},
                {"method": "ngram", "num_speculative_tokens": 4},
            ]
        }
