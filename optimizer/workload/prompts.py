"""Deterministic token-id prompts for replayed requests, with production-like prefix reuse.

The replayer sends prompts as lists of token ids, so the client needs no tokenizer and every
prompt has exactly the trace's input length. Each id comes from a counter-based hash
(SplitMix64 finalizer, vectorised with numpy) of ``(seed, stream, position)``: the tokens of a
prefix block depend only on the block id and the seed, so two requests that share a block in
the trace share those tokens and vLLM's prefix cache sees the same reuse as in production;
every other token depends on the request's index, so no prompt is ever sent twice unless the
trace says it is shared (a repeated prompt would be served from the prefix cache and hide
prefill from the measurement).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from optimizer.errors import ConfigError
from optimizer.types import TraceRequest

__all__ = ["BYTE_TOKENS", "ModelInfo", "TokenRange", "build_prompt_ids", "model_info"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
# Domain tags keep block streams and per-request streams apart even when a block id equals a
# request index.
_DOMAIN_BLOCK = 0x426C6F636B000000
_DOMAIN_FRESH = 0x4672657368000000

_U64 = np.uint64
_GOLDEN_U64 = _U64(_GOLDEN)
_MUL1_U64 = _U64(_MUL1)
_MUL2_U64 = _U64(_MUL2)
_S27 = _U64(27)
_S30 = _U64(30)
_S31 = _U64(31)


@dataclass(frozen=True, slots=True)
class TokenRange:
    """The half-open range ``[low, high)`` of token ids a prompt may use.

    Callers choose it from the served model's tokenizer: skip ids that decode to nothing or to
    special tokens (the project's generated tokenizers map ids below 256 to single bytes and
    reserve a few special ids at the top of the vocabulary).

    Attributes:
        low: Smallest allowed id (inclusive, >= 0).
        high: One past the largest allowed id (exclusive, > low).
    """

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 0 or self.high <= self.low:
            raise ValueError(f"TokenRange needs 0 <= low < high, got [{self.low}, {self.high})")

    @property
    def size(self) -> int:
        """Number of allowed ids."""
        return self.high - self.low


def _mix_scalar(x: int) -> int:
    """SplitMix64 finalizer on a Python int (used for per-stream keys)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def _stream_key(seed: int, domain: int, stream_id: int) -> int:
    return _mix_scalar(_mix_scalar(seed ^ domain) ^ _mix_scalar(stream_id + _GOLDEN))


def _mix_array(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64 finalizer on a uint64 array, in place (wrap-around multiplication intended)."""
    x ^= x >> _S30
    x *= _MUL1_U64
    x ^= x >> _S27
    x *= _MUL2_U64
    x ^= x >> _S31
    return x


def build_prompt_ids(
    request: TraceRequest,
    index: int,
    *,
    block_size: int,
    seed: int,
    vocab: TokenRange,
    warm_blocks: frozenset[int] = frozenset(),
    warm_seed: int | None = None,
) -> list[int]:
    """Build the token ids of one request's prompt.

    The first ``min(len(request.prefix_blocks) * block_size, request.input_tokens)`` tokens come
    from the prefix blocks: token ``j`` of block ``b`` is a function of ``(seed, b, j)`` only.
    The remaining tokens are a function of ``(seed, index, position)``, fresh per request.

    Args:
        request: The trace request (its ``input_tokens`` and ``prefix_blocks`` are used).
        index: Position of the request in its trace; makes the non-shared tokens unique.
        block_size: Tokens per prefix block (``Trace.block_size``).
        seed: Seed of the whole replay; a different seed gives entirely different prompts.
        vocab: Range of token ids to draw from.
        warm_blocks: Prefix blocks whose tokens come from ``warm_seed`` instead of ``seed``
            (the blocks a pre-roll warms, kept warm across replays with different seeds).
            Only the prompt's leading run of them does: a prefix cache matches a block only
            after all the blocks before it, so a warm block after a fresh one could never hit.
        warm_seed: The seed of ``warm_blocks`` (None: every block uses ``seed``).

    Returns:
        Exactly ``request.input_tokens`` token ids, each in ``[vocab.low, vocab.high)``.

    Raises:
        ValueError: If ``block_size`` is not positive or ``input_tokens`` is negative.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_tokens = request.input_tokens
    if n_tokens < 0:
        raise ValueError(f"input_tokens must be >= 0, got {n_tokens}")
    n_prefix = min(len(request.prefix_blocks) * block_size, n_tokens)
    n_blocks = -(-n_prefix // block_size)

    keys = np.empty(n_tokens, dtype=np.uint64)
    positions = np.empty(n_tokens, dtype=np.uint64)
    if n_prefix:
        blocks = request.prefix_blocks[:n_blocks]
        warm = 0
        while warm_seed is not None and warm < len(blocks) and blocks[warm] in warm_blocks:
            warm += 1
        block_seed = warm_seed if warm_seed is not None else seed
        block_keys = np.array(
            [_stream_key(block_seed, _DOMAIN_BLOCK, b) for b in blocks[:warm]]
            + [_stream_key(seed, _DOMAIN_BLOCK, b) for b in blocks[warm:]],
            dtype=np.uint64,
        )
        keys[:n_prefix] = np.repeat(block_keys, block_size)[:n_prefix]
        positions[:n_prefix] = np.tile(np.arange(block_size, dtype=np.uint64), n_blocks)[:n_prefix]
    if n_prefix < n_tokens:
        keys[n_prefix:] = _U64(_stream_key(seed, _DOMAIN_FRESH, index))
        positions[n_prefix:] = np.arange(n_prefix, n_tokens, dtype=np.uint64)

    # Counter-based: hash(key + position * golden); uint64 arithmetic wraps by design.
    positions *= _GOLDEN_U64
    keys += positions
    hashed = _mix_array(keys)
    ids = (hashed % _U64(vocab.size)).astype(np.int64) + vocab.low
    result: list[int] = ids.tolist()
    return result


BYTE_TOKENS = 256
"""Ids below this are single bytes in the project's generated tokenizers; prompts start here."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a client needs to know to build prompts for a model folder.

    Attributes:
        vocab_size: Size of the model's vocabulary.
        special_ids: Ids of special tokens (never put into prompts).
        prompt_low: Lowest id prompts draw from.
        prompt_high: One past the highest id prompts draw from.
        max_position_embeddings: The model's context length.
    """

    vocab_size: int
    special_ids: tuple[int, ...]
    prompt_low: int
    prompt_high: int
    max_position_embeddings: int


def model_info(directory: str | Path) -> ModelInfo:
    """Read what prompt building needs from a model folder's ``config.json``.

    Prompts draw ids above the byte range and below the first special id, so random prompts
    never contain special tokens. For models not made by :func:`make_model` the same rule applies
    to the ids that ``config.json`` names.

    Raises:
        ConfigError: The folder has no readable ``config.json``.
    """
    path = Path(directory) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{path}: cannot read model config ({exc}); make one with "
            "`vllm-autotune make-model DIR --preset tiny`"
        ) from exc
    vocab = int(cfg.get("text_config", cfg).get("vocab_size", 32000))
    specials: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = cfg.get(key)
        if isinstance(value, int):
            specials.add(value)
        elif isinstance(value, list):
            specials.update(int(v) for v in value)
    below = [s for s in specials if s > BYTE_TOKENS]
    high = min(below) if below else vocab
    return ModelInfo(
        vocab_size=vocab,
        special_ids=tuple(sorted(specials)),
        prompt_low=BYTE_TOKENS,
        prompt_high=high,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
    )
