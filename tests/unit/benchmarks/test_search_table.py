"""The search-efficiency benchmark's table, table server and offline study on a SYNTHETIC table
(made up here: it tests the code, it is never a result; the benchmark's results come from the
measured table). The synthetic table and its helpers are shared with
``test_search_efficiency.py``."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace

import pytest

from benchmarks.search_table import Measurement, OfflineStudy, Table, TableServer, load_table
from optimizer.types import CapacitySettings

GRID = {
    "max-num-seqs": [4, 16, 64],
    "max-num-batched-tokens": [256, 2048],
    "enable-prefix-caching": [True, False],
}
SETTINGS = CapacitySettings(start_scale=0.5, min_scale=0.0625, max_scale=8, tolerance=0.1)


def _steps(capacity: float) -> list[dict]:
    """A recorded search of a fake server whose margin is scale / capacity - 1."""
    out = []
    for scale in (0.5, 0.25, 0.35, 0.3, 1.0):
        margin = scale / capacity - 1 if capacity > 0 else 1.0
        early = margin > 1.0
        out.append(
            {
                "scale": scale,
                "passed": margin <= 0,
                "stopped_early": early,
                "margin": None if early else margin,
                "replay_s": (5.0 if early else 10.0) / scale,
            }
        )
    return out


def synthetic_table(missing: int = 0) -> dict:
    """Capacity grows with max-num-seqs and a small batch budget; two repeats each (SYNTHETIC)."""
    configs = {}
    points = list(itertools.product(*GRID.values()))[missing:]
    for seqs, budget, prefix in points:
        cap = 0.1 * math.log2(seqs) * (1.3 if budget == 256 else 1.0) * (1.05 if prefix else 1)
        params = {
            "enable-prefix-caching": prefix,
            "max-num-batched-tokens": budget,
            "max-num-seqs": seqs,
        }
        configs[json.dumps(params, sort_keys=True)] = _entry(params, cap, baseline=False)
    configs["base"] = _entry({"max-num-seqs": 128}, 0.25, baseline=True)
    return {"configs": configs}


def _entry(params: dict, cap: float, baseline: bool) -> dict:
    ms = []
    for jitter in (0.97, 1.03):
        steps = _steps(cap * jitter)
        ms.append(
            {
                "baseline": baseline,
                "capacity_scale": cap * jitter,
                "capacity_rps": cap * jitter * 6.0,
                "rps_per_scale": 6.0,
                "startup_s": 30.0,
                "wall_s": 30.0 + sum(s["replay_s"] for s in steps) + 12.0,
                "steps": steps,
            }
        )
    return {"args": params, "params": params, "measurements": ms}


def test_the_table_loads_and_refuses_missing_points() -> None:
    table = load_table(synthetic_table())
    assert table.grid == {**GRID, "enable-prefix-caching": [False, True]}
    assert len(table.configs) == 13 and table.baseline == "baseline"
    assert table.best == pytest.approx(0.6 * 1.3 * 1.05 * 6.0)
    assert table.step_overhead_s == pytest.approx(2.0)  # 12 s over 5 steps + 1
    with pytest.raises(SystemExit, match="lacks 2 grid point"):
        load_table(synthetic_table(missing=2))
    assert len(load_table(synthetic_table(missing=2), partial=True).configs) == 11


def test_the_table_answers_a_step_from_the_drawn_measurement() -> None:
    table = load_table(synthetic_table())
    m = table.configs[table.baseline][0]  # capacity 0.2425
    server = TableServer(m)
    assert not server(0.3, 0).passed and server(0.2, 0).passed
    assert server(0.3, 0).deciding_margin == pytest.approx(0.3 / m.capacity_scale - 1, rel=1e-6)
    before = server.seconds
    server(0.25, 0)
    assert server.seconds - before == pytest.approx(10.0 / 0.25)  # the recorded step at x0.25
    far = server(4.0, 0)
    assert far.stopped_early  # recorded early stops above x1.0
    # No step at x4 was recorded: flat above the highest recorded early stop (x1.0, 5 s).
    assert server.seconds - before == pytest.approx(40.0 + 5.0)
    assert server.sources == {"recorded": 3, "interpolated": 2}  # x0.2 was not recorded


def test_a_repeated_step_is_one_point_of_the_margin_curve() -> None:
    table = load_table(synthetic_table())
    m = table.configs[table.baseline][0]
    full = next(s for s in m.steps if not s["stopped_early"])
    steps = (*m.steps, {**full, "margin": full["margin"] + 0.2})  # that step again
    server = TableServer(replace(m, steps=steps))
    assert len(server.points) == len({s["scale"] for s in m.steps if not s["stopped_early"]})
    assert server(8.0, 0).deciding_margin > 0  # extended past the last point: no division by 0


def test_racing_charges_a_losing_trial_less_than_the_full_search() -> None:
    table = load_table(synthetic_table())
    key = table.key(
        {"max-num-seqs": 4, "max-num-batched-tokens": 2048, "enable-prefix-caching": False}
    )
    costs = {}
    for racing in (False, True):
        study = OfflineStudy(table, SETTINGS, racing=racing, rng=random.Random(0))
        study.measure(
            table.key(
                {"max-num-seqs": 64, "max-num-batched-tokens": 256, "enable-prefix-caching": True}
            )
        )
        before = study.seconds
        _told, raced = study.measure(key)
        costs[racing] = study.seconds - before
        assert raced is racing
    assert costs[True] < costs[False] / 2


def _measured(steps: list[dict], capacity: float = 1.0) -> Measurement:
    return Measurement(
        capacity_scale=capacity, rps_per_scale=6.0, startup_s=30.0, steps=tuple(steps)
    )


def _step(scale: float, replay_s: float, early: bool = False) -> dict:
    margin = scale - 1.0
    return {
        "scale": scale,
        "passed": margin <= 0,
        "stopped_early": early,
        "margin": None if early else margin,
        "replay_s": replay_s,
    }


def test_a_step_is_charged_its_recorded_seconds_not_one_over_scale() -> None:
    # Recorded seconds that stop falling at high scale (a replay's own requests take time):
    # the 1 / scale model would charge x0.5 40 s and x4 2.5 s.
    steps = [_step(0.5, 20.0), _step(1.0, 10.0), _step(2.0, 6.0, early=True), _step(4.0, 5.0)]
    m = _measured(steps, capacity=1.5)
    server = TableServer(m)
    assert server.step_s(0.5, False) == pytest.approx(20.0)
    assert server.step_s(4.0, False) == pytest.approx(5.0)
    assert server.step_s(2.0, True) == pytest.approx(6.0)
    # Between recorded scales: log seconds linear in log scale (x0.707: sqrt(20 * 10)).
    assert server.step_s(2**-0.5, False) == pytest.approx(math.sqrt(200.0))
    assert server.step_s(16.0, False) == pytest.approx(5.0)  # flat above the highest
    assert server.step_s(0.25, False) == pytest.approx(40.0)  # 1 / scale below the lowest
    assert server.sources == {"recorded": 3, "interpolated": 3}
    # Another repeat's record at a scale this one lacks comes before interpolation.
    twin = _measured([_step(0.7, 33.0)])
    other = TableServer(m, (twin,))
    assert other.step_s(0.7, False) == pytest.approx(33.0)
    assert other.sources == {"another repeat": 1}
    # The 1 / scale model of earlier runs, on request: median(replay * scale) = 10 s / scale.
    model = TableServer(m, step_seconds="scale")
    assert model.step_s(4.0, False) == pytest.approx(10.0 / 4.0)
    assert model.sources == {"scale model": 1}
    # A kind never recorded (no early stop here) falls back to the model.
    only_full = TableServer(_measured([_step(0.5, 20.0), _step(1.0, 10.0)]))
    assert only_full.step_s(2.0, True) == pytest.approx(0.5 * 10.0 / 2.0)
    assert only_full.sources == {"scale model": 1}


def test_a_trial_is_charged_its_start_overhead_and_the_recorded_steps() -> None:
    from optimizer.capacity.search import StepOutcome, search_capacity

    capacity = 3.0
    scales: list[float] = []

    def fake(scale: float, attempt: int) -> StepOutcome:
        scales.append(scale)
        return StepOutcome(scale, {"deciding": scale / capacity - 1}, stopped_early=False)

    search_capacity(fake, SETTINGS)  # the steps the study's search will take, recorded
    steps = [_step(x, 3.0 + 1.0 / x) for x in scales]  # not 1 / scale: a floor of 3 s
    for s in steps:
        s["margin"] = s["scale"] / capacity - 1
        s["passed"] = s["margin"] <= 0
    m = _measured(steps, capacity=capacity)
    table = Table(
        grid={"x": [1]},
        configs={"baseline": [m], "p": [m]},
        truth={"baseline": 1.0, "p": 18.0},
        baseline="baseline",
        step_overhead_s=2.0,
    )
    study = OfflineStudy(table, SETTINGS, racing=False, rng=random.Random(0))
    study.measure("p")
    assert study.run.step_sources == {"recorded": len(scales)}
    assert study.seconds == pytest.approx(m.cost_s(2.0))  # start, overhead, recorded replays
    assert study.seconds == pytest.approx(
        30.0 + 2.0 * (len(scales) + 1) + sum(3.0 + 1.0 / x for x in scales)
    )
    model = OfflineStudy(
        replace(table, step_seconds="scale"), SETTINGS, racing=False, rng=random.Random(0)
    )
    model.measure("p")
    assert model.seconds != pytest.approx(study.seconds, rel=0.05)  # the model charges other


def test_merged_labels_pool_their_repeats_into_one_point() -> None:
    doc = synthetic_table()
    twin = {}
    for key, entry in doc["configs"].items():  # each point measured twice more as another label
        if entry["measurements"][0]["baseline"]:
            continue
        params = {**entry["params"], "kv": 2}
        ms = [{**m, "capacity_rps": m["capacity_rps"] * 2} for m in entry["measurements"]]
        twin[key + "kv"] = {"args": params, "params": params, "measurements": ms}
        entry["params"] = {**entry["params"], "kv": 1}
    doc["configs"].update(twin)
    labels = load_table(doc)
    assert len(labels.configs) == 25 and labels.grid["kv"] == [1, 2]
    merged = load_table(doc, merge=("kv",))
    assert "kv" not in merged.grid and len(merged.configs) == 13
    assert all(len(ms) == 4 for k, ms in merged.configs.items() if k != merged.baseline)
    # The truth is the pooled mean: x1.5 the one-label mean; the grid's time halves.
    assert merged.best == pytest.approx(labels.best * 0.75)
    assert merged.full_grid_s() == pytest.approx(labels.full_grid_s() / 2)


def test_the_baseline_is_a_param_less_trial_with_its_arguments_and_symptom() -> None:
    doc = synthetic_table()
    for entry in doc["configs"].values():  # FAKE symptoms: the baseline's TPOT broke first
        for m in entry["measurements"]:
            m["symptom"] = "tpot_prefill_interference" if m["baseline"] else "ttft_queue"
    table = load_table(doc)
    assert table.baseline_args == {"max-num-seqs": 128}
    assert {m.symptom for m in table.configs[table.baseline]} == {"tpot_prefill_interference"}
    study = OfflineStudy(table, SETTINGS, racing=False, rng=random.Random(0))
    with pytest.raises(ValueError, match="not been measured"):
        study.baseline_trial()
    told, _raced = study.measure(table.baseline)
    trial = study.baseline_trial()
    assert trial.state.name == "COMPLETE" and trial.params == {} and trial.value == told
    assert json.loads(trial.user_attrs["engine_args"]) == {"max-num-seqs": 128}
    assert trial.user_attrs["symptom"] == "tpot_prefill_interference"
    key = next(k for k in table.configs if k != table.baseline)
    study.measure(key)
    assert study.symptoms == {table.baseline: "tpot_prefill_interference", key: "ttft_queue"}


def test_a_model_sampler_proposes_the_same_with_or_without_the_baseline_trial() -> None:
    """TPE and GP do not see the param-less baseline (KnowledgeSampler leaves it out): the
    offline study may put it first without changing their proposals (FAKE told values)."""
    import optuna

    from optimizer.sampling import model_sampler

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    for name in ("tpe", "gp"):
        proposals = []
        for with_baseline in (False, True):
            study = optuna.create_study(direction="maximize", sampler=model_sampler(name, 0, 2))
            if with_baseline:
                study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"b": 1}))
            points = []
            for _ in range(6):
                t = study.ask()
                p = {k: t.suggest_categorical(k, v) for k, v in GRID.items()}
                study.tell(t, math.log2(p["max-num-seqs"]) + (p["max-num-batched-tokens"] == 256))
                points.append(p)
            proposals.append(points)
        assert proposals[0] == proposals[1], name


def test_refused_labels_complete_the_grid_without_being_points() -> None:
    # The third grid refuses chunked prefill off with a budget under the context before any
    # server starts: those labels are part of the grid's product but have nothing to measure.
    doc = synthetic_table(missing=2)
    for key, entry in list(synthetic_table()["configs"].items())[:2]:
        doc.setdefault("refused", {})[key] = {"params": entry["params"], "message": "invalid"}
    table = load_table(doc)  # complete: 10 measured, 2 refused, the product of the grid is 12
    assert len(table.configs) == 11 and len(table.refused) == 2
    assert not table.refused & set(table.configs)
    assert all(table.key(json.loads(k)) == k for k in table.refused)
