"""Which engine arguments change what the model says (and so need the quality gate).

Batch limits, chunked prefill, prefix caching, block size, memory share, parallelism and CUDA
graphs change when and how tokens are computed, not their values by design: a configuration
that differs from the baseline only in those is ``unchanged by construction``. The levers below
change the numbers themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NUMERIC_LEVERS", "numeric_changes"]

#: Engine argument -> what it changes. A lever counts where its value differs from the
#: baseline's (a missing argument is vLLM's default).
NUMERIC_LEVERS: dict[str, str] = {
    "quantization": "the weights in another number format",
    "kv-cache-dtype": "the KV cache stored in another number format",
    "calculate-kv-scales": "the FP8 KV cache's scales computed from the data",
    "dtype": "weights and activations in another precision",
    "speculative-config": "draft tokens verified by the rejection sampler",
    "speculative-model": "draft tokens verified by the rejection sampler",
    "num-speculative-tokens": "draft tokens verified by the rejection sampler",
    "load-format": "weights loaded another way",
    "override-generation-config": "the model's sampling defaults replaced",
    "generation-config": "the model's sampling defaults replaced",
    "logits-processors": "the logits changed before sampling",
}

#: Values that are the default under another name (``kv-cache-dtype: auto`` is the model's).
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "kv-cache-dtype": (None, "auto"),
    "dtype": (None, "auto"),
    "calculate-kv-scales": (None, False),
    "quantization": (None,),
    "load-format": (None, "auto"),
}


def _norm(key: str, value: Any) -> Any:
    return None if value in _DEFAULTS.get(key, (None,)) else value


def numeric_changes(args: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, str]:
    """The levers where ``args`` differs from ``baseline``: ``{flag: "old -> new: what"}``
    (empty: unchanged by construction)."""
    out: dict[str, str] = {}
    for key, what in NUMERIC_LEVERS.items():
        old, new = _norm(key, baseline.get(key)), _norm(key, args.get(key))
        if old != new:
            out[key] = f"{old if old is not None else 'default'} -> {new}: {what}"
    return out
