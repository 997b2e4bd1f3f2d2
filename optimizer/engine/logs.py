"""Reading a vLLM server's log and /metrics: failure classes, memory account, effective config.

:func:`classify_failure` turns a failed start's log into a :class:`~optimizer.types.FailureClass`
with a one-paragraph explanation and the lines that show why; :func:`parse_memory_account`
reads the startup memory lines (weights, KV cache); :func:`parse_engine_config` the engine's
own config line; :func:`parse_prometheus` and :func:`info_labels` the /metrics text.
"""

from __future__ import annotations

import re
from typing import Any

from optimizer.types import FailureClass, MemoryAccount

__all__ = [
    "LOG_TAIL_LINES",
    "classify_failure",
    "explain",
    "info_labels",
    "parse_engine_config",
    "parse_memory_account",
    "parse_prometheus",
]

#: Log lines a failure carries (the tail, after the lines that match its class).
LOG_TAIL_LINES = 25


# --- failure classification -------------------------------------------------------------------

_KV_TOO_SMALL = re.compile(
    r"KV cache is needed, which is larger than the available KV cache memory"
    r"|larger than the maximum number of tokens that can be stored in KV cache"
    r"|No available memory for the cache blocks"
    r"|Insufficient memory for KV cache"
)
_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|torch\.OutOfMemoryError|out of memory"
    r"|Cannot allocate memory|is less than requested memory for kv"
    r"|less than desired GPU memory utilization|MemoryError",
    re.IGNORECASE,
)
_CUDA = re.compile(
    r"CUDA error|NCCL error|cudaError|CUBLAS_STATUS|CUDNN_STATUS|illegal memory access"
)
_INVALID = re.compile(
    r"error: unrecognized arguments|error: argument |invalid choice|ValidationError|Value error, "
    r"|ValueError|NotImplementedError|is not supported|not supported with"
    r"|must be (?:greater|less|at least|a multiple)"
)
# The server's Python lacks a module vLLM imports for this configuration (e.g. compressed-tensors
# for any quantization in vLLM 0.26): the environment's fault, not the arguments'. Checked first:
# warnings printed before the traceback (transformers' rope checks, say) are no cause.
_MISSING = re.compile(r"ModuleNotFoundError: No module named '(?P<name>[\w.]+)'")
_CAUSE = re.compile(r"Value error, |error: |Error: |ValueError: |RuntimeError: ")
_KV_NUMBERS = re.compile(
    r"max seq len \((?P<len>\d+)\), \((?P<need>[\d.]+) GiB KV cache is needed.*?"
    r"available KV cache memory \((?P<avail>[\d.]+) GiB\)(?:.*?estimated maximum model length is "
    r"(?P<est>\d+))?"
)


def classify_failure(
    log_text: str, *, exit_code: int | None
) -> tuple[FailureClass, tuple[str, ...], str]:
    """Classify a server failure from its log.

    Returns:
        The failure class, the relevant log lines (matching lines, then the tail), and a
        one-paragraph explanation naming what to change.
    """
    lines = [ln.rstrip() for ln in log_text.splitlines() if ln.strip()]
    missing = [ln for ln in lines if _MISSING.search(ln)]
    if missing:
        relevant = tuple(dict.fromkeys(missing[-1:] + lines[-LOG_TAIL_LINES:]))
        return (
            FailureClass.MISSING_MODULE,
            relevant,
            explain(FailureClass.MISSING_MODULE, missing[-1]),
        )
    for cls, pattern in (
        (FailureClass.KV_CACHE_TOO_SMALL, _KV_TOO_SMALL),
        (FailureClass.OOM_AT_LOAD, _OOM),
        (FailureClass.CUDA_ERROR, _CUDA),
        (FailureClass.INVALID_ARGUMENT, _INVALID),
    ):
        hits = [ln for ln in lines if pattern.search(ln)]
        if hits:
            # The line that states the cause beats the traceback lines around it.
            best = [ln for ln in hits if _CAUSE.search(ln)]
            hits = hits + best[-1:]
            relevant = tuple(dict.fromkeys(hits[-5:] + lines[-LOG_TAIL_LINES:]))
            return cls, relevant, explain(cls, "\n".join(hits))
    tail = tuple(lines[-LOG_TAIL_LINES:])
    return (
        FailureClass.ENGINE_CRASHED,
        tail,
        explain(FailureClass.ENGINE_CRASHED, f"exit code {exit_code}"),
    )


def explain(cls: FailureClass, evidence: str) -> str:
    """What a failure of class ``cls`` means and what to change, from its evidence."""
    if cls is FailureClass.KV_CACHE_TOO_SMALL:
        m = _KV_NUMBERS.search(evidence)
        if m:
            est = m.group("est")
            est_txt = f" (about {est} tokens fit)" if est else ""
            sizes = (
                f"needs {m.group('need')} GiB of KV cache, {m.group('avail')} GiB available"
                if float(m.group("need")) > 0
                else "needs more KV cache than is available"  # vLLM rounds tiny sizes to 0.0
            )
            return (
                f"KV cache too small: max-model-len {m.group('len')} {sizes}{est_txt}: "
                "lower max-model-len or "
                "raise gpu-memory-utilization (on the CPU build: VLLM_CPU_KVCACHE_SPACE, in GiB)."
            )
        return (
            "KV cache too small for one request of max-model-len tokens: lower max-model-len, "
            "raise gpu-memory-utilization (CPU build: VLLM_CPU_KVCACHE_SPACE) or quantize the "
            "KV cache (kv-cache-dtype fp8)."
        )
    if cls is FailureClass.OOM_AT_LOAD:
        return (
            "Out of memory while loading: the weights, activations or CUDA graphs do not fit. "
            "Lower gpu-memory-utilization if other processes share the device, use more GPUs "
            "(tensor-parallel-size), a quantized model, or fewer max-num-seqs / "
            "max-num-batched-tokens. Evidence: " + evidence.splitlines()[-1][:300]
        )
    if cls is FailureClass.CUDA_ERROR:
        return (
            "CUDA/NCCL error: the device or the communication library failed. Check that no "
            "other process holds the GPU and that the driver matches the vLLM build. Evidence: "
            + evidence.splitlines()[-1][:300]
        )
    if cls is FailureClass.MISSING_MODULE:
        m = _MISSING.search(evidence)
        name = m.group("name") if m else "?"
        top = name.split(".")[0]
        return (
            f"The server's Python has no module {top!r}, which vLLM imports for this "
            "configuration: the environment is incomplete, the configuration may be fine. "
            f"Install the package that provides {top!r} (vLLM's own requirements pin it; e.g. "
            f"pip install {top.replace('_', '-')}) where the server runs, then re-run this "
            "configuration."
        )
    if cls is FailureClass.INVALID_ARGUMENT:
        return (
            "vLLM refused the configuration: an argument value or combination is invalid for "
            "this model or build. Fix the argument the evidence names: "
            + evidence.splitlines()[-1][:400]
        )
    if cls is FailureClass.STARTUP_TIMEOUT:
        return (
            f"The server did not become healthy within {evidence}. Raise the startup timeout "
            "(large models and torch.compile take minutes) or check the log for a hang."
        )
    return (
        f"The server process died ({evidence}) without a recognised cause; read the log lines "
        "below. Re-run once: a crash that repeats is a bug or an unsupported configuration."
    )


# --- memory account and metrics ---------------------------------------------------------------

_MEM_PATTERNS: dict[str, re.Pattern[str]] = {
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "kv_cache_gib": re.compile(
        r"Available KV cache memory: ([\d.]+) GiB"
        r"|(?:Explicitly|Auto) set \(([\d.]+)/[\d.]+\) GiB for KV cache"
        r"|reserved ([\d.]+) GiB memory for KV Cache as specified by kv_cache_memory_bytes"
    ),
    "kv_cache_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"),
    "cuda_graph_gib": re.compile(r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB"),
    "max_model_len": re.compile(r"Maximum concurrency for ([\d,]+) tokens per request"),
}


# How the engine sized its KV cache: in bytes (kv-cache-memory-bytes, or VLLM_CPU_KVCACHE_SPACE on
# the CPU build) or from a share of memory (gpu-memory-utilization), and that share.
_KV_SIZED = re.compile(
    r"(?P<bytes>Explicitly set \([\d.]+/[\d.]+\) GiB for KV cache"
    r"|memory for KV Cache as specified by kv_cache_memory_bytes)"
    r"|(?P<cpu_share>Auto set \([\d.]+/(?P<total>[\d.]+)\) GiB for KV cache on node \d+, with "
    r"(?P<requested>[\d.]+) GiB requested memory)"
    r"|(?P<share>Desired GPU memory utilization is \((?P<util>[\d.]+),"
    r"|gpu_memory_utilization \((?P<util_old>[\d.]+)\))"
)


def parse_memory_account(log_text: str) -> MemoryAccount:
    """The memory account a server printed at startup (the last value of each, None if absent)."""
    values: dict[str, Any] = {}
    for key, pattern in _MEM_PATTERNS.items():
        matches = list(pattern.finditer(log_text))
        if not matches:
            continue
        raw = next(g for g in matches[-1].groups() if g is not None).replace(",", "")
        values[key] = int(raw) if key in ("kv_cache_tokens", "max_model_len") else float(raw)
    sized = list(_KV_SIZED.finditer(log_text))
    if sized:
        last = sized[-1]
        if last["bytes"]:
            values["kv_cache_explicit"] = True
        elif last["cpu_share"]:
            values["kv_cache_explicit"] = False
            total = float(last["total"])
            if total > 0:
                # vLLM asked for ceil(total x share) and prints both rounded to 0.01 GiB.
                values["memory_utilization"] = round(float(last["requested"]) / total, 3)
        else:
            values["kv_cache_explicit"] = False
            values["memory_utilization"] = float(last["util"] or last["util_old"])
    return MemoryAccount(**values)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_DROP_LABELS = re.compile(r'(?:model_name|engine)="[^"]*",?')


_ENGINE_CONFIG = re.compile(r"Initializing a V1 LLM engine \(v[^)]*\) with config: (.*)$", re.M)


def parse_engine_config(log_text: str) -> dict[str, str]:
    """The top-level ``key=value`` pairs of the engine's "Initializing ... with config:" line.

    This is what the engine actually runs with once vLLM has filled in its own defaults
    (``enable_prefix_caching=True``, ``max_seq_len=2048``, ``dtype=torch.bfloat16`` ...), so a
    study can tell a flag a trial set to vLLM's default from a real change. Nested values
    (``compilation_config={...}``, ``SomeConfig(...)``) are skipped; values are the logged text.
    """
    found = _ENGINE_CONFIG.findall(log_text)
    if not found:
        return {}
    line = found[-1]  # the last start in this log
    out: dict[str, str] = {}
    depth = 0
    quote = ""
    start = 0
    parts: list[str] = []
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"" and (i == 0 or line[i - 1] in "=([{,: "):
            quote = ch  # opens only where a value or key starts: not in "bob's"
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(line[start:i])
            start = i + 1
    parts.append(line[start:])
    for part in parts:
        key, sep, value = part.strip().partition("=")
        if not sep or not re.fullmatch(r"[a-z_][a-z0-9_]*", key):
            continue
        value = value.strip()
        if value[:1] in "([{" or re.match(r"[A-Za-z]\w*\(", value):
            continue  # nested config objects
        out[key] = value.strip("'\"")
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name with labels: value}.

    The ``model_name`` and ``engine`` labels are dropped (one engine per server here), so keys
    read like ``vllm:num_preemptions_total`` or
    ``vllm:request_success_total{finished_reason="length"}``.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = _DROP_LABELS.sub("", m.group(2) or "").rstrip(",}").lstrip("{")
        key = m.group(1) + (f"{{{labels}}}" if labels else "")
        try:
            out[key] = float(m.group(3))
        except ValueError:
            continue
    return out


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def info_labels(metrics_text: str, name: str) -> dict[str, str]:
    """Labels of an info-style gauge such as ``vllm:cache_config_info`` ({} if absent)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            return dict(_LABEL.findall(line[len(name) : line.rfind("}") + 1]))
    return {}
