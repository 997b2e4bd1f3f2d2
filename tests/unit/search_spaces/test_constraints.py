"""Tests for search_spaces.constraints: each rule violated and satisfied, absent flags skipped."""

from __future__ import annotations

from typing import Any

import pytest

from search_spaces import ConstraintContext, check_constraints

GPU = ConstraintContext(gpus_per_trial=2, longest_request_tokens=3000, model_max_len=8192)
CPU = ConstraintContext(gpus_per_trial=1, longest_request_tokens=500, cpu_build=True)


def _one(args: dict[str, Any], ctx: ConstraintContext = GPU) -> str:
    problems = check_constraints(args, ctx)
    assert len(problems) == 1, problems
    return problems[0]


def test_empty_args_are_vllm_defaults() -> None:
    assert check_constraints({}, GPU) == []
    assert check_constraints({}, CPU) == []


def test_none_means_absent() -> None:
    args = {"max-num-seqs": 512, "max-num-batched-tokens": None, "max-model-len": None}
    assert check_constraints(args, GPU) == []


class TestBatchedTokens:
    def test_violated(self) -> None:
        problem = _one({"max-num-batched-tokens": 256, "max-num-seqs": 512})
        assert "max-num-batched-tokens (256) < max-num-seqs (512)" in problem

    @pytest.mark.parametrize("batched", [512, 1024])
    def test_satisfied(self, batched: int) -> None:
        assert (
            check_constraints({"max-num-batched-tokens": batched, "max-num-seqs": 512}, GPU) == []
        )

    def test_snake_case_keys(self) -> None:
        assert check_constraints({"max_num_batched_tokens": 8, "max_num_seqs": 16}, GPU)


class TestChunkedPrefillOff:
    def test_violated_with_max_model_len(self) -> None:
        args = {
            "enable-chunked-prefill": False,
            "max-num-batched-tokens": 2048,
            "max-model-len": 4096,
        }
        assert "chunked prefill is off" in _one(args)

    def test_satisfied_with_max_model_len(self) -> None:
        args = {
            "enable-chunked-prefill": False,
            "max-num-batched-tokens": 4096,
            "max-model-len": 4096,
        }
        assert check_constraints(args, GPU) == []

    def test_uses_model_max_len_when_absent(self) -> None:
        args = {"enable-chunked-prefill": False, "max-num-batched-tokens": 4096}
        assert "the model's maximum length (8192)" in _one(args)
        args["max-num-batched-tokens"] = 8192
        assert check_constraints(args, GPU) == []

    def test_unknown_lengths_not_checked(self) -> None:
        args = {"enable-chunked-prefill": False, "max-num-batched-tokens": 16}
        assert check_constraints(args, CPU) == []

    def test_negated_flag_spelling(self) -> None:
        args = {
            "no-enable-chunked-prefill": True,
            "max-num-batched-tokens": 2048,
            "max-model-len": 4096,
        }
        assert "chunked prefill is off" in _one(args)

    @pytest.mark.parametrize("chunked", [True, None])
    def test_on_or_default_not_checked(self, chunked: bool | None) -> None:
        args = {
            "enable-chunked-prefill": chunked,
            "max-num-batched-tokens": 2048,
            "max-model-len": 4096,
        }
        assert check_constraints(args, GPU) == []


class TestParallel:
    @pytest.mark.parametrize(
        "args",
        [{"tensor-parallel-size": 4}, {"tensor-parallel-size": 2, "pipeline-parallel-size": 2}],
    )
    def test_violated(self, args: dict[str, int]) -> None:
        assert "a trial has 2" in _one(args)

    @pytest.mark.parametrize(
        "args",
        [
            {"tensor-parallel-size": 2},
            {"pipeline-parallel-size": 2},
            {"tensor-parallel-size": 2, "pipeline-parallel-size": 1},
        ],
    )
    def test_satisfied(self, args: dict[str, int]) -> None:
        assert check_constraints(args, GPU) == []

    def test_context_rejects_zero_gpus(self) -> None:
        with pytest.raises(ValueError, match="gpus_per_trial"):
            ConstraintContext(gpus_per_trial=0, longest_request_tokens=1)


class TestMaxModelLen:
    def test_shorter_than_longest_request(self) -> None:
        assert "longest request of the trace (3000" in _one({"max-model-len": 2048})

    def test_exactly_longest_request(self) -> None:
        assert check_constraints({"max-model-len": 3000}, GPU) == []

    def test_longer_than_model(self) -> None:
        assert "model's maximum length (8192)" in _one({"max-model-len": 16384})

    def test_model_max_unknown(self) -> None:
        ctx = ConstraintContext(gpus_per_trial=1, longest_request_tokens=10)
        assert check_constraints({"max-model-len": 1_000_000}, ctx) == []

    def test_both_rules_can_fire_together(self) -> None:
        ctx = ConstraintContext(gpus_per_trial=1, longest_request_tokens=5000, model_max_len=2048)
        assert len(check_constraints({"max-model-len": 4096}, ctx)) == 2
        assert len(check_constraints({"max-model-len": 2048}, ctx)) == 1


class TestBlockSize:
    @pytest.mark.parametrize("block", [16, 48])
    def test_cpu_violated(self, block: int) -> None:
        assert "multiple of 32" in _one({"block-size": block}, CPU)

    @pytest.mark.parametrize("block", [32, 64, 128])
    def test_cpu_satisfied(self, block: int) -> None:
        assert check_constraints({"block-size": block}, CPU) == []

    def test_gpu_not_checked(self) -> None:
        assert check_constraints({"block-size": 16}, GPU) == []


class TestSpeculation:
    def test_zero_tokens(self) -> None:
        args = {"speculative-config": {"method": "ngram", "num_speculative_tokens": 0}}
        assert "num_speculative_tokens (0) must be >= 1" in _one(args)

    def test_json_string(self) -> None:
        args = {"speculative-config": '{"method": "ngram", "num_speculative_tokens": 0}'}
        assert "must be >= 1" in _one(args)

    def test_satisfied(self) -> None:
        args = {"speculative-config": {"method": "ngram", "num_speculative_tokens": 1}}
        assert check_constraints(args, GPU) == []

    def test_off_not_checked(self) -> None:
        args = {"speculative-config": {"method": None, "num_speculative_tokens": 0}}
        assert check_constraints(args, GPU) == []

    def test_prompt_lookup_order(self) -> None:
        spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}
        assert "prompt_lookup_min (5) > prompt_lookup_max (3)" in _one(
            {"speculative-config": {**spec, "prompt_lookup_max": 3}}
        )
        assert (
            check_constraints({"speculative-config": {**spec, "prompt_lookup_max": 5}}, GPU) == []
        )


def test_several_violations_are_all_listed() -> None:
    args = {
        "max-num-seqs": 1024,
        "max-num-batched-tokens": 512,
        "tensor-parallel-size": 8,
        "max-model-len": 256,
        "block-size": 16,
    }
    assert len(check_constraints(args, CPU)) == 4
