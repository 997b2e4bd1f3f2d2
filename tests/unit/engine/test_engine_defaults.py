"""The one rule for engine defaults (optimizer.engine.defaults), shared by the CLI and study
preparation."""

from __future__ import annotations

from pathlib import Path

from optimizer.engine.defaults import apply_engine_defaults, prompt_token_range


def test_cpu_build_gets_the_kv_cache_variable_unless_sized_in_bytes(tmp_path: Path) -> None:
    plain = apply_engine_defaults("org/model", {}, cpu_build=True, kv_cache_gib=3)
    assert plain.env == {"VLLM_CPU_KVCACHE_SPACE": "3"} and "load-format" not in plain.args
    sized = apply_engine_defaults(
        "org/model", {"kv_cache_memory_bytes": 2**30}, cpu_build=True, kv_cache_gib=3
    )
    assert sized.env == {}
    kept = apply_engine_defaults("org/model", {}, {"VLLM_CPU_KVCACHE_SPACE": "5"}, cpu_build=True)
    assert kept.env == {"VLLM_CPU_KVCACHE_SPACE": "5"}
    assert apply_engine_defaults("org/model", {}, cpu_build=False).env == {}


def test_dummy_weights_only_for_a_folder_without_weight_files(tmp_path: Path) -> None:
    empty = apply_engine_defaults(str(tmp_path), {}, cpu_build=False)
    assert empty.args == {"load-format": "dummy"} and empty.notes
    chosen = apply_engine_defaults(str(tmp_path), {"load_format": "auto"}, cpu_build=False)
    assert chosen.args == {"load_format": "auto"}
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    assert apply_engine_defaults(str(tmp_path), {}, cpu_build=False).args == {}


def test_prompt_token_range() -> None:
    assert prompt_token_range("org/model", [5, 9]) == (5, 9)
    assert prompt_token_range(None) == (1000, 30000)
    assert prompt_token_range("org/model") == (1000, 30000)


def test_compile_caches_go_in_the_study_folder_unless_the_job_names_them(tmp_path: Path) -> None:
    from optimizer.engine.defaults import compile_cache_env

    env = compile_cache_env(tmp_path / "cache", {"TRITON_CACHE_DIR": "/elsewhere", "X": "1"})
    assert env == {
        "VLLM_CACHE_ROOT": str(tmp_path / "cache" / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
        "TRITON_CACHE_DIR": "/elsewhere",
        "X": "1",
    }
