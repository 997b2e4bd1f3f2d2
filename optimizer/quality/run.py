"""The gate on real servers: the baseline's reference, then each candidate, one server at a time.

One server runs at a time (the machine may hold only one): the baseline's server answers and
scores the prompts (:func:`reference_for`, kept in ``reference.json`` so every candidate of a
study shares it), then each numeric-changing candidate's server is scored
(:func:`check_configuration`). A server that does not start is a check that did not happen
(``skipped``, with the reason), never a pass.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from optimizer.engine.process import EngineProcess
from optimizer.errors import EngineError
from optimizer.quality.check import (
    QualitySettings,
    Reference,
    Verdict,
    build_reference,
    judge,
    measure,
)
from optimizer.quality.levers import numeric_changes
from optimizer.types import EngineConfig, Trace
from optimizer.workload.prompts import TokenRange, build_prompt_ids

__all__ = [
    "check_configuration",
    "dummy_weights",
    "keep_reference",
    "prompts_for",
    "reference_for",
    "served_name",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_DUMMY = (
    "dummy weights (load-format dummy): their logits are flat, every token about -ln(vocab), "
    "so the check sees nothing on them; skipped, not a pass (make the model with "
    "model.weights_seed, or serve real weights)"
)


def dummy_weights(model: str, args: Mapping[str, Any]) -> bool:
    """True where the server would run vLLM's dummy weights."""
    if args.get("load-format") == "dummy":
        return True
    folder = Path(model)
    return folder.is_dir() and not any(
        p.suffix in _WEIGHT_SUFFIXES for p in folder.iterdir() if p.is_file()
    )


def served_name(model: str, args: Mapping[str, Any]) -> str:
    """The name requests address the model by (``served-model-name`` where set)."""
    name = args.get("served-model-name")
    if isinstance(name, list | tuple) and name:
        return str(name[0])
    return str(name) if name else model


def prompts_for(
    trace: Trace, token_range: tuple[int, int], settings: QualitySettings, seed: int = 0
) -> list[list[int]]:
    """The check's prompts: the trace's first requests' prompts, cut to ``prompt_tokens``
    (at least 16 tokens each), built as the replay builds them."""
    vocab = TokenRange(*token_range)
    out = []
    for index, request in enumerate(trace.requests[: settings.prompts]):
        ids = build_prompt_ids(request, index, block_size=trace.block_size, seed=seed, vocab=vocab)
        if len(ids) < 16:
            ids = ids + build_prompt_ids(
                request, index + 10_000, block_size=trace.block_size, seed=seed + 1, vocab=vocab
            )
        out.append(ids[: settings.prompt_tokens])
    return out


def _key(
    model: str, args: Mapping[str, Any], prompts: Sequence[Sequence[int]], settings: QualitySettings
) -> str:
    """What a reference was made from: weights, arguments, prompts, lengths and eval set."""
    evals = Path(settings.eval_set).read_bytes() if settings.eval_set else b""
    doc = json.dumps(
        [
            2,  # the reference's format (its positions' top choices kept)
            model,
            dict(args),
            [list(p) for p in prompts],
            settings.continuation_tokens,
            settings.eval_max_tokens,
            hashlib.sha256(evals).hexdigest(),
        ],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def keep_reference(
    workdir: Path,
    model: str,
    baseline_args: Mapping[str, Any],
    prompts: Sequence[Sequence[int]],
    settings: QualitySettings,
    reference: Reference,
) -> Path:
    """Keep ``reference`` in ``workdir/reference.json`` for the candidates that follow."""
    workdir.mkdir(parents=True, exist_ok=True)
    kept = workdir / "reference.json"
    key = _key(model, baseline_args, prompts, settings)
    kept.write_text(json.dumps({"key": key, "reference": reference.to_doc()}) + "\n")
    return kept


def _server(
    model: str,
    args: Mapping[str, Any],
    env: Mapping[str, str],
    log: Path,
    python: str | None,
    startup_timeout_s: float,
) -> EngineProcess:
    return EngineProcess(
        EngineConfig(model=model, args=dict(args), env=dict(env)),
        log_path=log,
        python=python,
        startup_timeout_s=startup_timeout_s,
    )


def reference_for(
    model: str,
    baseline_args: Mapping[str, Any],
    env: Mapping[str, str],
    workdir: Path,
    settings: QualitySettings,
    prompts: Sequence[Sequence[int]],
    *,
    python: str | None = None,
    startup_timeout_s: float = 900.0,
    vocab_size: int | None = None,
) -> Reference:
    """The baseline's reference, from ``workdir/reference.json`` when it was made for these
    weights, arguments and prompts; else measured on a server of its own and kept there.

    Raises:
        EngineError: The baseline's server did not start or died.
    """
    kept = workdir / "reference.json"
    if kept.is_file():
        doc = json.loads(kept.read_text())
        if doc.get("key") == _key(model, baseline_args, prompts, settings):
            return Reference.from_doc(doc["reference"])
    t0 = time.monotonic()
    server = _server(
        model, baseline_args, env, workdir / "baseline-engine.log", python, startup_timeout_s
    )
    try:
        server.start()
        ref = build_reference(
            server.url, served_name(model, baseline_args), prompts, settings, vocab_size=vocab_size
        )
    finally:
        server.stop()
    ref.seconds = time.monotonic() - t0
    ref.baseline_args = dict(baseline_args)
    keep_reference(workdir, model, baseline_args, prompts, settings, ref)
    return ref


def check_configuration(
    model: str,
    args: Mapping[str, Any],
    baseline_args: Mapping[str, Any],
    env: Mapping[str, str],
    workdir: Path,
    settings: QualitySettings,
    prompts: Sequence[Sequence[int]],
    *,
    python: str | None = None,
    startup_timeout_s: float = 900.0,
    vocab_size: int | None = None,
    label: str = "candidate",
    candidate_env: Mapping[str, str] | None = None,
) -> Verdict:
    """The gate for one configuration; never raises for a server that fails.

    ``env`` is the baseline's server environment, ``candidate_env`` the candidate's (default:
    the same), as their trials ran.
    """
    levers = numeric_changes(args, baseline_args)
    if not levers:
        return Verdict(
            "unchanged", "unchanged by construction: no numeric lever differs from the baseline"
        )
    if dummy_weights(model, args) or dummy_weights(model, baseline_args):
        return Verdict("skipped", _DUMMY, levers)
    t0 = time.monotonic()
    try:
        reference = reference_for(
            model,
            baseline_args,
            env,
            workdir,
            settings,
            prompts,
            python=python,
            startup_timeout_s=startup_timeout_s,
            vocab_size=vocab_size,
        )
    except EngineError as exc:
        return Verdict("skipped", f"the baseline's server failed: {exc}", levers)
    if reference.flat:
        return Verdict("skipped", _DUMMY.replace("(load-format dummy)", "(flat logits)"), levers)
    server = _server(
        model,
        args,
        env if candidate_env is None else candidate_env,
        workdir / f"{label}-engine.log",
        python,
        startup_timeout_s,
    )
    try:
        server.start()
        comparison = measure(server.url, served_name(model, args), reference, settings)
    except EngineError as exc:
        return Verdict("skipped", f"the candidate's server failed: {exc}", levers)
    finally:
        server.stop()
    verdict = judge(comparison, reference, levers, settings)
    return Verdict(
        verdict.status,
        verdict.reason,
        verdict.levers,
        verdict.comparison,
        verdict.floor,
        seconds=time.monotonic() - t0,
    )
