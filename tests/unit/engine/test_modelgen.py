"""make-model: published shapes, and a tokenizer built for measurement (DESIGN.md §7.11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from optimizer.engine.models import PRESETS, make_model, model_info
from optimizer.errors import ConfigError


def test_tiny_tokenizer_decodes_every_id_to_non_empty_text(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m", "tiny")
    cfg = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(cfg["vocab_size"])]
    assert all(t != "" for t in texts)
    # Words above the byte range are distinct, so a chunk's text identifies its token.
    assert len(set(texts[256:])) == cfg["vocab_size"] - 256


def test_prompts_encode_one_byte_per_token(tmp_path: Path) -> None:
    out = make_model(tmp_path / "m", "tiny")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "The quick brown fox, 12345!\n\tjumps ~over~ {the} lazy dog."
    ids = tok.encode(text, add_special_tokens=True).ids
    assert ids == list(text.encode("ascii"))
    assert tok.decode(ids) == text


def test_llama_preset_has_published_shape_and_full_vocab(tmp_path: Path) -> None:
    out = make_model(tmp_path / "l", "llama-3.1-8b")
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    ) == (4096, 32, 32, 8, 14336, 128256)
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 128256
    assert tok.token_to_id("<|begin_of_text|>") == 128000
    for i in (0, 255, 256, 127999, 128000, 128001, 128255):
        assert tok.decode([i], skip_special_tokens=False) != ""
    info = model_info(out)
    assert info.prompt_low == 256 and info.prompt_high == 128000
    assert 128000 in info.special_ids and 128001 in info.special_ids


def test_every_preset_is_consistent() -> None:
    for name, spec in PRESETS.items():
        heads, kv = spec["num_attention_heads"], spec["num_key_value_heads"]
        assert heads % kv == 0, name
        head_dim = spec.get("head_dim", spec["hidden_size"] // heads)
        assert head_dim * heads == spec["hidden_size"] or name == "tiny", name
        assert (
            spec["bos_token_id"] < spec["vocab_size"] and spec["eos_token_id"] < spec["vocab_size"]
        )
    # The CPU build's attention needs head sizes that are multiples of 32.
    for name in ("tiny", "small"):
        assert PRESETS[name]["head_dim"] % 32 == 0, name
    assert PRESETS["qwen2.5-7b"]["vocab_size"] == 152064
    assert PRESETS["llama-3.1-70b"]["num_hidden_layers"] == 80


def test_unknown_preset_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tiny"):
        make_model(tmp_path / "x", "llama-9")


def test_model_info_without_config_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="make-model"):
        model_info(tmp_path)


@pytest.mark.parametrize(("draft", "layers"), [("llama-3.2-1b", 16), ("eagle-llama-3.1-8b", 1)])
def test_the_8b_shapes_drafts_share_its_vocabulary_and_are_much_smaller(
    tmp_path: Path, draft: str, layers: int
) -> None:
    target, d = PRESETS["llama-3.1-8b"], PRESETS[draft]
    assert d["vocab_size"] == target["vocab_size"] and d["_special"] == target["_special"]
    assert d["num_hidden_layers"] == layers < target["num_hidden_layers"]

    def params(p: dict[str, object]) -> float:
        h, i, n, v = (
            float(p[k])
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        )
        return n * (4 * h * h + 3 * h * i) + v * h

    assert params(d) < 0.25 * params(target)
    folder = make_model(tmp_path / draft, draft, max_model_len=8192)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == layers and config["max_position_embeddings"] == 8192


def test_seeded_weights_give_a_checkpoint_of_the_shape_and_two_seeds_two_models(
    tmp_path: Path,
) -> None:
    import json as _json

    import numpy as np
    from safetensors.numpy import load_file

    from optimizer.engine.models import WEIGHTS_FILE, make_model, needs_making, weights_seed_of

    a = make_model(tmp_path / "a", "tiny", weights_seed=1)
    config = _json.loads((a / "config.json").read_text())
    tensors = load_file(str(a / WEIGHTS_FILE))
    h, v = config["hidden_size"], config["vocab_size"]
    assert tensors["model.embed_tokens.weight"].shape == (v, h)
    assert len(tensors) == 2 + 9 * config["num_hidden_layers"]  # tied embeddings: no lm_head
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 0.02) < 0.002 and np.all(tensors["model.norm.weight"] == 1.0)
    assert weights_seed_of(a) == 1 and not needs_making(a, 1) and needs_making(a, 2)
    b = make_model(tmp_path / "b", "tiny", weights_seed=2)
    assert not np.array_equal(
        q, load_file(str(b / WEIGHTS_FILE))["model.layers.0.self_attn.q_proj.weight"]
    )
    again = make_model(tmp_path / "a", "tiny")  # re-made weight-less: no stale weights left
    assert not (again / WEIGHTS_FILE).exists() and weights_seed_of(again) is None


def test_a_weights_seed_needs_a_preset_to_make() -> None:
    from pydantic import ValidationError

    from optimizer.config import ModelSection

    with pytest.raises(ValidationError, match="needs make"):
        ModelSection(path="m", weights_seed=1)
    assert ModelSection(path="m", make="small", weights_seed=1).weights_seed == 1
