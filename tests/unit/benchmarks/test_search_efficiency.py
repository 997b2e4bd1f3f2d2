"""The search-efficiency benchmark's strategies, statistics and output on a SYNTHETIC table
(made up here: it tests the code, it is never a result; the benchmark's results come from the
measured table)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest

from benchmarks.search_efficiency import (
    STRATEGIES,
    run_all,
    run_one_at_a_time,
    summarize_runs,
)
from benchmarks.search_table import Table, load_table
from optimizer.sampling import ORIGIN_ATTR
from tests.unit.benchmarks.test_search_table import SETTINGS, _measured, _step, synthetic_table


def tiny_table(points: int) -> Table:
    """``points`` values of one param and the baseline, one measurement each (SYNTHETIC)."""
    m = _measured([_step(0.5, 20.0), _step(1.0, 10.0), _step(2.0, 5.0)], capacity=1.5)
    grid = {"x": list(range(points))}
    keys = [json.dumps({"x": x}) for x in grid["x"]]
    return Table(
        grid=grid,
        configs={"baseline": [m], **{k: [m] for k in keys}},
        truth={"baseline": 1.0, **{k: 2.0 + i for i, k in enumerate(keys)}},
        baseline="baseline",
        step_overhead_s=2.0,
    )


def spy_studies(monkeypatch: pytest.MonkeyPatch) -> list[optuna.Study]:
    """The Optuna studies the benchmark creates from now on, in order."""
    studies: list[optuna.Study] = []
    real = optuna.create_study

    def spy(*args: Any, **kwargs: Any) -> optuna.Study:
        studies.append(real(*args, **kwargs))
        return studies[-1]

    monkeypatch.setattr(optuna, "create_study", spy)
    return studies


def table_doc_with_refused(n: int) -> dict[str, Any]:
    """The SYNTHETIC table with its first ``n`` points refused as invalid, not measured."""
    from tests.unit.benchmarks.test_search_table import synthetic_table

    doc = synthetic_table(missing=n)
    doc["refused"] = {
        k: {"params": e["params"], "message": "invalid"}
        for k, e in list(synthetic_table()["configs"].items())[:n]
    }
    return doc


def test_every_strategy_runs_within_the_budget_and_the_summary_reads_it() -> None:
    table = load_table(synthetic_table())
    budget = table.full_grid_s() / 2
    runs = run_all(table, SETTINGS, list(STRATEGIES), seeds=2, budget_s=budget)
    for name, rs in runs.items():
        for run in rs:
            times = [t for t, _ in run.curve]
            assert times == sorted(times) and run.trials >= 2, name
            # It stops launching once the budget is spent: one trial may end past it.
            assert times[-2] < budget if len(times) > 1 else True
    rows = {r["strategy"]: r for r in summarize_runs(table, runs, table.full_grid_s())}
    assert set(rows) == set(STRATEGIES)
    assert all(0 <= r["gap_half"] <= 1 for r in rows.values())


def test_one_at_a_time_follows_the_guides_order_from_the_defaults() -> None:
    table = load_table(synthetic_table())
    run = run_one_at_a_time(table, SETTINGS, seed=0, budget_s=math.inf)
    # Baseline, the grid point nearest the defaults, then 2 + 1 + 1 single changes.
    assert run.trials == 1 + 1 + 2 + 1 + 1


def test_the_command_prints_its_table_and_draws_the_curves(tmp_path, capsys) -> None:
    from benchmarks.search_efficiency import main

    table = tmp_path / "table.json"
    table.write_text(json.dumps(synthetic_table()))
    png, rows = tmp_path / "curves.png", tmp_path / "rows.json"
    job = str(Path(__file__).resolve().parents[3] / "benchmarks/data/cpu-capacity-grid.yaml")
    args = [str(table), "--seeds", "2", "--png", str(png), "--json", str(rows), "--job", job]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tpe-racing" in out and "one-at-a-time" in out and "h to 95%" in out
    assert "found, % of the table's best, at 10 / 25 / 50 / 100 %" in out
    assert png.stat().st_size > 10_000
    doc = json.loads(rows.read_text())
    assert {r["strategy"] for r in doc["rows"]} == set(STRATEGIES)
    assert {r["strategy"] for r in doc["replication"]} == set(STRATEGIES)
    assert "| random-racing | 0-1 |" in out and "in the top decile at 25 / 50 / 100 %" in out
    assert "| strategy | trials | model's own | acquisition | random fallback |" in out
    origins = {r["strategy"]: r for r in doc["origins"]}
    assert set(origins) == set(STRATEGIES)
    assert origins["grid"]["own_total"] == origins["grid"]["trials_total"] - 2  # 2 baselines


def test_a_warm_start_measures_the_earlier_best_first_and_gives_tpe_the_priors() -> None:
    import optuna
    from optuna.distributions import CategoricalDistribution

    from benchmarks.search_efficiency import Warm, run_sampler

    table = load_table(synthetic_table())
    best = max((k for k in table.truth if k != table.baseline), key=table.truth.__getitem__)
    dists = {k: CategoricalDistribution(v) for k, v in table.grid.items()}
    priors = []
    for i, key in enumerate(k for k in table.truth if k != table.baseline):
        t = optuna.trial.create_trial(
            params=json.loads(key), distributions=dists, values=[table.truth[key]]
        )
        t.number = -(i + 1)
        priors.append(t)
    warm = Warm(top=(best,), priors=tuple(priors))
    run = run_sampler("tpe-warm", table, SETTINGS, seed=0, budget_s=math.inf, warm=warm)
    # The baseline, then the earlier study's best: found at the second trial.
    assert run.curve[1][1] == table.best
    with pytest.raises(SystemExit, match="--warm-from"):
        run_sampler("tpe-warm", table, SETTINGS, seed=0, budget_s=1.0)


def test_the_warm_start_of_the_measured_grid_comes_from_the_product() -> None:
    from benchmarks.search_efficiency import load_warm

    repo = Path(__file__).resolve().parents[3]
    table = load_table(json.loads((repo / "benchmarks/data/capacity_table_cpu.json").read_text()))
    warm = load_warm(
        repo / "benchmarks/data/capacity-grid/r1",
        table,
        repo / "benchmarks/data/cpu-capacity-grid.yaml",
    )
    # r1 measured 27 grid points (and 9 duplicates, 3 lost drivers: not told trials); its 3
    # best first.
    assert len(warm.priors) >= 20 and all(p.number < 0 for p in warm.priors)
    assert len(warm.top) == 3 and all(k in table.configs for k in warm.top)
    for p in warm.priors:
        assert table.key(p.params) in table.configs


def test_random_racing_races_through_the_tpe_racing_path() -> None:
    from benchmarks.search_efficiency import run_sampler

    table = load_table(synthetic_table())
    runs = {
        name: run_sampler(name, table, SETTINGS, seed=3, budget_s=math.inf)
        for name in ("random", "random-racing", "tpe-racing")
    }
    # Same seed, same sampler: random-racing proposes what random proposes, its losers cheaper.
    assert runs["random-racing"].trials == runs["random"].trials == len(table.configs)
    race = statistics.fmean(runs["random-racing"].losing_trial_s)
    full = statistics.fmean(runs["random"].losing_trial_s)
    assert race < full / 2
    assert race == pytest.approx(statistics.fmean(runs["tpe-racing"].losing_trial_s), rel=0.3)
    with pytest.raises(SystemExit, match="unknown strategy"):
        run_sampler("randm", table, SETTINGS, seed=0, budget_s=1.0)


def test_top_decile_and_the_returned_configuration() -> None:
    from benchmarks.search_efficiency import found_key_at, replication_rows, top_decile
    from benchmarks.search_table import Run

    table = load_table(synthetic_table())
    ranked = sorted((k for k in table.truth if k != table.baseline), key=table.truth.get)
    top = top_decile(table)  # 12 points: ceil(1.2) = the best 2
    assert top == set(ranked[-2:])
    full = table.full_grid_s()
    lucky = Run(
        curve=[(1.0, table.truth[ranked[0]]), (0.4 * full, table.truth[ranked[-1]])],
        curve_keys=[ranked[0], ranked[-1]],
        seed=0,
    )
    never = Run(curve=[(1.0, table.truth[ranked[0]])], curve_keys=[ranked[0]], seed=1)
    assert found_key_at(lucky, 0.3 * full, table.baseline) == ranked[0]
    assert found_key_at(lucky, full, table.baseline) == ranked[-1]
    assert found_key_at(never, 0.5, table.baseline) == table.baseline
    rows = replication_rows(table, {"s": [lucky, never]}, {"0": [0], "1": [1]})
    assert [r["seeds"] for r in rows] == ["0", "1", "all"]
    both = rows[-1]
    assert (both["top_decile_25"], both["top_decile_50"], both["top_decile_100"]) == (0, 1, 1)
    assert both["returned_rps"] == pytest.approx(
        (table.truth[ranked[-1]] + table.truth[ranked[0]]) / 2
    )
    assert both["share_100"] == pytest.approx((1 + table.truth[ranked[0]] / table.best) / 2)
    assert both["reached_best"] == 1 and rows[0]["median_to_best"] == pytest.approx(0.4)


def test_seed_sets_are_disjoint_ranges() -> None:
    from benchmarks.search_efficiency import parse_seed_sets

    assert parse_seed_sets("0-19,20-39") == {"0-19": list(range(20)), "20-39": list(range(20, 40))}
    assert parse_seed_sets("5") == {"5": [5]}
    with pytest.raises(SystemExit, match="not disjoint"):
        parse_seed_sets("0-19,10-29")


def test_differences_pair_strategies_per_seed_set_and_per_seed() -> None:
    from benchmarks.search_efficiency import differences, replication_rows
    from benchmarks.search_table import Run

    table = tiny_table(6)  # truths 2 .. 7 req/s, the best 7
    keys = [table.key({"x": x}) for x in range(6)]

    def runs(shift: int, seeds: range) -> list[Run]:
        """Seed s returns the point of truth 2 + s + shift at its first trial."""
        return [
            Run(curve=[(1.0, table.truth[keys[s + shift]])], curve_keys=[keys[s + shift]], seed=s)
            for s in seeds
        ]

    found = {
        "tpe-racing": runs(1, range(4)),
        "random-racing": runs(0, range(4)),
        "tpe": runs(0, range(4)),
        "random": runs(0, range(4)),  # tpe's runs exactly
        "random-3": runs(0, range(3)),
    }
    rows = replication_rows(table, found, {"0-1": [0, 1], "2-3": [2, 3]})
    diffs = {(d["pair"], d["seeds"]): d for d in differences(rows)}
    assert set(diffs) == {
        (f"{a} - {b}", seeds)
        for a, b in [
            ("tpe-racing", "random-racing"),
            ("tpe", "random"),
            ("random-racing", "random"),
            ("tpe-racing", "tpe"),
        ]
        for seeds in ("0-1", "2-3", "all")
    }
    # The same seeds with the same results: no difference, and no doubt about it (the
    # strategies' own spreads over seeds do not enter a paired difference).
    same = diffs[("tpe - random", "all")]
    assert rows[0]["returned_rps_ci"] > 0.5
    for key in ("share_25", "share_50", "share_100", "returned_rps"):
        assert (same[key], same[f"{key}_ci"]) == (0.0, 0.0)
    assert same["n"] == 4
    # One point better at every seed: the shift, with a half-width of 0.
    shift = diffs[("tpe-racing - random-racing", "all")]
    assert shift["returned_rps"] == pytest.approx(1.0)
    assert shift["returned_rps_ci"] == pytest.approx(0.0, abs=1e-9)
    assert shift["share_100"] == pytest.approx(1 / 7)
    assert shift["share_100_ci"] == pytest.approx(0.0, abs=1e-9)
    # Only the seeds both ran are paired; the half-width is Student's t of the differences.
    rows = replication_rows(
        table, {"a": runs(0, range(4)), "b": found["random-3"]}, {"0-3": [0, 1, 2, 3]}
    )
    rows[0]["per_seed"][0]["returned_rps"] += 3.0
    (d,) = differences(rows, [("a", "b")])
    assert d["n"] == 3 and d["returned_rps"] == pytest.approx(1.0)
    assert d["returned_rps_ci"] == pytest.approx(4.302653 * statistics.stdev([3, 0, 0]) / 3**0.5)


def test_the_tables_job_is_found_by_its_study_name(tmp_path) -> None:
    from benchmarks.search_efficiency import DATA_DIR, table_job

    for table, job in (
        ("capacity_table_cpu.json", "cpu-capacity-grid.yaml"),
        ("capacity_table_cpu_v2.json", "cpu-capacity-grid-v2.yaml"),
    ):
        doc = json.loads((DATA_DIR / table).read_text())
        assert table_job(doc, DATA_DIR) == DATA_DIR / job
    (tmp_path / "a.yaml").write_text("name: grid\n")
    (tmp_path / "b.yaml").write_text("name: grid\n")
    with pytest.raises(SystemExit, match=r"2 job files .* named 'grid'.*pass --job"):
        table_job({"made_with": [{"study": "grid"}]}, tmp_path)
    with pytest.raises(SystemExit, match="0 job files"):
        table_job({"made_with": [{"study": "other"}]}, tmp_path)
    with pytest.raises(SystemExit, match=r"studies .*pass --job"):
        table_job({"made_with": [{"study": "a"}, {"study": "b"}]}, tmp_path)


def test_a_grid_run_measures_every_point_once_and_ends(monkeypatch) -> None:
    from benchmarks.search_efficiency import run_strategy
    from benchmarks.search_table import OfflineStudy

    measured: list[str] = []
    real = OfflineStudy.measure

    def spy(self: OfflineStudy, key: str) -> tuple[float | None, bool]:
        measured.append(key)
        return real(self, key)

    monkeypatch.setattr(OfflineStudy, "measure", spy)
    table = load_table(synthetic_table())
    orders = []
    for seed in (0, 1):
        measured.clear()
        run = run_strategy("grid", table, SETTINGS, seed=seed, budget_s=math.inf)
        # The baseline, then every grid point once: the whole grid, and the run ends.
        assert measured[0] == table.baseline and sorted(measured) == sorted(table.configs)
        assert run.trials == len(table.configs) and run.seed == seed
        orders.append(list(measured))
    assert orders[0] != orders[1]  # a random order per seed
    run = run_strategy("grid", table, SETTINGS, seed=0, budget_s=table.full_grid_s() / 4)
    assert 2 <= run.trials < len(table.configs)  # the budget ends it first


def test_a_run_that_measured_every_configuration_asks_no_more(monkeypatch) -> None:

    from benchmarks.search_efficiency import run_sampler

    studies = spy_studies(monkeypatch)
    table = tiny_table(1)
    assert table.key({"x": 0}) in table.configs
    run = run_sampler("random", table, SETTINGS, seed=0, budget_s=math.inf)
    # The baseline and the one grid point: measured, nothing is left to ask for.
    assert run.trials == 2
    # The baseline (param-less, as the driver holds it) and the grid point.
    assert [t.state.name for t in studies[0].trials] == ["COMPLETE", "COMPLETE"]
    assert studies[0].trials[0].params == {} and studies[0].trials[1].params == {"x": 0}


class FakeOriginsSampler(optuna.samplers.BaseSampler):
    """A FAKE of the tuner's KnowledgeSampler as the benchmark reads it: scripted proposals,
    each counted in ``origins`` under its scripted origin."""

    def __init__(self, script: list[tuple[int, str]]) -> None:
        self.script = list(script)
        self.origins: Counter[str] = Counter()
        self.proposal: dict[str, int] = {}

    def infer_relative_search_space(self, study: object, trial: object) -> dict:
        return {}

    def sample_relative(self, study: object, trial: object, search_space: object) -> dict:
        x, origin = self.script.pop(0)
        self.proposal = {"x": x}
        self.origins[origin] += 1
        return {}

    def sample_independent(self, study: object, trial: object, name: str, dist: object) -> int:
        return self.proposal[name]


def test_each_trial_is_counted_by_the_origin_of_its_proposal(monkeypatch, capsys) -> None:
    import benchmarks.search_efficiency as se

    script = [(0, "startup"), (0, "model"), (1, "model"), (2, "acquisition"), (3, "random")]
    fakes: list[FakeOriginsSampler] = []
    real = se._sampler

    def fake(name: str, *args: Any) -> optuna.samplers.BaseSampler:
        if name not in se.MODEL_STRATEGIES:
            return real(name, *args)
        fakes.append(FakeOriginsSampler(script))
        return fakes[-1]

    monkeypatch.setattr(se, "_sampler", fake)
    table = tiny_table(4)
    runs = {
        "tpe": [se.run_sampler("tpe", table, SETTINGS, seed=s, budget_s=math.inf) for s in (0, 1)]
    }
    runs["random"] = [se.run_strategy("random", table, SETTINGS, seed=0, budget_s=math.inf)]
    runs["grid"] = [se.run_strategy("grid", table, SETTINGS, seed=0, budget_s=math.inf)]
    runs["one-at-a-time"] = [se.run_strategy("one-at-a-time", table, SETTINGS, 0, math.inf)]
    for run in runs["tpe"]:
        assert run.trials == 5  # the baseline and the 4 points; x=0 again was refused
        assert run.origins == {
            "baseline": 1,
            "startup": 1,
            "model": 1,
            "acquisition": 1,
            "random": 1,
        }
        assert run.refused_held == 1
    assert all(not f.script for f in fakes)  # every proposal asked, none more
    # The strategies without a model: every trial after the baseline is their own draw.
    for name in ("random", "grid", "one-at-a-time"):
        (run,) = runs[name]
        assert run.origins == {"baseline": 1, "own": run.trials - 1}, name
    rows = {r["strategy"]: r for r in se.origin_rows(runs)}
    assert rows["tpe"]["trials"] == 5 and rows["tpe"]["trials_total"] == 10
    assert (rows["tpe"]["refused_held"], rows["tpe"]["refused_held_total"]) == (1, 2)
    assert (rows["tpe"]["model"], rows["tpe"]["model_total"]) == (1, 2)
    assert rows["grid"]["own_total"] == 4 and rows["grid"]["startup_total"] == 0
    se.print_origins(list(rows.values()))
    out = capsys.readouterr().out
    assert (
        "| strategy | trials | model's own | acquisition | random fallback | startup "
        "| the guide's | refused as held |" in out
    )
    assert "| tpe | 5.0 (10) | 1.0 (2) | 1.0 (2) | 1.0 (2) | 1.0 (2) | 0.0 (0) | 1.0 (2) |" in out
    assert "| grid | 5.0 (5) | 4.0 (4) | 0.0 (0) | 0.0 (0) | 0.0 (0) | 0.0 (0) | 0.0 (0) |" in out


# A FAKE table for the guide (made up here): three max-num-seqs, three token budgets, prefix
# caching; the baseline's arguments are the grid point (64, 2048, on), its recorded symptom
# whatever the test says.
GUIDE_GRID = {
    "max-num-seqs": [4, 64, 256],
    "max-num-batched-tokens": [256, 2048, 8192],
    "enable-prefix-caching": [False, True],
}
START = {"max-num-seqs": 64, "max-num-batched-tokens": 2048, "enable-prefix-caching": True}


def fake_guide_table(baseline_symptom: str) -> Table:
    from tests.unit.benchmarks.test_search_table import _entry

    configs = {}
    for seqs, budget, prefix in itertools.product(*GUIDE_GRID.values()):
        params = dict(zip(GUIDE_GRID, (seqs, budget, prefix), strict=True))
        cap = 0.1 * math.log2(seqs) * (1.5 if budget == 256 else 1.0)
        configs[json.dumps(params, sort_keys=True)] = _entry(params, cap, baseline=False)
    configs["base"] = _entry({}, 0.3, baseline=True)
    configs["base"]["args"] = {"max-num-seqs": 64, "max-num-batched-tokens": 2048}
    for entry in configs.values():
        for m in entry["measurements"]:
            m["symptom"] = baseline_symptom if m["baseline"] else "ttft_queue"
    return load_table({"configs": configs})


@pytest.mark.parametrize(
    ("symptom", "param", "value"),
    [
        ("tpot_prefill_interference", "max-num-batched-tokens", 256),  # a smaller budget
        ("ttft_queue", "max-num-batched-tokens", 8192),  # a larger budget
        ("ttft_kv_full", "max-num-seqs", 4),  # fewer sequences (no KV knob on this grid)
    ],
)
def test_guideds_first_trial_moves_one_parameter_from_the_baseline_as_its_symptom_says(
    monkeypatch, symptom: str, param: str, value: Any
) -> None:
    import benchmarks.search_efficiency as se
    from optimizer.guided import MOVE_ATTR, RULES

    studies = spy_studies(monkeypatch)
    table = fake_guide_table(symptom)
    run = se.run_sampler("guided", table, SETTINGS, seed=0, budget_s=math.inf)
    base, first = studies[0].trials[:2]
    assert base.params == {} and base.user_attrs["symptom"] == symptom
    assert {k for k in START if first.params[k] != START[k]} == {param}
    assert first.params[param] == value
    move = first.system_attrs[MOVE_ATTR]
    assert move["symptom"] == symptom and move["from"] == base.number == 0
    rule = next(r for r in RULES if r.symptom == symptom)
    assert param == next(p for p, _how in rule.moves if p in GUIDE_GRID)  # the rule's first
    assert first.user_attrs["symptom"] == "ttft_queue"  # every told trial carries its symptom
    # The guide's proposals are counted as such (the table of origins).
    guided = [t for t in studies[0].trials if t.system_attrs.get(ORIGIN_ATTR) == "guided"]
    assert run.origins["guided"] == len(guided) >= 1
    assert run.origins["baseline"] == 1 and run.trials == len(table.configs)


def test_tpe_guided_takes_its_startup_trials_from_the_guide_and_tpe2_starts_with_two() -> None:
    from benchmarks.search_efficiency import run_sampler

    table = fake_guide_table("tpot_prefill_interference")
    guided = run_sampler("tpe-guided", table, SETTINGS, seed=1, budget_s=math.inf)
    # The guide's first moves, at most 4 of them, stand for TPE's 4 random startup trials.
    assert 1 <= guided.origins["guided"] <= 4
    assert guided.origins["startup"] == 4 - guided.origins["guided"]
    tpe2 = run_sampler("tpe2-racing", table, SETTINGS, seed=1, budget_s=math.inf)
    assert tpe2.origins["startup"] == 2 and tpe2.origins["guided"] == 0
    gp = run_sampler("gp-racing", table, SETTINGS, seed=1, budget_s=math.inf)
    assert gp.origins["startup"] >= 4
    for run in (guided, tpe2, gp):  # racing on: a losing trial is cut short
        assert run.trials == len(table.configs) and run.losing_trial_s


def test_rf_guided_puts_the_guides_moves_ahead_of_the_forest() -> None:
    from benchmarks.search_efficiency import MODEL_STRATEGIES, STRATEGIES, run_sampler

    assert "rf-guided" in STRATEGIES and "rf-guided" in MODEL_STRATEGIES
    table = fake_guide_table("tpot_prefill_interference")
    run = run_sampler("rf-guided", table, SETTINGS, seed=1, budget_s=math.inf)
    # As a job's `sampler: {name: rf, startup: guided}`: the guide's first moves (at most 4)
    # stand for the forest's random startup trials, then the forest proposes.
    assert 1 <= run.origins["guided"] <= 4
    assert run.origins["startup"] == 4 - run.origins["guided"]
    assert run.origins["model"] >= 1
    assert run.trials == len(table.configs) and run.losing_trial_s  # racing on


def test_the_time_to_95_band_and_every_strategy_against_random_racing() -> None:
    from benchmarks.search_efficiency import (
        differences,
        pairs_for,
        quantile,
        replication_rows,
    )
    from benchmarks.search_table import Run

    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == statistics.median([1.0, 2.0, 3.0, 4.0])
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.25) == pytest.approx(1.75)
    assert quantile([1.0, math.inf], 0.5) == math.inf and quantile([1.0, math.inf], 0.0) == 1.0
    table = tiny_table(6)  # truths 2 .. 7 req/s, the best 7: 95 % of it only the best
    full = table.full_grid_s()
    best, other = table.key({"x": 5}), table.key({"x": 0})
    runs = [
        Run(curve=[(0.1 * full * (s + 1), table.truth[best])], curve_keys=[best], seed=s)
        for s in range(3)
    ] + [Run(curve=[(1.0, table.truth[other])], curve_keys=[other], seed=3)]
    (row,) = replication_rows(table, {"a": runs}, {"0-3": [0, 1, 2, 3]})
    assert row["reached_95"] == 3 and row["per_seed"][3]["to_95"] == math.inf
    assert row["to_95"] == pytest.approx(0.25)  # 0.1, 0.2, 0.3, inf: between 0.2 and 0.3
    assert row["to_95_q25"] == pytest.approx(0.175) and row["to_95_q75"] == math.inf
    pairs = pairs_for(["tpe-racing", "random-racing", "guided", "gp-racing", "rf-racing"])
    assert pairs.count(("tpe-racing", "random-racing")) == 1
    assert ("guided", "random-racing") in pairs and ("gp-racing", "random-racing") in pairs
    assert ("random-racing", "random-racing") not in pairs
    # Every model against the default (the forest with racing), the default not against itself.
    assert ("guided", "rf-racing") in pairs and ("tpe-racing", "rf-racing") in pairs
    assert ("rf-racing", "rf-racing") not in pairs
    assert ("random-racing", "rf-racing") not in pairs  # no model: against the reference only
    rows = replication_rows(table, {"guided": runs, "random-racing": runs}, {"0-3": range(4)})
    (d,) = differences(rows, pairs)
    assert d["pair"] == "guided - random-racing" and d["returned_rps"] == 0.0
    assert d["to_95"] == 0.0 and d["to_95_ci"] == 0.0


def test_the_default_strategy_is_the_tuners_default() -> None:
    # Every model strategy is also compared with DEFAULT: it must stay the tuner's own default
    # (sampler.name's default, racing on), or the comparison names the wrong one.
    from benchmarks.search_efficiency import DEFAULT, RACING, STRATEGIES
    from optimizer.config import CapacitySection, SamplerSection

    assert DEFAULT in STRATEGIES and DEFAULT in RACING and CapacitySection().racing
    assert f"{SamplerSection().name}-racing" == DEFAULT


def test_the_time_to_95_is_paired_with_an_unreached_seed_at_the_budget() -> None:
    from benchmarks.search_efficiency import differences, replication_rows
    from benchmarks.search_table import Run

    table = tiny_table(6)
    full = table.full_grid_s()
    best, other = table.key({"x": 5}), table.key({"x": 0})
    # a reaches 95 % of the best at 0.1, 0.2, 0.3 of the grid's time; b at 0.4 and 0.5, and its
    # third seed never (counted as the budget's end: 1.5 grids here).
    a = [
        Run(curve=[(0.1 * full * (s + 1), table.truth[best])], curve_keys=[best], seed=s)
        for s in range(3)
    ]
    b = [
        Run(curve=[(0.1 * full * (s + 4), table.truth[best])], curve_keys=[best], seed=s)
        for s in range(2)
    ]
    b.append(Run(curve=[(1.0, table.truth[other])], curve_keys=[other], seed=2))
    rows = replication_rows(table, {"a": a, "b": b}, {"0-2": range(3)})
    (d,) = differences(rows, [("a", "b")], budget=1.5)
    per = [0.1 - 0.4, 0.2 - 0.5, 0.3 - 1.5]
    assert d["to_95"] == pytest.approx(statistics.fmean(per))
    half = 4.302652729911275 * statistics.stdev(per) / math.sqrt(3)  # t(0.975, 2 df)
    assert d["to_95_ci"] == pytest.approx(half)


def test_a_refused_label_is_told_zero_at_no_cost_and_counted() -> None:
    # As the real driver: an invalid combination starts no server, is told the worst value
    # (capacity 0) and is held, so a model does not propose it again.
    from benchmarks.search_efficiency import origin_rows, run_sampler

    doc = table_doc_with_refused(4)
    table = load_table(doc)
    assert len(table.refused) == 4
    for name in ("random", "tpe-racing"):
        runs = [run_sampler(name, table, SETTINGS, seed, math.inf) for seed in range(3)]
        for run in runs:
            assert run.trials == len(table.configs)  # every measurable point, then the end
            assert set(run.curve_keys) <= set(table.configs)
            if name == "tpe-racing":  # told and held: each refused label proposed once at most
                assert run.refused_invalid <= len(table.refused)
        assert sum(r.refused_invalid for r in runs) > 0, name
        rows = {r["strategy"]: r for r in origin_rows({name: runs})}
        assert rows[name]["refused_invalid_total"] == sum(r.refused_invalid for r in runs)


def test_runs_in_worker_processes_equal_runs_one_at_a_time_and_resume_from_the_folder(
    tmp_path, monkeypatch
) -> None:
    import benchmarks.search_efficiency as se

    table = load_table(synthetic_table())
    budget = table.full_grid_s() / 2
    names = ["tpe-racing", "random-racing", "grid"]
    alone = run_all(table, SETTINGS, names, seeds=3, budget_s=budget)
    cache = se.RunCache(tmp_path / "runs", {"table": "t", "budget_s": budget})
    lines: list[str] = []
    pooled = run_all(table, SETTINGS, names, seeds=3, budget_s=budget, jobs=2, cache=cache)
    for name in names:
        assert [se.run_to_doc(r) for r in pooled[name]] == [se.run_to_doc(r) for r in alone[name]]
    assert len(list((tmp_path / "runs").rglob("seed-*.json"))) == 9

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kept run was run again")

    monkeypatch.setattr(se, "run_strategy", never)
    again = run_all(
        table, SETTINGS, names, seeds=3, budget_s=budget, progress=lines.append, cache=cache
    )
    assert lines == ["9 runs read from " + str(tmp_path / "runs") + ", 0 to run"]
    assert [se.run_to_doc(r) for r in again["grid"]] == [se.run_to_doc(r) for r in alone["grid"]]
    # Another table or budget: the kept runs are not read.
    other = se.RunCache(tmp_path / "runs", {"table": "t", "budget_s": budget * 2})
    with pytest.raises(AssertionError, match="run again"):
        run_all(table, SETTINGS, names, seeds=1, budget_s=budget, cache=other)


def test_trials_are_told_the_drivers_constraints(monkeypatch) -> None:
    # Optuna 5's TPE and GP read a trial's constraints: the driver tells a refused label every
    # SLO violated, a capacity trial its margins (feasible where some scale passed).
    from benchmarks.search_efficiency import run_sampler
    from objectives.presets import FAILED_CONSTRAINT
    from tests.unit.benchmarks.test_search_table import _entry

    doc = table_doc_with_refused(2)
    zero_key, zero = next(iter(doc["configs"].items()))
    doc["configs"][zero_key] = _entry(zero["params"], 0.0, baseline=False)
    table = load_table(doc)
    table.slos = 3
    studies = spy_studies(monkeypatch)
    run_sampler("tpe", table, SETTINGS, seed=0, budget_s=math.inf)
    kinds = Counter()
    for t in studies[0].trials[1:]:  # after the baseline
        if t.user_attrs.get("status") == "rejected":
            kinds["refused"] += 1
            assert t.value == 0.0 and t.constraints == {"slos": 3 * FAILED_CONSTRAINT}
        elif t.state.name == "COMPLETE" and t.value > 0:
            kinds["feasible"] += 1
            assert t.constraints["slos"] <= 0
        elif t.state.name == "COMPLETE":
            kinds["none passed"] += 1
            assert t.constraints["slos"] == pytest.approx(1.0)  # the lowest step's margin
    assert kinds["refused"] >= 1 and kinds["feasible"] >= 8 and kinds["none passed"] == 1


def test_one_at_a_time_starts_from_a_valid_configuration_of_the_third_grid() -> None:
    from benchmarks.search_efficiency import _nearest_default

    assert _nearest_default("enable-chunked-prefill", [False, True]) is True
    assert _nearest_default("max-num-batched-tokens", [256, 1024, 4096]) == 4096
    assert _nearest_default("max-num-batched-tokens", [256, 2048]) == 2048


def test_the_third_tables_job_judges_three_slos() -> None:
    from benchmarks.search_efficiency import DATA_DIR, _job_settings

    assert _job_settings(DATA_DIR / "cpu-capacity-grid-v3.yaml")[1] == 3
