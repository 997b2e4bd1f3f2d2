"""KnowledgeSampler: TPE and GP learn from the trials that chose a configuration (not the
param-less baseline) and from a warm start's prior trials (optimizer.sampling)."""

from __future__ import annotations

import warnings
from typing import Any

import optuna
import pytest
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial

from optimizer.sampling import KnowledgeSampler

optuna.logging.set_verbosity(optuna.logging.ERROR)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

SEQS = [8, 16, 32, 64, 128, 256, 512, 1024]


def _measure(seqs: int) -> float:
    """A stand-in objective (no server): best at max-num-seqs 64."""
    return -abs(SEQS.index(seqs) - SEQS.index(64))


def _with_baseline(sampler: optuna.samplers.BaseSampler, trials: int) -> optuna.Study:
    """A study as the driver runs one: the baseline first (enqueued, no params), then trials
    that suggest x and y."""
    study = optuna.create_study(sampler=sampler, direction="maximize")
    study.enqueue_trial({})
    base = study.ask()
    study.tell(base, 0.0)
    for _ in range(trials):
        t = study.ask()
        x = t.suggest_float("x", 0.0, 1.0)
        t.suggest_categorical("y", [1, 2, 3])
        study.tell(t, -((x - 0.3) ** 2))
    return study


def test_gp_learns_after_a_param_less_baseline() -> None:
    # Optuna's GP intersects the search spaces of all finished trials: the baseline's empty one
    # makes every later proposal a uniform random draw (this is what the wrapper is for).
    plain = _with_baseline(optuna.samplers.GPSampler(seed=1, n_startup_trials=3), 6)
    nxt = plain.ask()
    assert plain.sampler.infer_relative_search_space(plain, plain.trials[-1]) == {}
    plain.tell(nxt, state=optuna.trial.TrialState.FAIL)

    wrapped = _with_baseline(
        KnowledgeSampler(optuna.samplers.GPSampler(seed=1, n_startup_trials=3)), 6
    )
    t = wrapped.ask()
    space = wrapped.sampler.infer_relative_search_space(wrapped, wrapped.trials[-1])
    assert set(space) == {"x", "y"}
    # The proposal came from the GP model (Optuna records its relative params), with priors too.
    t.suggest_float("x", 0.0, 1.0)
    attrs = wrapped.trials[-1].system_attrs
    assert any(k.startswith("gp:relative_params") for k in attrs), attrs
    prior = optuna.trial.create_trial(
        params={"x": 0.3, "y": 2},
        distributions={
            "x": FloatDistribution(0.0, 1.0),
            "y": CategoricalDistribution([1, 2, 3]),
        },
        value=0.0,
    )
    prior.number = -1
    # Two own trials and one prior reach GP's 3 startup trials; two own trials alone do not.
    for priors, modelled in (([prior], True), ([], False)):
        study = _with_baseline(
            KnowledgeSampler(optuna.samplers.GPSampler(seed=1, n_startup_trials=3), priors), 2
        )
        t = study.ask()
        t.suggest_float("x", 0.0, 1.0)
        attrs = study.trials[-1].system_attrs
        assert any(k.startswith("gp:relative_params") for k in attrs) is modelled


def _priors(best: int, count: int) -> list[FrozenTrial]:
    """Told trials of an earlier study: every choice measured, ``best`` the best."""
    dist: dict[str, BaseDistribution] = {"max-num-seqs": CategoricalDistribution(SEQS)}
    out = []
    for i in range(count):
        seqs = SEQS[i % len(SEQS)]
        t = optuna.trial.create_trial(
            params={"max-num-seqs": seqs},
            distributions=dist,
            value=-abs(SEQS.index(seqs) - SEQS.index(best)),
        )
        t.number = -1  # as warm_start numbers every prior
        out.append(t)
    return out


def _first_proposals(sampler: optuna.samplers.BaseSampler, n: int) -> list[int]:
    study = optuna.create_study(sampler=sampler, direction="maximize")
    study.enqueue_trial({})
    study.tell(study.ask(), 0.0)  # the baseline
    seen = []
    for _ in range(n):
        t = study.ask()
        seqs = t.suggest_categorical("max-num-seqs", SEQS)
        seen.append(seqs)
        study.tell(t, _measure(seqs))
    return seen


def _tpe(seed: int) -> optuna.samplers.TPESampler:
    return optuna.samplers.TPESampler(
        seed=seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=4
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prior_trials_steer_tpe_from_its_first_proposal(seed: int) -> None:
    # Without priors the first 4 proposals are TPE's random startup (these seeds: 1024, 16,
    # 1024 first); with 16 prior trials that found 64 best, the startup is over and the first
    # proposal is where the priors point; priors that found 8 best send it to 8.
    assert _first_proposals(KnowledgeSampler(_tpe(seed), _priors(64, 16)), 1) == [64]
    assert _first_proposals(KnowledgeSampler(_tpe(seed), _priors(8, 16)), 1) == [8]
    assert _first_proposals(KnowledgeSampler(_tpe(seed)), 1)[0] not in (8, 64)


def test_the_study_holds_no_prior_trial() -> None:
    sampler = KnowledgeSampler(_tpe(0), _priors(64, 8))
    study = optuna.create_study(sampler=sampler, direction="maximize")
    for _ in range(3):
        t = study.ask()
        study.tell(t, _measure(t.suggest_categorical("max-num-seqs", SEQS)))
    assert [t.number for t in study.get_trials()] == [0, 1, 2]
    assert len(sampler._view(study).get_trials()) == 8 + 3


def test_prior_trials_must_be_numbered_below_zero() -> None:
    bad = _priors(64, 2)
    bad[1].number = 0  # would meet this study's first trial
    with pytest.raises(ValueError, match="below zero"):
        KnowledgeSampler(_tpe(0), bad)


GRID = {"a": [4, 16, 64], "b": [256, 512, 2048], "c": [True, False], "d": [1, 2]}


def _grid_study(sampler: optuna.samplers.BaseSampler, n: int) -> list[tuple[Any, ...]]:
    """n proposals on a 36-point grid with one sharp optimum; a repeat is refused as the driver
    refuses a duplicate (told failed: the sampler does not learn from it)."""
    study = optuna.create_study(sampler=sampler, direction="maximize")
    seen: list[tuple[Any, ...]] = []
    for _ in range(n):
        t = study.ask()
        point = tuple(t.suggest_categorical(k, v) for k, v in GRID.items())
        if point in seen:
            study.tell(t, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(t, 10.0 if point == (64, 512, True, 2) else -GRID["a"].index(point[0]))
        seen.append(point)
    return seen


def test_tpe_never_proposes_a_held_configuration_while_one_is_free() -> None:
    plain = _grid_study(_tpe(0), 36)
    assert len(set(plain)) < 30  # TPE converges and proposes its best again (the stall)
    sampler = KnowledgeSampler(_tpe(0), seed=0)
    wrapped = _grid_study(sampler, 36)
    assert len(set(wrapped)) == 36  # every grid point, none twice
    assert sampler.replaced > 0


def _xy_prior(x: float, y: int) -> FrozenTrial:
    t = optuna.trial.create_trial(
        params={"x": x, "y": y},
        distributions={"x": FloatDistribution(0.0, 1.0), "y": CategoricalDistribution([1, 2, 3])},
        value=-((x - 0.3) ** 2),
        constraints={"0": -1.0},
    )
    t.number = -1
    return t


def test_gp_sees_every_prior_in_its_search_space() -> None:
    # Optuna's intersection search space scans back from the newest trial and stops at the
    # first number below its cursor (-1): priors numbered -2, -3 would end the scan at once.
    priors = [_xy_prior(0.1 * i, 1 + i % 3) for i in range(3)]
    study = _with_baseline(
        KnowledgeSampler(optuna.samplers.GPSampler(seed=1, n_startup_trials=1), priors), 0
    )
    t = study.ask()
    space = study.sampler.infer_relative_search_space(study, study.trials[-1])
    assert set(space) == {"x", "y"}
    t.suggest_float("x", 0.0, 1.0)
    assert any(k.startswith("gp:relative_params") for k in study.trials[-1].system_attrs)


def test_gp_with_priors_and_constrained_trials_proposes() -> None:
    # Every trial of a study is told constraints (its SLO margins); priors carry theirs too, or
    # GP refuses the mix ("The number of constraints must be the same for all trials").
    sampler = KnowledgeSampler(
        optuna.samplers.GPSampler(seed=1, n_startup_trials=2), [_xy_prior(0.2, 1)]
    )
    study = optuna.create_study(sampler=sampler, direction="maximize")
    for _ in range(3):
        t = study.ask()
        x = t.suggest_float("x", 0.0, 1.0)
        t.suggest_categorical("y", [1, 2, 3])
        study._storage.set_trial_system_attr(t._trial_id, "constraints", [-1.0])
        study.tell(t, -((x - 0.3) ** 2))


def test_a_stepped_float_is_one_point_whatever_its_last_digit() -> None:
    from optimizer.sampling import _key, _values

    space = {"u": FloatDistribution(0.8, 0.95, step=0.01)}
    assert _key({"u": 0.86}, space) == _key({"u": 0.8 + 6 * 0.01}, space)
    values = _values(space["u"])
    assert values is not None and len(values) == 16 and max(values) <= 0.95


def test_free_draws_keep_a_log_scale() -> None:
    from optimizer.sampling import _key

    space: dict[str, BaseDistribution] = {"n": IntDistribution(1, 1024, log=True)}
    sampler = KnowledgeSampler(_tpe(0), seed=0)
    study = optuna.create_study()
    trial = study.ask()
    held = {_key({"n": 512}, space)}
    draws = [sampler._free(study, study.trials[-1], space, held) for _ in range(400)]
    assert all(d is not None and d["n"] != 512 for d in draws)
    small = sum(1 for d in draws if d is not None and d["n"] <= 32) / len(draws)
    assert small > 0.35, small  # log-uniform: about half; uniform over the integers: 3 %
    study.tell(trial, 0.0)


BOWL = {"a": list(range(8)), "b": list(range(8)), "c": [0, 1]}


def _bowl(point: dict[str, Any]) -> float:
    """A stand-in objective (no server) with one optimum, (a, b, c) = (5, 2, 1), and a smooth
    slope towards it: a model can tell near from far."""
    return -(abs(point["a"] - 5) + abs(point["b"] - 2) + 3 * (1 - point["c"]))


def _bowl_study(sampler: KnowledgeSampler, n: int) -> list[float]:
    """n trials on the 128-point bowl (a repeated configuration cannot reach the driver: the
    wrapper never returns one while a free one is left); the told values in order."""
    study = optuna.create_study(sampler=sampler, direction="maximize")
    values = []
    for _ in range(n):
        t = study.ask()
        point = {k: t.suggest_categorical(k, v) for k, v in BOWL.items()}
        values.append(_bowl(point))
        study.tell(t, values[-1])
    return values


def _late_mean(sampler: KnowledgeSampler, n: int = 30) -> float:
    values = _bowl_study(sampler, n)
    return sum(values[10:]) / len(values[10:])


def test_tpe_replaces_a_held_proposal_by_its_best_free_configuration() -> None:
    # TPE converges on the bowl and re-proposes held points again and again. Its replacement
    # must be TPE's own choice among the free points (its acquisition), not a uniform random
    # draw: the same TPE wrapped without a model's scoring (a plain TPESampler: random free
    # draws in place of held proposals, as before) lands further from the optimum. Seeded:
    # deterministic. (A uniform draw's mean value on this bowl is -7.0.)
    from optimizer.sampling import model_sampler

    scored, drawn, acquired = [], [], 0
    for seed in range(8):
        sampler = model_sampler("tpe", seed, 4)
        scored.append(_late_mean(sampler))
        assert sampler.origins["random"] == 0 and sampler.origins["startup"] == 4
        assert sum(sampler.origins.values()) == 30
        acquired += sampler.origins["acquisition"]
        fallback = KnowledgeSampler(_tpe(seed), seed=seed)
        drawn.append(_late_mean(fallback))
        assert fallback.origins["acquisition"] == 0
    assert acquired > 50, acquired  # most late proposals re-proposed a held point
    mean_scored, mean_drawn = sum(scored) / 8, sum(drawn) / 8
    assert mean_scored > mean_drawn + 0.5, (mean_scored, mean_drawn)


def test_gp_proposes_its_best_free_configuration_on_a_listed_space() -> None:
    from optimizer.sampling import model_sampler

    sampler = model_sampler("gp", 0, 4)
    late = _late_mean(sampler, 24)
    assert sampler.origins["random"] == 0 and sampler.origins["startup"] == 4
    assert sampler.origins["model"] + sampler.origins["acquisition"] == 20
    assert late > -5.0, late  # uniform draws: -7


def test_gp_ranks_every_configuration_of_a_listed_space_instead_of_searching_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a listed space the GP's acquisition is evaluated on each configuration (exact, one
    # fit): Optuna's own search of the space (GPSampler._optimize_acqf) is never run. On a
    # continuous space it is.
    from optimizer.sampling import model_sampler

    searched = []
    real = optuna.samplers.GPSampler._optimize_acqf

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        searched.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(optuna.samplers.GPSampler, "_optimize_acqf", spy)
    sampler = model_sampler("gp", 0, 4)
    _bowl_study(sampler, 8)
    assert searched == [] and sampler.origins["startup"] == 4
    _with_baseline(model_sampler("gp", 0, 4), 6)  # x is a float: not listed
    assert searched, "the continuous space was not searched by Optuna"


class _FakeRanker(optuna.samplers.RandomSampler):
    """A fake model (no GP): ranks the candidates by a fixed order of ``a``, its own
    proposal always a = 0."""

    relative_key = "gp:relative_params"

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return {"a": CategoricalDistribution([2, 0, 1, 3])}

    def rank(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        space: dict[str, BaseDistribution],
        candidates: list[dict[str, Any]],
    ) -> list[dict[str, Any]] | None:
        return sorted(candidates, key=lambda c: c["a"])


def test_a_ranked_proposal_held_is_replaced_by_the_next_free_one_in_the_models_order() -> None:
    from optimizer.sampling import ORIGIN_ATTR

    sampler = KnowledgeSampler(_FakeRanker(seed=0), seed=0)
    study = optuna.create_study(sampler=sampler, direction="maximize")
    proposals = []
    for _ in range(3):
        t = study.ask()
        proposals.append(t.suggest_categorical("a", [2, 0, 1, 3]))
        study.tell(t, 0.0)
    assert proposals == [0, 1, 2]  # the first is the model's; then its best free ones
    origins = [t.system_attrs[ORIGIN_ATTR] for t in study.trials]
    assert origins == ["model", "acquisition", "acquisition"]
    assert study.trials[2].system_attrs["gp:relative_params:0"] == '{"a": 2}'


def test_the_relative_proposal_keys_are_optunas() -> None:
    # Parallel workers read a running trial's configuration under these keys: a renamed key
    # in a new Optuna would leave them reading the held configuration first proposed.
    from optuna.samplers._gp.sampler import _RELATIVE_PARAMS_KEY as GP
    from optuna.samplers._tpe.sampler import _RELATIVE_PARAMS_KEY as TPE

    from optimizer.sampling import _GP_KEY, _TPE_KEY

    assert (_TPE_KEY, _GP_KEY) == (TPE, GP)


def test_each_trial_records_where_its_configuration_came_from() -> None:
    from optimizer.sampling import ORIGIN_ATTR, ORIGINS, model_sampler

    sampler = model_sampler("tpe", 0, 4)
    study = optuna.create_study(sampler=sampler, direction="maximize")
    study.enqueue_trial({"a": 5, "b": 2, "c": 1})
    for _ in range(12):
        t = study.ask()
        point = {k: t.suggest_categorical(k, v) for k, v in BOWL.items()}
        study.tell(t, _bowl(point))
    origins = [t.system_attrs[ORIGIN_ATTR] for t in study.get_trials()]
    assert origins[0] == "enqueued" and set(origins) <= set(ORIGINS)
    assert origins.count("startup") == 4 - 1  # the enqueued trial counts toward TPE's startup
    assert sum(sampler.origins.values()) == 12
