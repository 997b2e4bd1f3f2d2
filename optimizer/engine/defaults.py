"""One rule for the defaults a local server needs, shared by the CLI and study preparation.

- A local model folder without weight files (``*.safetensors``, ``*.bin``, ``*.pt``) is served
  with ``load-format: dummy`` (random weights); a folder with weights, or a hub name, is not.
- The CPU build sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB), which overrides
  ``kv-cache-memory-bytes``: it is set unless the arguments size the cache in bytes or the
  environment already has it. A trial whose own arguments size it in bytes runs without the
  job-level default (:func:`trial_env`); a job whose environment sets it while its search space
  tunes ``kv-cache-memory-bytes`` is refused (:func:`kv_env_conflict`), and after a start the
  engine's reported KV cache must match what ``kv-cache-memory-bytes`` asked for
  (:func:`memory_param_problem`), or the trial is not scored.
- ``gpu-memory-utilization`` sizes the KV cache only when nothing sizes it in bytes (the bytes
  win on every build). On the CPU build the flag is the share of the machine's memory, and every
  server here has its cache sized in bytes (``VLLM_CPU_KVCACHE_SPACE``, or the trial's
  ``kv-cache-memory-bytes``), so that a server never takes 80-95 % of the memory it shares with
  the client and the tuner: a CPU job that tunes the share is refused, as is any job that tunes
  it while the bytes are fixed or tuned too (:func:`kv_env_conflict`). After a start, a trial that
  set the share (and no bytes of its own) must find the engine reporting that share, or it is
  not scored.
- Prompt token ids come from the model folder's vocabulary, else a range every tokenizer has.
- A study's servers share compile caches kept in the study folder (vLLM's torch.compile cache,
  Inductor's and Triton's): a later trial, a resumed study, a re-validation or the same study
  moved to another machine starts from what earlier starts compiled. The job's environment
  wins where it names these variables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.engine.flags import normalize_flag
from optimizer.types import MemoryAccount

__all__ = [
    "EngineDefaults",
    "apply_engine_defaults",
    "compile_cache_env",
    "has_weights",
    "kv_env_conflict",
    "memory_param_problem",
    "prompt_token_range",
    "trial_env",
]

KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")
_HUB_TOKEN_RANGE = (1000, 30000)


def has_weights(model: str) -> bool:
    """False only for a local folder without weight files; a hub name has real weights."""
    path = Path(model)
    if not path.is_dir():
        return True
    return any(any(path.glob(pattern)) for pattern in _WEIGHT_GLOBS)


@dataclass(frozen=True)
class EngineDefaults:
    """Engine arguments and environment with the defaults applied, and what was applied.

    Attributes:
        args: Engine arguments (flag names).
        env: Server environment.
        notes: One line per default applied.
    """

    args: dict[str, Any]
    env: dict[str, str]
    notes: tuple[str, ...]


def apply_engine_defaults(
    model: str,
    args: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    *,
    cpu_build: bool,
    kv_cache_gib: int | None = None,
) -> EngineDefaults:
    """``args`` and ``env`` with the defaults of the module docstring.

    Args:
        model: Model folder or hub name.
        args: Engine arguments as given.
        env: Server environment as given.
        cpu_build: The vLLM that serves is the CPU build.
        kv_cache_gib: CPU build: KV cache GiB (default 2).
    """
    out_args = dict(args)
    out_env = dict(env or {})
    notes = []
    flags = {normalize_flag(k) for k in out_args}
    if "load-format" not in flags and not has_weights(model):
        out_args["load-format"] = "dummy"
        notes.append(
            "no weight files in the model folder: using load-format=dummy (random weights)"
        )
    if cpu_build and "kv-cache-memory-bytes" in flags:
        notes.append("CPU build: KV cache from kv-cache-memory-bytes")
    elif cpu_build and KV_CACHE_ENV not in out_env:
        gib = max(1, int(kv_cache_gib or 2))
        out_env[KV_CACHE_ENV] = str(gib)
        notes.append(f"CPU build: {KV_CACHE_ENV}={gib} GiB")
    return EngineDefaults(args=out_args, env=out_env, notes=tuple(notes))


_KV_BYTES = "kv-cache-memory-bytes"
_UTIL = "gpu-memory-utilization"
_GIB = 1024**3


def _arg(args: Mapping[str, Any], flag: str) -> Any:
    """The value of ``flag`` in ``args`` (any spelling), or None."""
    for key, value in args.items():
        if normalize_flag(str(key)) == flag:
            return value
    return None


def _sizes_kv_in_bytes(args: Mapping[str, Any]) -> Any:
    """The trial's ``kv-cache-memory-bytes`` value (any spelling), or None."""
    return _arg(args, _KV_BYTES)


def trial_env(
    args: Mapping[str, Any], env: Mapping[str, str], *, cpu_build: bool, job_env: Mapping[str, str]
) -> dict[str, str]:
    """A trial's server environment: ``env`` (the job's, with the defaults applied) without the
    CPU build's default ``VLLM_CPU_KVCACHE_SPACE`` when the trial sizes its KV cache in bytes
    (the variable would override it: every trial of a grid over kv-cache-memory-bytes got the
    same 1 GiB cache). A value the job itself set stays (such jobs are refused at preparation
    when the space tunes the bytes: :func:`kv_env_conflict`)."""
    out = dict(env)
    if cpu_build and _sizes_kv_in_bytes(args) is not None and KV_CACHE_ENV not in job_env:
        out.pop(KV_CACHE_ENV, None)
    return out


def kv_env_conflict(
    tuned_flags: Sequence[str],
    job_env: Mapping[str, str],
    *,
    cpu_build: bool,
    fixed_args: Mapping[str, Any] | None = None,
) -> str | None:
    """Why a job cannot tune kv-cache-memory-bytes or gpu-memory-utilization as written (None:
    it can). ``fixed_args``: the engine arguments every trial gets (the job's and the space's
    fixed ones)."""
    flags = {normalize_flag(f).partition(".")[0] for f in tuned_flags}
    if cpu_build and _KV_BYTES in flags and KV_CACHE_ENV in job_env:
        return (
            f"the search space tunes {_KV_BYTES}, but engine.env sets {KV_CACHE_ENV}, which "
            f"overrides it on the CPU build (every trial would get the same KV cache): remove "
            f"{KV_CACHE_ENV} from engine.env"
        )
    if _UTIL not in flags:
        return None
    if cpu_build:
        return (
            f"the search space tunes {_UTIL}, which never acts on the CPU build here: every "
            f"server's KV cache is sized in bytes ({KV_CACHE_ENV} from engine.kv_cache_gib, or "
            f"{_KV_BYTES}), so that no server takes most of the memory it shares with the "
            f"client (on this build the flag is the share of the machine's memory): tune "
            f"{_KV_BYTES} instead, or use a CPU preset such as cpu-small"
        )
    if _KV_BYTES in flags or (fixed_args and _sizes_kv_in_bytes(fixed_args) is not None):
        return (
            f"the search space tunes {_UTIL}, but {_KV_BYTES} is "
            f"{'tuned' if _KV_BYTES in flags else 'fixed'} too and sizes the KV cache instead "
            f"(vLLM ignores the share then): tune one of them, or remove {_KV_BYTES} from the "
            "fixed arguments"
        )
    return None


def memory_param_problem(args: Mapping[str, Any], account: MemoryAccount | None) -> str | None:
    """Whether the memory parameters a trial set acted on the engine it started.

    ``kv-cache-memory-bytes``: the KV cache the engine reports must be the size asked for
    (within 10 % and vLLM's two-decimal rounding of GiB). ``gpu-memory-utilization`` (checked
    only where the trial sets no bytes of its own, which win by vLLM's design): the cache must
    not have been sized in bytes (on the CPU build by ``VLLM_CPU_KVCACHE_SPACE``), and where the
    engine reports the share it applied, that share must be the one asked for (within 0.006:
    older vLLM prints two decimals). Returns a sentence when a parameter did not act,
    None when each acted, when the trial sets neither, or when the engine reported nothing to
    check.
    """
    if account is None:
        return None
    wanted = _sizes_kv_in_bytes(args)
    if wanted is not None and account.kv_cache_gib is not None:
        try:
            wanted_gib = float(wanted) / _GIB
        except (TypeError, ValueError):
            wanted_gib = None
        if wanted_gib is not None and abs(account.kv_cache_gib - wanted_gib) > max(
            0.1 * wanted_gib, 0.01
        ):
            return (
                f"{_KV_BYTES} asked for {wanted_gib:.3g} GiB of KV cache, but the engine reports "
                f"{account.kv_cache_gib:.3g} GiB: the parameter did not act (on the CPU build "
                f"{KV_CACHE_ENV} overrides it), so this trial measures another configuration "
                "than its label and is not scored"
            )
    share = _arg(args, _UTIL)
    if share is None or wanted is not None:
        # Bytes of the trial's own win over the share by vLLM's design; preparation refuses a
        # space that tunes the share beside them (kv_env_conflict).
        return None
    try:
        share_f = float(share)
    except (TypeError, ValueError):
        return None
    if account.kv_cache_explicit:
        return (
            f"{_UTIL} {share_f:g} did not act: the engine sized its KV cache in bytes "
            f"({KV_CACHE_ENV} on the CPU build, or {_KV_BYTES} in the job), so this trial "
            "measures another configuration than its label and is not scored"
        )
    applied = account.memory_utilization
    # Older vLLM prints the share with two decimals: 0.925 reads 0.93.
    if applied is not None and abs(applied - share_f) > 0.006:
        return (
            f"{_UTIL} asked for {share_f:g}, but the engine reports that it applied "
            f"{applied:g}: the parameter did not act, so this trial measures another "
            "configuration than its label and is not scored"
        )
    return None


def prompt_token_range(model: str | None, explicit: Sequence[int] | None = None) -> tuple[int, int]:
    """Token ids prompts draw from: ``explicit``, else the model folder's, else a safe range.

    ``model`` None: a server started elsewhere (its vocabulary is unknown here).
    """
    if explicit:
        return int(explicit[0]), int(explicit[1])
    if model and Path(model).is_dir():
        from optimizer.engine.models import model_info

        info = model_info(model)
        return info.prompt_low, info.prompt_high
    return _HUB_TOKEN_RANGE


def compile_cache_env(folder: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` with the compile caches of a study's servers in ``folder`` (unless ``env``
    already names them)."""
    caches = {
        "VLLM_CACHE_ROOT": str(folder / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
    }
    return {**caches, **(env or {})}
