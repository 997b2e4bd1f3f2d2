"""A serving engineer's short reading of one trial: what bound it, and what to change."""

from __future__ import annotations

from typing import Any

from optuna.trial import FrozenTrial

from optimizer.analysis.front import finite
from optimizer.trial_view import TrialView

__all__ = ["diagnose"]


_FAILURE_HINTS = {
    "oom_at_load": "out of memory while loading the weights: shard them (tensor-parallel-size), "
    "quantize, or leave more memory free",
    "kv_cache_too_small": "the KV cache cannot hold one max-model-len request: more KV memory "
    "or a smaller max-model-len",
    "invalid_argument": "vLLM refused an argument (see the log)",
    "cuda_error": "CUDA error: driver, kernel or hardware (see the log)",
    "engine_crashed": "the engine crashed (see the log tail)",
    "startup_timeout": "not healthy within the startup timeout (compilation or weight loading)",
}


def diagnose(t: FrozenTrial, trace_stats: dict[str, Any] | None = None) -> list[str]:
    """A serving engineer's short reading of one trial's measurements.

    TTFT-bound (time before the first token dominates: prefill queueing) vs TPOT-bound
    (decode dominates), the KV cache's capacity against the concurrency the trace produced
    (Little's law: request throughput x mean end-to-end latency), preemptions and prefix-cache
    hits from the server's metrics, and which SLOs were missed.

    Args:
        t: The trial.
        trace_stats: :func:`optimizer.workload.stats.inspect_trace` of the replayed trace.

    Returns:
        Sentences, most important first.
    """
    status = TrialView(t).status
    message = TrialView(t).message.strip().splitlines()
    first = message[0][:200] if message else ""
    unmeasured = _unmeasured(t, status, first)
    if unmeasured is not None:
        return unmeasured
    s = {k: v for k, v in TrialView(t).summary.items() if finite(v) is not None}
    mem = TrialView(t).memory
    server = TrialView(t).server_metrics
    lines: list[str] = []
    missed = [name for name, m in t.constraints.items() if m > 0]
    if missed:
        lines.append("misses " + ", ".join(missed) + (f" ({first})" if first else "") + ".")
    lines += _latency_shape(s, trace_stats)
    lines += _kv_capacity(t, s, mem)
    lines += _server_counters(server)
    return lines or ["no measurements to read."]


def _unmeasured(t: FrozenTrial, status: str, first: str) -> list[str] | None:
    """The reading of a trial that has no measurements to read (None: it has)."""
    if status == "rejected":
        return [f"rejected before any engine started: {first}"]
    if status == "failed":
        fc = TrialView(t).failure_class
        hint = _FAILURE_HINTS.get(fc, "the engine failed")
        return [f"engine failed ({fc or 'unknown'}): {hint}."] + ([first] if first else [])
    if status == "invalid_replay":
        return ["the replay client could not keep the schedule: not scored, retried."]
    if status == "driver_died":
        return ["the driver died while this trial ran; its configuration was re-queued."]
    return None


def _latency_shape(s: dict[str, Any], trace_stats: dict[str, Any] | None) -> list[str]:
    """TTFT-bound, TPOT-bound or balanced, and a TTFT tail from queueing under bursts."""
    lines: list[str] = []
    ttft95, e2el95 = s.get("p95_ttft_ms"), s.get("p95_e2el_ms")
    tpot95, ttft50 = s.get("p95_tpot_ms"), s.get("median_ttft_ms") or s.get("p50_ttft_ms")
    if ttft95 and e2el95:
        share = ttft95 / e2el95
        if share >= 0.5:
            lines.append(
                f"TTFT-bound: p95 TTFT is {share:.0%} of p95 end-to-end latency; requests wait "
                "for prefill (queueing): more max-num-batched-tokens / max-num-seqs, chunked "
                "prefill, or more KV cache to admit them sooner."
            )
        elif share <= 0.2:
            lines.append(
                f"TPOT-bound: decode dominates (p95 TPOT {tpot95 or float('nan'):.1f} ms, TTFT "
                f"{share:.0%} of E2EL); a smaller decode batch (max-num-seqs) or speculative "
                "decoding lowers TPOT, at some throughput."
            )
        else:
            lines.append(f"balanced: p95 TTFT is {share:.0%} of p95 end-to-end latency.")
    if ttft95 and ttft50 and ttft95 / ttft50 > 3:
        cv = (trace_stats or {}).get("burstiness_cv")
        lines.append(
            f"TTFT tail p95/p50 = {ttft95 / ttft50:.1f}: queueing under bursts"
            + (f" (trace burstiness CV {cv:.2f})." if isinstance(cv, int | float) else ".")
        )
    return lines


def _kv_capacity(t: FrozenTrial, s: dict[str, Any], mem: dict[str, Any]) -> list[str]:
    """The KV cache against the concurrency the trace produced (Little's law)."""
    lines: list[str] = []
    kv_tokens = finite(mem.get("kv_cache_tokens"))
    thr, mean_e2el = s.get("request_throughput"), s.get("mean_e2el_ms")
    if kv_tokens and thr and mean_e2el and s.get("completed"):
        in_flight = thr * mean_e2el / 1000.0
        per_request = (s.get("total_input_tokens", 0.0) + s.get("total_output_tokens", 0.0)) / s[
            "completed"
        ]
        need = in_flight * per_request
        holds = kv_tokens / per_request if per_request else float("inf")
        conc = finite(mem.get("max_concurrency"))
        text = (
            f"KV cache {kv_tokens:,.0f} tokens holds ~{holds:,.0f} requests of this trace "
            f"(max concurrency {conc:.1f}x at max-model-len); ~{in_flight:.1f} were in flight"
            if conc
            else f"KV cache {kv_tokens:,.0f} tokens holds ~{holds:,.0f} requests of this trace; "
            f"~{in_flight:.1f} were in flight"
        )
        if need > 0.8 * kv_tokens:
            text += ": capacity-bound (more KV memory, fp8 KV cache, smaller max-model-len)."
        else:
            text += f": ample ({need / kv_tokens:.0%} used on average)."
        lines.append(text)
        seqs = finite(TrialView(t).engine_args.get("max-num-seqs"))
        if seqs and holds < seqs:
            lines.append(
                f"max-num-seqs={seqs:.0f} exceeds what the KV cache holds (~{holds:.0f}): "
                "the scheduler will preempt under load."
            )
    return lines


def _server_counters(server: dict[str, Any]) -> list[str]:
    """Preemptions and the prefix-cache hit rate from the server's metrics."""
    lines: list[str] = []
    pre = finite(server.get("vllm:num_preemptions_total"))
    if pre is not None:
        lines.append(
            f"{pre:.0f} preemptions: KV cache exhausted mid-decode, work recomputed."
            if pre > 0
            else "no preemptions."
        )
    queries = finite(server.get("vllm:prefix_cache_queries_total"))
    hits = finite(server.get("vllm:prefix_cache_hits_total"))
    if queries and hits is not None:
        lines.append(f"prefix cache hit rate {hits / queries:.0%}.")
    return lines
