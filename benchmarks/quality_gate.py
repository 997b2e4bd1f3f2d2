"""The quality gate's figures on the CPU build: what the FP8 KV cache moves, the floor, the cost.

On the ``small`` shape with seeded weights (``model.weights_seed``: standard initialization
scale, vLLM's normal loader), the baseline's reference is measured once, then each candidate on
a server of its own, one at a time, as ``vllm-autotune quality`` runs them:

- ``fp8 kv``: ``kv-cache-dtype fp8`` (the lever under test);
- ``batch limits``: ``max-num-seqs`` 4 instead of 16 (nothing numeric: must sit at the floor);
- ``other weights``: the same shape with another seed (must fail the gate);
- ``dummy``: the same candidate on weight-less folder (flat logits: skipped, never a pass).

Prints one row per candidate (top-1 agreement, drift, the floor, greedy match, verdict, seconds)
and the reference's own cost::

    python -m benchmarks.quality_gate --out /tmp/quality-bench
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from optimizer.engine.models import make_model
from optimizer.engine.process import EngineProcess, cpu_engine_env
from optimizer.quality.check import QualitySettings, judge, measure
from optimizer.quality.run import check_configuration, reference_for
from optimizer.types import EngineConfig

__all__ = ["main"]

NAME = "gate"
BASE: dict[str, Any] = {
    "max-model-len": 1024,
    "max-num-seqs": 16,
    "max-num-batched-tokens": 1024,
    "served-model-name": NAME,
}


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 3000 + 300 for j in range(length)] for i in range(n)]


def _measured(model: Path, args: dict[str, Any], ref: Any, log: Path, settings: Any) -> Any:
    server = EngineProcess(
        EngineConfig(model=str(model), args=args, env=cpu_engine_env(1)),
        log_path=log,
        startup_timeout_s=600,
    )
    t0 = time.monotonic()
    server.start()
    try:
        return measure(server.url, NAME, ref, settings), time.monotonic() - t0
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="a scratch folder")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=64)
    ns = ap.parse_args(argv)
    settings = QualitySettings(
        prompts=ns.prompts, prompt_tokens=ns.prompt_tokens, continuation_tokens=ns.continuation
    )
    prompts = _prompts(ns.prompts, ns.prompt_tokens)
    seeded = {s: make_model(ns.out / f"seed{s}", "small", weights_seed=s) for s in (1, 2)}
    dummy = make_model(ns.out / "dummy", "small")
    env = cpu_engine_env(1)
    work = ns.out / "gate"
    t0 = time.monotonic()
    ref = reference_for(str(seeded[1]), BASE, env, work, settings, prompts, vocab_size=4096)
    ref_s = time.monotonic() - t0
    rows: list[dict[str, Any]] = []

    t0 = time.monotonic()
    fp8 = check_configuration(
        str(seeded[1]), {**BASE, "kv-cache-dtype": "fp8"}, BASE, env, work, settings, prompts
    )
    rows.append({"candidate": "fp8 kv", "verdict": fp8, "seconds": time.monotonic() - t0})
    limits, secs = _measured(seeded[1], {**BASE, "max-num-seqs": 4}, ref, work / "l.log", settings)
    rows.append(
        {"candidate": "batch limits", "verdict": judge(limits, ref, {}, settings), "seconds": secs}
    )
    other, secs = _measured(seeded[2], BASE, ref, work / "o.log", settings)
    rows.append(
        {"candidate": "other weights", "verdict": judge(other, ref, {}, settings), "seconds": secs}
    )
    t0 = time.monotonic()
    flat = check_configuration(
        str(dummy), {**BASE, "kv-cache-dtype": "fp8"}, BASE, env, ns.out / "d", settings, prompts
    )
    rows.append({"candidate": "dummy", "verdict": flat, "seconds": time.monotonic() - t0})

    tokens = ref.floor.tokens
    print(
        f"reference: {ns.prompts} prompts x {ns.continuation} tokens ({tokens} scored), "
        f"floor drift {ref.floor.mean_abs_logprob_diff:.4f}, floor top-1 "
        f"{ref.floor.top1_agreement:.3f}, {ref_s:.0f} s (start, greedy, two passes)"
    )
    print(f"{'candidate':<14}{'top-1':>7}{'drift':>9}{'max':>8}{'greedy':>8}  verdict   seconds")
    out = []
    for row in rows:
        v = row["verdict"]
        c = v.comparison
        cells = (
            f"{c.top1_agreement:>7.3f}{c.mean_abs_logprob_diff:>9.4f}"
            f"{c.max_abs_logprob_diff:>8.3f}"
            f"{(c.greedy_match if c.greedy_match is not None else float('nan')):>8.3f}"
            if c
            else f"{'-':>7}{'-':>9}{'-':>8}{'-':>8}"
        )
        print(f"{row['candidate']:<14}{cells}  {v.status:<9}{row['seconds']:>6.0f}")
        out.append({"candidate": row["candidate"], "seconds": row["seconds"], **v.to_doc()})
    (ns.out / "quality_gate.json").write_text(
        json.dumps({"reference_s": ref_s, "floor": ref.floor.__dict__, "rows": out}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
