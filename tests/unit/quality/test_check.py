"""The quality gate's pieces: levers, scoring against a FAKE completions endpoint (httpx's mock
transport answering as vLLM's API does), comparison and judgement. The real servers are in
tests/integration/test_quality_vllm.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from optimizer.quality.check import (
    Comparison,
    QualitySettings,
    Reference,
    compare,
    greedy,
    is_flat,
    judge,
    score,
)
from optimizer.quality.levers import numeric_changes
from optimizer.quality.run import check_configuration, dummy_weights


def test_only_levers_that_change_numbers_count() -> None:
    base = {"max-num-seqs": 128}
    assert numeric_changes({"max-num-seqs": 8, "enable-prefix-caching": False}, base) == {}
    assert numeric_changes({"kv-cache-dtype": "auto"}, base) == {}
    changed = numeric_changes({"kv-cache-dtype": "fp8", "quantization": "fp8"}, base)
    assert set(changed) == {"kv-cache-dtype", "quantization"}
    assert changed["kv-cache-dtype"].startswith("default -> fp8")
    assert set(numeric_changes({"speculative-config": {"method": "ngram"}}, base)) == {
        "speculative-config"
    }


def _fake_vllm(logprob_of: dict[int, float], top: int) -> httpx.Client:
    """A FAKE completions endpoint: greedy answers are token ``top`` repeated; prompt logprobs
    give each token its ``logprob_of`` value and rank 1 when it is ``top``."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("prompt_logprobs"):
            entries: list[Any] = [None]
            for tok in body["prompt"][1:]:
                entry = {str(tok): {"logprob": logprob_of.get(tok, -5.0), "rank": 1}}
                if tok != top:  # vLLM adds the position's own top choice beside the sent token
                    entry = {
                        str(tok): {"logprob": logprob_of.get(tok, -5.0), "rank": 2},
                        str(top): {"logprob": -0.1, "rank": 1},
                    }
                entries.append(entry)
            return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries}]})
        tokens = [f"token_id:{top}"] * body["max_tokens"]
        return httpx.Response(200, json={"choices": [{"logprobs": {"tokens": tokens}}]})

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_greedy_and_teacher_forced_scores_are_read_as_vllm_returns_them() -> None:
    with _fake_vllm({7: -0.25, 9: -3.0}, top=7) as client:
        assert greedy(client, "http://x", "m", [1, 2, 3], 4) == [7, 7, 7, 7]
        logprobs, top1 = score(client, "http://x", "m", [1, 2, 3], [7, 9, 7])
    assert logprobs == [-0.25, -3.0, -0.25] and top1 == [7, 7, 7]


def _reference(floor_diff: float = 0.0) -> Reference:
    floor = Comparison(
        tokens=4,
        top1_agreement=1.0,
        mean_abs_logprob_diff=floor_diff,
        max_abs_logprob_diff=floor_diff,
    )
    return Reference(
        model="m",
        prompts=[[1, 2]],
        continuations=[[3, 4, 5, 6]],
        logprobs=[[-0.1, -0.2, -0.3, -0.4]],
        top1=[[3, 4, 5, 6]],
        floor=floor,
        flat=False,
    )


def test_drift_is_judged_over_the_floor_and_agreement_against_its_threshold() -> None:
    ref, settings = _reference(), QualitySettings()
    same = compare(ref.logprobs, ref.top1, ref.logprobs, ref.top1)
    assert (same.top1_agreement, same.mean_abs_logprob_diff) == (1.0, 0.0)
    assert judge(same, ref, {"kv-cache-dtype": "x"}, settings).status == "pass"
    moved = compare(ref.logprobs, ref.top1, [[-0.4, -0.5, -0.6, -0.7]], ref.top1)
    assert moved.mean_abs_logprob_diff == pytest.approx(0.3)
    verdict = judge(moved, ref, {"kv-cache-dtype": "x"}, settings)
    assert verdict.status == "fail" and "logprob drift 0.3000" in verdict.reason
    assert judge(moved, _reference(floor_diff=0.25), {}, settings).status == "pass"
    flipped = compare(ref.logprobs, ref.top1, ref.logprobs, [[3, 9, 5, 6]])
    verdict = judge(flipped, ref, {}, settings)
    assert verdict.status == "fail" and "top-1 agreement 0.750" in verdict.reason
    assert "quality fail: top-1 agreement 0.750" in verdict.line()


def test_a_diverging_greedy_answer_fails_only_where_speculation_is_a_lever() -> None:
    ref, settings = _reference(), QualitySettings()
    diverged = compare(ref.logprobs, ref.top1, ref.logprobs, ref.top1, greedy_shares=[0.5])
    assert judge(diverged, ref, {"kv-cache-dtype": "x"}, settings).status == "pass"
    verdict = judge(diverged, ref, {"speculative-config": "x"}, settings)
    assert verdict.status == "fail" and "greedy continuations match 0.500" in verdict.reason


def test_flat_logits_are_recognised() -> None:
    uniform = -math.log(4096)
    assert is_flat([[uniform] * 5, [uniform + 0.001] * 3], 4096)
    assert not is_flat([[-0.1, -2.0, -7.0]], 4096)


def test_unchanged_and_dummy_configurations_start_no_server(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert dummy_weights(str(model), {}) and not dummy_weights("org/name", {})
    kwargs: dict[str, Any] = dict(
        env={}, workdir=tmp_path / "q", settings=QualitySettings(), prompts=[[1, 2, 3]]
    )
    verdict = check_configuration(str(model), {"max-num-seqs": 8}, {}, **kwargs)
    assert verdict.status == "unchanged" and "by construction" in verdict.reason
    verdict = check_configuration(str(model), {"kv-cache-dtype": "fp8"}, {}, **kwargs)
    assert verdict.status == "skipped" and "dummy weights" in verdict.reason
    assert "not a pass" in verdict.line()
    assert not (tmp_path / "q").exists()  # no server was started


def test_an_eval_set_names_the_file_and_line_of_a_bad_row(tmp_path: Path) -> None:
    from optimizer.errors import ConfigError
    from optimizer.quality.evalset import load_eval_set

    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "2+2=", "answer": "4"}\n\n{"prompt": "a", "answer": "b"}\n')
    assert [i.answer for i in load_eval_set(good)] == ["4", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: each line needs"):
        load_eval_set(bad)
    bad.write_text("{nope\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: not JSON"):
        load_eval_set(bad)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no items"):
        load_eval_set(tmp_path / "empty.jsonl")


def test_the_accuracy_ratio_fails_a_candidate_and_a_baseline_at_zero_says_nothing() -> None:
    from dataclasses import replace

    ref, settings = _reference(), QualitySettings()
    same = compare(ref.logprobs, ref.top1, ref.logprobs, ref.top1)
    ref.accuracy = 0.8
    verdict = judge(replace(same, accuracy=0.6), ref, {}, settings)
    assert verdict.status == "fail" and "eval accuracy 0.600 against the baseline's 0.800" in (
        verdict.reason
    )
    assert judge(replace(same, accuracy=0.78), ref, {}, settings).status == "pass"
    ref.accuracy = 0.0
    verdict = judge(replace(same, accuracy=0.0), ref, {}, settings)
    assert verdict.status == "pass" and "says nothing" in verdict.reason
