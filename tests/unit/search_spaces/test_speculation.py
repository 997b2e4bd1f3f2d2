"""Speculative decoding at a stated acceptance: the flag assembly, vLLM's rules, the export view."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from search_spaces import ConstraintContext, check_constraints
from search_spaces.speculation import (
    speculation_possible,
    stated_acceptance,
    synthetic_assumption,
    with_acceptance,
    without_synthetic,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
CTX = ConstraintContext(gpus_per_trial=1, longest_request_tokens=100)


def test_a_stated_length_joins_an_enabled_speculative_config_and_nothing_else() -> None:
    args = {"max-num-seqs": 64, "speculative-config": dict(NGRAM)}
    out = with_acceptance(args, length=2.5)
    assert out["speculative-config"] == {
        **NGRAM,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": 2.5,
    }
    assert args["speculative-config"] == NGRAM  # the caller's dict is not changed
    assert out["max-num-seqs"] == 64
    # Speculation off (no flag, a null method) or no assumption: unchanged.
    assert with_acceptance({"max-num-seqs": 64}, length=2.5) == {"max-num-seqs": 64}
    off = {"speculative-config": {"method": None}}
    assert with_acceptance(off, length=2.5) == off
    assert with_acceptance(args) == args


def test_stated_rates_are_cut_to_the_trials_speculative_tokens() -> None:
    out = with_acceptance({"speculative-config": dict(NGRAM)}, rates=[0.9, 0.7, 0.5, 0.3, 0.1])
    assert out["speculative-config"]["synthetic_acceptance_rates"] == [0.9, 0.7, 0.5]
    assert "synthetic_acceptance_length" not in out["speculative-config"]
    assert check_constraints({"speculative-config": out["speculative-config"]}, CTX) == []


def test_a_json_string_flag_is_read_too() -> None:
    out = with_acceptance(
        {"speculative-config": '{"method": "ngram", "num_speculative_tokens": 2}'}, length=2.0
    )
    assert out["speculative-config"]["synthetic_acceptance_length"] == 2.0


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (
            {**NGRAM, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.5},
            "cannot happen with num_speculative_tokens 3",
        ),
        (
            {
                **NGRAM,
                "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": [0.9, 0.8],
            },
            "2 per-position rates but the trial drafts 3",
        ),
        (
            {
                **NGRAM,
                "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": [0.5, 0.8, 0.2],
            },
            "must not increase",
        ),
        ({**NGRAM, "rejection_sample_method": "synthetic"}, "exactly one of"),
    ],
)
def test_what_vllm_would_refuse_is_a_constraint_violation_before_a_server_starts(
    spec: dict[str, Any], needle: str
) -> None:
    problems = check_constraints({"speculative-config": spec}, CTX)
    assert any(needle in p for p in problems), problems


def test_a_reachable_length_passes() -> None:
    spec = {**NGRAM, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.0}
    assert check_constraints({"speculative-config": spec}, CTX) == []


def test_the_deployment_view_drops_the_synthetic_sampler_and_says_what_was_assumed() -> None:
    tuned = with_acceptance({"max-num-seqs": 8, "speculative-config": dict(NGRAM)}, length=2.5)
    assert without_synthetic(tuned) == {"max-num-seqs": 8, "speculative-config": NGRAM}
    line = synthetic_assumption(tuned)
    assert line is not None and "mean acceptance length 2.5" in line and "ngram, 3 tokens" in line
    assert synthetic_assumption({"speculative-config": NGRAM}) is None
    assert without_synthetic({"max-num-seqs": 8}) == {"max-num-seqs": 8}


def test_speculation_possible_reads_the_space_and_the_fixed_args() -> None:
    tuned = {"speculative-config.method": SimpleNamespace(choices=[None, "ngram"])}
    never = {"speculative-config.method": SimpleNamespace(choices=[None])}
    assert speculation_possible(tuned, [{}])
    assert not speculation_possible(never, [{}])
    assert not speculation_possible({}, [{"max-num-seqs": 4}])
    assert speculation_possible({}, [{"speculative-config": NGRAM}])


def test_stated_acceptance_reads_a_plan_document() -> None:
    plan = {
        "job": {"engine": {"speculation": {"acceptance_length": 2.5, "acceptance_rates": None}}}
    }
    assert stated_acceptance(plan) == "mean acceptance length 2.5"
    rates = {"job": {"engine": {"speculation": {"acceptance_rates": [0.8, 0.5]}}}}
    assert stated_acceptance(rates) == "per-position acceptance rates [0.8, 0.5]"
    assert stated_acceptance({}) is None and stated_acceptance({"job": {"engine": {}}}) is None
