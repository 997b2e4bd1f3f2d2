"""optimizer.engine.gpus against a fake ``nvidia-smi`` (a shell script on PATH that prints
fixed CSV): which GPUs a CUDA_VISIBLE_DEVICES names, a server's GPU memory by pid and by its
visible GPUs, and the placement verdict."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from optimizer.engine import gpus as g

GPUS_CSV = "0, GPU-aaa, 1200\n1, GPU-bbb, 80000\n2, GPU-ccc, 3\n"


def _fake_smi(tmp_path: Path, apps_csv: str) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --query-gpu=*) printf '{GPUS_CSV}' ;;\n"
        f"  --query-compute-apps=*) printf '{apps_csv}' ;;\n"
        "  *) exit 2 ;;\n"
        "esac\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def install(apps_csv: str) -> None:
        _fake_smi(tmp_path, apps_csv)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    return install


def test_without_nvidia_smi_everything_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert g.gpus() is None and g.compute_apps() is None
    assert g.server_gpu_mib([1, 2], "0") is None
    doc = g.placement([1], {"CUDA_VISIBLE_DEVICES": "0"}, ["0"])
    assert doc["ok"] is None and doc["nvidia_smi"] is False
    assert doc["cuda_visible_devices"] == "0" and doc["ray_gpu_ids"] == ["0"]


def test_visible_gpus_by_index_uuid_unset_and_empty(fake_smi) -> None:  # type: ignore[no-untyped-def]
    fake_smi("")
    listed = g.gpus()
    assert listed is not None and [x.index for x in listed] == [0, 1, 2]
    assert [x.index for x in g.visible_gpus(listed, "2,0")] == [2, 0]
    assert [x.index for x in g.visible_gpus(listed, "GPU-bbb")] == [1]
    assert [x.index for x in g.visible_gpus(listed, None)] == [0, 1, 2]
    assert g.visible_gpus(listed, "") == []


def test_server_memory_by_pid_then_by_visible_gpus(fake_smi) -> None:  # type: ignore[no-untyped-def]
    fake_smi("41, GPU-bbb, 70000\n42, GPU-bbb, 500\n99, GPU-aaa, 1000\n")
    assert g.server_gpu_mib([41, 42], "1") == 70500.0
    # None of the server's pids listed (another PID namespace): its visible GPUs' memory.
    assert g.server_gpu_mib([7], "1") == 80000.0
    assert g.server_gpu_mib([7], "0,2") == 1203.0


def test_placement_flags_a_server_on_a_gpu_it_was_not_given(fake_smi) -> None:  # type: ignore[no-untyped-def]
    fake_smi("41, GPU-bbb, 70000\n99, GPU-aaa, 1000\n")
    good = g.placement([41], {"CUDA_VISIBLE_DEVICES": "1"}, ["1"])
    assert good["ok"] is True
    assert [p["server"] for p in good["processes"]] == [True, False]
    assert good["processes"][0]["gpu_index"] == 1
    bad = g.placement([41, 99], {"CUDA_VISIBLE_DEVICES": "1"}, ["1"])
    assert bad["ok"] is False
    unseen = g.placement([5], {"CUDA_VISIBLE_DEVICES": "1"}, ["1"])
    assert unseen["ok"] is None and "PID namespace" in unseen["note"]
    assert [v["index"] for v in unseen["visible"]] == [1]
