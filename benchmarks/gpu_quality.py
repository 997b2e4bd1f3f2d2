"""The quality gate on a GPU: FP8 weights and the FP8 KV cache against bfloat16, on seeded weights.

A Llama-3.1-8B-shaped folder (``make-model``'s preset) gets seeded weights at the standard
initialization scale, drawn on the GPU with torch in bfloat16 (the CPU build's ``weights_seed``
draws them with numpy; the two generators give different weights for one seed) and saved as
safetensors; then the gate's reference on vLLM's defaults (bfloat16), and each candidate on a
server of its own, one at a time. Every server runs eager (``enforce-eager``), the baseline too,
so that a start takes about a minute; the numerics of a decode step do not depend on it.

Resumable on one machine: the weights and the reference are kept under ``--out`` and reused, and
``--candidates`` names the ones to run in this call (a command there runs at most 10 minutes)::

    python -m benchmarks.gpu_quality --out /tmp/gq --candidates fp8-kv
    python -m benchmarks.gpu_quality --out /tmp/gq --candidates fp8-weights,fp8-both

Prints a table and writes ``--out``/gpu_quality.json (one row per candidate run, merged).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

NAME = "gate"
CANDIDATES: dict[str, dict[str, Any]] = {
    "fp8-kv": {"kv-cache-dtype": "fp8"},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-both": {"quantization": "fp8", "kv-cache-dtype": "fp8"},
    "batch-limits": {"max-num-seqs": 32},
}


def _seeded_gpu(folder: Path, seed: int, std: float = 0.02) -> float:
    """Seeded bfloat16 weights drawn on the GPU; seconds taken (0 when already there)."""
    from optimizer.engine.models import WEIGHTS_FILE, _llama_shapes, weights_seed_of

    if weights_seed_of(folder) == seed:
        return 0.0
    import torch
    from safetensors.torch import save_file

    t0 = time.monotonic()
    config = json.loads((folder / "config.json").read_text())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for name, shape in _llama_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * std
            tensors[name] = t.to(torch.bfloat16).cpu()
    meta = {"format": "pt", "seed": str(seed), "std": str(std), "generator": "torch-cuda"}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata=meta)
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    from optimizer.engine.models import make_model
    from optimizer.quality.check import QualitySettings
    from optimizer.quality.run import check_configuration, reference_for

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--candidates", default="fp8-kv", help=", ".join(CANDIDATES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=64)
    ns = ap.parse_args(argv)
    settings = QualitySettings(
        prompts=ns.prompts, prompt_tokens=ns.prompt_tokens, continuation_tokens=ns.continuation
    )
    prompts = [
        [(7 * i + 13 * j) % 30000 + 1000 for j in range(ns.prompt_tokens)]
        for i in range(ns.prompts)
    ]
    model = ns.out / f"{ns.preset}-seed{ns.seed}"
    if not (model / "config.json").exists():
        make_model(model, ns.preset, max_model_len=4096)
    # In a process of its own: this one never holds GPU memory the servers need.
    import subprocess

    code = (
        "import pathlib, sys; from benchmarks.gpu_quality import _seeded_gpu as f; "
        "print(f(pathlib.Path(sys.argv[1]), int(sys.argv[2])))"
    )
    made = subprocess.run(
        [sys.executable, "-c", code, str(model), str(ns.seed)],
        capture_output=True,
        text=True,
        check=True,
    )
    made_s = float(made.stdout.strip().splitlines()[-1])
    base = {"max-model-len": 4096, "enforce-eager": True, "served-model-name": NAME}
    work = ns.out / "gate"
    t0 = time.monotonic()
    ref = reference_for(str(model), base, {}, work, settings, prompts, startup_timeout_s=600)
    ref_s = time.monotonic() - t0
    print(
        f"weights drawn in {made_s:.0f} s; reference {ref.floor.tokens} tokens, floor drift "
        f"{ref.floor.mean_abs_logprob_diff:.4f}, floor top-1 {ref.floor.top1_agreement:.3f}, "
        f"{ref_s:.0f} s",
        flush=True,
    )
    kept = ns.out / "gpu_quality.json"
    doc = json.loads(kept.read_text()) if kept.exists() else {"rows": {}}
    doc.update(
        preset=ns.preset,
        seed=ns.seed,
        floor=ref.floor.__dict__,
        reference_tokens=ref.floor.tokens,
        weights_s=doc.get("weights_s") or made_s,
    )
    for name in [c for c in ns.candidates.split(",") if c]:
        t0 = time.monotonic()
        v = check_configuration(
            str(model),
            {**base, **CANDIDATES[name]},
            base,
            {},
            work,
            settings,
            prompts,
            startup_timeout_s=600,
            label=name,
        )
        doc["rows"][name] = {"seconds": time.monotonic() - t0, **v.to_doc()}
        kept.write_text(json.dumps(doc, indent=1))
        print(f"{name}: {v.line()} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
