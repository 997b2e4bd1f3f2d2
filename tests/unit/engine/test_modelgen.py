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
