"""RFSampler: SMAC3's random forest driven by Optuna's ask-and-tell loop (optimizer.rf_sampler).

The studies here run on fake objectives through a fake driver (no server): it asks, suggests
every param, refuses a configuration the study has measured (failed, as optimizer.study refuses
a duplicate) and tells the fake's values and constraints.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from optimizer.rf_sampler import (
    RFSampler,
    _configspace,
    _observations,
    _params,
    _penalty,
    _smac_values,
    _told,
)
from optimizer.sampling import ORIGIN_ATTR, _key

optuna.logging.set_verbosity(optuna.logging.ERROR)

Params = dict[str, Any]
Space = dict[str, BaseDistribution]

CUBE: Space = {k: CategoricalDistribution([0, 1, 2]) for k in "abc"}
"""27 configurations."""


def _fake_drive(
    study: optuna.Study,
    space: Space,
    fake_measure: Callable[[Params], float | list[float]],
    trials: int,
    fake_constraint: Callable[[Params], float] | None = None,
) -> list[Params]:
    """The fake driver: ``trials`` proposals (each returned), a measured configuration refused."""
    proposals = []
    for _ in range(trials):
        trial = study.ask(space)
        params = dict(trial.params)
        proposals.append(params)
        measured = {_key(t.params, space) for t in study.get_trials(states=(TrialState.COMPLETE,))}
        if _key(params, space) in measured:
            study.tell(trial, state=TrialState.FAIL)
            continue
        if fake_constraint is not None:
            trial.set_constraint("fake_slo", fake_constraint(params))
        study.tell(trial, fake_measure(params))
    return proposals


def _origins(study: optuna.Study) -> list[str | None]:
    return [t.system_attrs.get(ORIGIN_ATTR) for t in study.trials]


# -- without SMAC --------------------------------------------------------------------------


def test_the_tuner_imports_without_smac() -> None:
    code = (
        "import sys, optimizer.rf_sampler\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('smac', 'ConfigSpace')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_penalty_is_worse_than_every_feasible_cost_and_grows_with_the_violation() -> None:
    feasible = np.array([[1.0, -5.0], [3.0, -2.0]])  # two objectives, minimised scale
    small, large, failed = (_penalty(feasible, v, 2) for v in (0.01, 10.0, float("inf")))
    for p in (small, large, failed):
        assert (p > feasible.max(axis=0)).all()
    assert (small < large).all() and (large < failed).all()
    assert (failed <= feasible.max(axis=0) + 2 * np.ptp(feasible, axis=0)).all()
    # one feasible cost: its size is the span; none: 1 to 2
    assert _penalty(np.array([[4.0]]), float("inf"), 1).tolist() == [12.0]
    assert _penalty(np.empty((0, 1)), 1.0, 1).tolist() == [1.5]


def test_observations_read_constraints_in_both_forms_and_skip_refused_duplicates() -> None:
    space: Space = {"a": CategoricalDistribution(["x", "y", "z"])}
    dist = {"a": space["a"]}
    mk = optuna.trial.create_trial
    study = optuna.create_study(directions=["maximize"])
    study.add_trial(mk(params={"a": "x"}, distributions=dist, value=2.0))
    study.add_trial(mk(params={"a": "x"}, distributions=dist, value=4.0))  # measured twice
    study.add_trial(mk(params={"a": "x"}, distributions=dist, state=TrialState.FAIL))  # refused
    study.add_trial(  # infeasible, Optuna's old list form
        mk(params={"a": "y"}, distributions=dist, value=9.0, system_attrs={"constraints": [0.5]})
    )
    study.add_trial(  # infeasible, set_constraint's form
        mk(params={"a": "z"}, distributions=dist, value=9.0, system_attrs={"constraints:s": 1.0})
    )
    obs = _observations(_told(study.trials, space), space, study.directions)
    assert obs[_key({"a": "x"}, space)] == [-3.0]  # averaged, negated, the refusal left out
    assert -3.0 < obs[_key({"a": "y"}, space)][0] < obs[_key({"a": "z"}, space)][0]


# -- with SMAC -----------------------------------------------------------------------------


def test_every_kind_of_param_goes_to_smac_and_back() -> None:
    from ConfigSpace import Configuration

    space: Space = {
        "cat": CategoricalDistribution([None, True, "fcfs", 2.5]),
        "int": IntDistribution(32, 512),
        "int_log": IntDistribution(1, 1024, log=True),
        "int_step": IntDistribution(16, 256, step=16),
        "float": FloatDistribution(0.0, 1.0),
        "float_log": FloatDistribution(1e-4, 1e-1, log=True),
        "float_step": FloatDistribution(0.5, 0.95, step=0.05),
    }
    cs = _configspace(space)
    rng = optuna.samplers.RandomSampler(seed=0)
    study = optuna.create_study(sampler=rng)
    for _ in range(50):
        params = study.ask(space).params
        key = _key(params, space)
        config = Configuration(cs, values=_smac_values(key, space))  # valid in SMAC's space
        back = _params(dict(config), space)
        assert back["float"] == pytest.approx(params["float"], rel=1e-9)  # SMAC rounds floats
        assert back["float_log"] == pytest.approx(params["float_log"], rel=1e-9)
        exact = [n for n in sorted(space) if n not in ("float", "float_log")]
        assert [_key(back, space)[sorted(space).index(n)] for n in exact] == [
            key[sorted(space).index(n)] for n in exact
        ]
        assert all(space[n]._contains(space[n].to_internal_repr(v)) for n, v in back.items())


def test_it_finds_a_categorical_bowls_optimum_more_often_than_random() -> None:
    space: Space = {k: CategoricalDistribution([0, 1, 2, 3]) for k in "abc"}  # 64
    optimum = {"a": 1, "b": 3, "c": 2}

    def fake_bowl(p: Params) -> float:
        return float(sum((p[k] - optimum[k]) ** 2 for k in space))

    def found(sampler: optuna.samplers.BaseSampler) -> bool:
        study = optuna.create_study(sampler=sampler)
        _fake_drive(study, space, fake_bowl, 25)
        return study.best_value == 0.0

    rf = sum(found(RFSampler(seed=s)) for s in range(5))
    rnd = sum(found(optuna.samplers.RandomSampler(seed=s)) for s in range(5))
    assert rf > rnd, (rf, rnd)


def test_a_warm_starts_priors_are_observations_that_lead_the_first_proposal() -> None:
    space: Space = {k: CategoricalDistribution([0, 1, 2, 3]) for k in "abc"}  # 64
    optimum = {"a": 1, "b": 3, "c": 2}

    def fake_bowl(p: Params) -> float:
        return float(sum((p[k] - optimum[k]) ** 2 for k in space))

    rng = np.random.default_rng(0)
    priors = []
    while len(priors) < 20:  # none near the optimum: 3 or worse
        params = {k: int(rng.integers(4)) for k in space}
        if fake_bowl(params) < 3:
            continue
        prior = optuna.trial.create_trial(
            params=params, distributions=dict(space), value=fake_bowl(params)
        )
        prior.number = -1
        priors.append(prior)
    numbered = optuna.trial.create_trial(params={}, distributions={}, value=0.0)
    numbered.number = 0  # a trial of a study, not a prior
    with pytest.raises(ValueError, match="numbers below zero"):
        RFSampler(priors=[numbered])

    def first(sampler: RFSampler) -> tuple[float, str | None]:
        study = optuna.create_study(sampler=sampler)
        (params,) = _fake_drive(study, space, fake_bowl, 1)
        return fake_bowl(params), _origins(study)[0]

    warm = [first(RFSampler(seed=s, priors=priors)) for s in range(8)]
    cold = [first(RFSampler(seed=s)) for s in range(8)]
    # With 20 priors (past the 4 startup trials) the forest proposes at once, from what they
    # told it, better than every prior on average; without them the first trial is a startup
    # draw (a uniform one's mean on this bowl: 6.5).
    assert [o for _, o in warm] == ["model"] * 8 and [o for _, o in cold] == ["startup"] * 8
    assert np.mean([v for v, _ in warm]) < 3 < np.mean([v for v, _ in cold]), (warm, cold)


def test_the_same_seed_proposes_the_same_configurations() -> None:
    def fake(p: Params) -> float:
        return float(p["a"] + 2 * p["b"] - p["c"])

    runs = []
    for _ in range(2):
        study = optuna.create_study(sampler=RFSampler(seed=3))
        runs.append(_fake_drive(study, CUBE, fake, 8))
    assert runs[0] == runs[1]
    assert _origins(study) == ["startup"] * 4 + ["model"] * 4


def test_a_seed_repeats_in_another_process() -> None:
    """SMAC's local search orders its starting points by string hashes, new in each process
    unless PYTHONHASHSEED is set; the sampler puts them in their own order. (A float param: a
    space that is not listed, so SMAC's local search runs.)"""
    code = (
        "import optuna\n"
        "from optimizer.rf_sampler import RFSampler\n"
        "from optuna.distributions import CategoricalDistribution as C\n"
        "from optuna.distributions import FloatDistribution as F\n"
        "optuna.logging.set_verbosity(optuna.logging.ERROR)\n"
        "space = {**{k: C([0, 1, 2, 3]) for k in 'ab'}, 'c': F(0, 3)}\n"
        "study = optuna.create_study(sampler=RFSampler(seed=1))\n"
        "for _ in range(8):\n"
        "    t = study.ask(space)\n"
        "    study.tell(t, (t.params['a'] - 1) ** 2 + t.params['b'] + 2 * t.params['c'])\n"
        "print([t.params for t in study.trials])\n"
    )
    out = [
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": hashseed},
        ).stdout
        for hashseed in ("1", "2")
    ]
    assert out[0] == out[1]


def test_a_listed_space_is_scored_whole_and_never_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a listed space SMAC's acquisition is evaluated on every configuration (ListedSearch),
    and its local and random search never runs; on a space with a float it does."""
    import smac.facade.hyperparameter_optimization_facade as hpo

    import optimizer.rf_sampler as rf

    scored, searched = [], []
    real_listed, real_search = rf._listed_search, hpo.LocalAndSortedRandomSearch

    def spy_listed(cs: Any, every: list, seed: int) -> Any:
        scored.append(len(every))
        return real_listed(cs, every, seed)

    class SpySearch(real_search):  # type: ignore[misc,valid-type]
        def _maximize(self, *args: Any, **kwargs: Any) -> Any:
            searched.append(1)
            return super()._maximize(*args, **kwargs)

    monkeypatch.setattr(rf, "_listed_search", spy_listed)
    monkeypatch.setattr(hpo, "LocalAndSortedRandomSearch", SpySearch)

    def fake(p: Params) -> float:
        return float(p["a"] + 2 * p["b"] - p["c"])

    sampler = RFSampler(seed=0)
    _fake_drive(optuna.create_study(sampler=sampler), CUBE, fake, 8)
    assert scored == [27] * 4 and searched == [] and sampler.origins["model"] == 4
    mixed: Space = {"a": CategoricalDistribution([0, 1, 2]), "f": FloatDistribution(0, 1)}
    _fake_drive(optuna.create_study(sampler=RFSampler(seed=0)), mixed, lambda p: p["f"], 6)
    assert searched and scored == [27] * 4


def test_a_resumed_study_proposes_no_held_configuration() -> None:
    """A new process: a fresh sampler (same seed, so Optuna's random draws repeat) on the
    stored study, during the startup and after, one trial of the first driver still running."""

    def fake(p: Params) -> float:
        return float((p["a"] - 1) ** 2 + p["b"] + p["c"])

    storage = optuna.storages.InMemoryStorage()
    first = optuna.create_study(storage=storage, study_name="s", sampler=RFSampler(seed=0))
    _fake_drive(first, CUBE, fake, 2)
    running = first.ask(CUBE)  # never told
    sampler = RFSampler(seed=0)
    resumed = optuna.load_study(study_name="s", storage=storage, sampler=sampler)
    proposals = _fake_drive(resumed, CUBE, fake, 14)
    keys = [_key(p, CUBE) for p in [*(t.params for t in first.trials[:2]), running.params]]
    for p in proposals:
        assert _key(p, CUBE) not in keys
        keys.append(_key(p, CUBE))
    assert sampler.origins == {"startup": 2, "model": 12}


def test_the_constrained_optimum_is_found_though_infeasible_values_are_better() -> None:
    """Better the larger a, but a >= 4 breaks the SLO (a third of the space): the penalty keeps
    the infeasible region's better values from leading SMAC, which finds a = 3 at b = 5.

    Not asserted, because it does not hold: that SMAC then keeps out of the infeasible region.
    With the penalty its forest's expected improvement still proposes there about as often as
    random draws do (measured with SMAC's local and random search: 37 of 120 proposals after
    the region was seen, 6 seeds)."""
    space: Space = {"a": CategoricalDistribution(list(range(6))), "b": IntDistribution(0, 10)}

    def fake_latency(p: Params) -> float:
        return float(10 - p["a"] + abs(p["b"] - 5) / 5)

    def fake_slo(p: Params) -> float:
        return float(p["a"] - 3.5)  # > 0: violated

    study = optuna.create_study(sampler=RFSampler(seed=1))
    proposals = _fake_drive(study, space, fake_latency, 20, fake_slo)
    assert any(fake_slo(p) > 0 for p in proposals)
    assert study.best_trials[0].params == {"a": 3, "b": 5}  # best_trials: the feasible ones


def test_two_objectives_run_by_parego() -> None:
    space: Space = {"a": CategoricalDistribution([1, 2, 4, 8]), "b": FloatDistribution(0, 1)}

    def fake(p: Params) -> list[float]:
        return [p["a"] * (1 + p["b"]), p["a"] - p["b"]]  # latency (min), throughput (max)

    sampler = RFSampler(seed=0)
    study = optuna.create_study(directions=["minimize", "maximize"], sampler=sampler)
    _fake_drive(study, space, fake, 15)
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 15
    assert sampler.origins == {"startup": 4, "model": 11}
    assert study.best_trials


def test_an_exhausted_space_ends_with_every_configuration_measured_once() -> None:
    def fake(p: Params) -> float:
        return float(p["a"] * 9 + p["b"] * 3 + p["c"])

    sampler = RFSampler(seed=0)
    study = optuna.create_study(sampler=sampler)
    proposals = _fake_drive(study, CUBE, fake, 30)
    assert len({_key(p, CUBE) for p in proposals[:27]}) == 27  # no proposal held
    measured = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(measured) == 27
    assert sum(sampler.origins.values()) == 30


def test_smac_leaves_no_files_and_the_logging_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = logging.getLogger()
    before = (root.level, list(root.handlers))

    def fake(p: Params) -> float:
        return float(p["a"])

    study = optuna.create_study(sampler=RFSampler(seed=0, n_startup_trials=2))
    study.enqueue_trial({"a": 2, "b": 0, "c": 1})
    _fake_drive(study, CUBE, fake, 4)
    assert list(tmp_path.iterdir()) == []
    assert (root.level, list(root.handlers)) == before
    assert study.trials[0].params == {"a": 2, "b": 0, "c": 1}
    assert _origins(study) == ["enqueued", "startup", "model", "model"]
