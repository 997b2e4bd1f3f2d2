"""Servable model folders without weights, for ``vllm serve --load-format dummy``.

``make_model`` writes a ``config.json`` with a published architecture (or a tiny one for CPU
tests), a generation config, and a tokenizer built locally with the ``tokenizers`` package, so
nothing is downloaded. Random weights generate random token ids, so the tokenizer is built for
measurement (DESIGN.md §7.11): every id of the model's vocabulary decodes to non-empty text (ids
0-255 are single bytes, shown as their Latin-1 character; every other id is a distinct short
word; special tokens keep their visible names when the client asks for them), and text prompts
encode one byte per token. A streamed completion therefore carries exactly one visible chunk per
generated token, which is what TTFT and ITL measurements need.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimizer.errors import ConfigError
from optimizer.workload.prompts import BYTE_TOKENS, ModelInfo, model_info

__all__ = [
    "PRESETS",
    "WEIGHTS_FILE",
    "ModelInfo",
    "make_model",
    "model_info",
    "write_seeded_weights",
]

#: The file of a made checkpoint's seeded weights (:func:`write_seeded_weights`).
WEIGHTS_FILE = "model.safetensors"

_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

# The made-up Llama shapes for CPU tests and demos: a 4k vocabulary, head sizes that are
# multiples of 32 (the CPU build's attention), everything but the sizes in common.
_LOCAL_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 4094,
    "eos_token_id": 4095,
    "_special": {4094: "<s>", 4095: "</s>"},
}

# Architecture numbers as published by the models' authors (config.json of the HF releases).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_LOCAL_LLAMA,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    # Big enough that compute, not Python overhead, sets a CPU server's step time (about 15 M
    # parameters): scheduler knobs then move TTFT and TPOT on 2 cores as they do on a GPU.
    "small": {
        **_LOCAL_LLAMA,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "_special": {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>"},
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "_special": {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>"},
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "_special": {151643: "<|endoftext|>", 151645: "<|im_end|>"},
    },
}

# Drafts for speculative decoding of the 8B shape (issue 28): its vocabulary and special tokens,
# so the target's tokens are the draft's. With random weights their acceptance is meaningless: a
# study states it (engine.speculation) and vLLM's synthetic sampler applies it.
# A draft model of the family, Llama-3.2-1B's shapes (speculative-config method draft_model):
PRESETS["llama-3.2-1b"] = {
    **PRESETS["llama-3.1-8b"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "rope_scaling": {**_LLAMA31_ROPE, "factor": 32.0},
    "tie_word_embeddings": True,
}
# An EAGLE head for the 8B (the published EAGLE-LLaMA3.1-Instruct-8B's shapes: one decoder layer
# of the target's width; speculative-config method eagle):
PRESETS["eagle-llama-3.1-8b"] = {**PRESETS["llama-3.1-8b"], "num_hidden_layers": 1}

_BYTE_TOKENS = BYTE_TOKENS


def _word(token_id: int) -> str:
    # Distinct, short, visible, and never a single character (so it cannot collide with a byte).
    return f" t{token_id}"


def _build_tokenizer(vocab_size: int, special: dict[int, str]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab: dict[str, int] = {}
    for i in range(min(_BYTE_TOKENS, vocab_size)):
        vocab[chr(i)] = i
    for i in range(_BYTE_TOKENS, vocab_size):
        if i not in special:
            vocab[_word(i)] = i
    # Special tokens must be in the base vocab so their ids are exactly the published ones.
    for i, name in special.items():
        vocab[name] = i
    # BPE without merges over single characters: ASCII text encodes one byte per token, and
    # every id decodes to its own non-empty string (Fuse joins tokens without separators).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name in special.values()]
    )
    return tok


def _llama_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint with ``config``'s sizes, as Hugging Face names it."""
    h, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or h // heads)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (int(config["vocab_size"]), h),
        "model.norm.weight": (h,),
    }
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (heads * head_dim, h),
                p + "self_attn.k_proj.weight": (kv * head_dim, h),
                p + "self_attn.v_proj.weight": (kv * head_dim, h),
                p + "self_attn.o_proj.weight": (h, heads * head_dim),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (int(config["vocab_size"]), h)
    return shapes


def write_seeded_weights(directory: str | Path, seed: int, std: float = 0.02) -> Path:
    """Give a made Llama folder weights that say something: seeded normal(0, ``std``) matrices
    (the architecture's standard initialization scale) and unit norms, in safetensors.

    vLLM's dummy weights (uniform, +-1e-3) give flat logits: every token about ``-ln(vocab)``,
    so nothing that changes numerics shows. Seeded weights at a standard scale give peaked,
    reproducible distributions that an FP8 KV cache measurably moves, loaded by vLLM's normal
    loader (no ``--load-format dummy``). Two seeds give two different models.

    Returns:
        The weights file.

    Raises:
        ConfigError: The folder is not a made Llama folder, or safetensors is not installed.
    """
    import numpy as np

    try:
        from safetensors.numpy import save_file
    except ImportError as exc:  # pragma: no cover - installed with vLLM and transformers
        raise ConfigError(
            "seeded weights need the safetensors package (pip install safetensors)"
        ) from exc
    folder = Path(directory)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ConfigError(
            f"seeded weights are made for the Llama presets only, not {config.get('model_type')!r}"
        )
    rng = np.random.default_rng(seed)
    tensors = {
        name: (
            np.ones(shape, dtype=np.float32)
            if len(shape) == 1
            else rng.normal(0.0, std, size=shape).astype(np.float32)
        )
        for name, shape in _llama_shapes(config).items()
    }
    out = folder / WEIGHTS_FILE
    meta = {"format": "pt", "seed": str(seed), "std": str(std)}
    _atomic(out, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    return out


def weights_seed_of(directory: str | Path) -> int | None:
    """The seed of a made folder's weights (None: no seeded weights there)."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        seed = (f.metadata() or {}).get("seed")
    return int(seed) if seed is not None and seed.isdigit() else None


def needs_making(directory: str | Path, weights_seed: int | None) -> bool:
    """True where a made folder is missing, or lacks the seeded weights the job asks for."""
    folder = Path(directory)
    if not (folder / "config.json").exists():
        return True
    return weights_seed is not None and weights_seed_of(folder) != weights_seed


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through ``write(tmp)`` on a temporary name beside it, then rename it into
    place: a reader (another driver making the same folder on a shared filesystem) sees the
    old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: tmp.write_text(text))


def _write_tokenizer(out: Path, spec: dict[str, Any], special: dict[int, str], preset: str) -> None:
    """The folder's tokenizer files: the local tokenizer, its config and special tokens."""
    tok = _build_tokenizer(int(spec["vocab_size"]), special)
    _atomic(out / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
    bos, eos = special[spec["bos_token_id"]], special[spec["eos_token_id"]]
    _write_text(
        out / "tokenizer_config.json",
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": bos,
                "eos_token": eos,
                "pad_token": eos,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": spec["max_position_embeddings"],
                "vllm_autotune_preset": preset,
            },
            indent=2,
        )
        + "\n",
    )
    _write_text(
        out / "special_tokens_map.json",
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": eos}, indent=2) + "\n",
    )


def make_model(
    directory: str | Path,
    preset: str = "tiny",
    *,
    max_model_len: int | None = None,
    weights_seed: int | None = None,
) -> Path:
    """Write a servable model folder: weight-less for ``--load-format dummy``, or with seeded
    weights (:func:`write_seeded_weights`) where ``weights_seed`` is given.

    Args:
        directory: Folder to write (created if missing; existing files are overwritten).
        preset: One of :data:`PRESETS`.
        max_model_len: Optionally lower ``max_position_embeddings`` (useful for CPU demos).
        weights_seed: Seed of the folder's weights (Llama presets); None: no weights.

    Returns:
        The folder.

    Raises:
        ConfigError: Unknown preset.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    spec = dict(PRESETS[preset])
    special: dict[int, str] = spec.pop("_special")
    if max_model_len is not None:
        spec["max_position_embeddings"] = int(max_model_len)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        **spec,
        "transformers_version": "4.46.0",
        "use_cache": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "pretraining_tp": 1,
    }
    if spec["model_type"] == "qwen2":
        config.pop("attention_bias")
        config.pop("mlp_bias")
        config.pop("pretraining_tp")
    _write_text(
        out / "generation_config.json",
        json.dumps(
            {
                "bos_token_id": spec["bos_token_id"],
                "eos_token_id": spec["eos_token_id"],
                "do_sample": False,
            },
            indent=2,
        )
        + "\n",
    )
    _write_tokenizer(out, spec, special, preset)
    # config.json last: a folder with it is whole (needs_making reads it), even while another
    # driver makes the same folder on a shared filesystem.
    _write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    if weights_seed is not None:
        write_seeded_weights(out, weights_seed)
    else:
        (out / WEIGHTS_FILE).unlink(missing_ok=True)  # a folder re-made without weights
    return out
