"""The tuning guide's diagnosis as proposals (optimizer.guided): the rules read a trial's
symptom, every proposal is one parameter from the incumbent, an improving move is repeated,
the guide hands over to its fallback when it is done. Studies here are told made-up values
(no server): FAKE measurements, named as such."""

from __future__ import annotations

import json
import warnings
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial

from optimizer.guided import MOVE_ATTR, RULES, SYMPTOMS, GuidedSampler, guide_proposal, symptom_of
from optimizer.sampling import ORIGIN_ATTR, model_sampler

optuna.logging.set_verbosity(optuna.logging.ERROR)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

SPACE = {
    "max-num-seqs": CategoricalDistribution([4, 16, 64, 256]),
    "max-num-batched-tokens": CategoricalDistribution([256, 1024, 4096]),
    "enable-prefix-caching": CategoricalDistribution([True, False]),
    "kv-cache-memory-bytes": CategoricalDistribution([2**24, 2**26, 2**28]),
}
BASELINE_ARGS = {"max-num-seqs": 128, "max-num-batched-tokens": 2048, "max-model-len": 2048}


def _capacity_trial(value: float, broke_first: str | None, **attrs: Any) -> FrozenTrial:
    """A FAKE measured capacity trial: the user attrs TrialView reads."""
    capacity = {"rps": value, "scale": value, "broke_first": broke_first, "steps": []}
    return optuna.trial.create_trial(
        value=value,
        user_attrs={
            "status": "complete",
            "capacity": capacity,
            "summary": attrs.get("summary", {"completed": 100}),
            "server_metrics": attrs.get("server_metrics", {}),
            "memory": attrs.get("memory", {}),
            "engine_args": json.dumps(attrs.get("engine_args", BASELINE_ARGS)),
        },
    )


def test_every_rule_names_its_symptom_and_reads_it() -> None:
    assert len(set(SYMPTOMS)) == len(RULES) == 3
    assert all(r.reads and r.moves for r in RULES)
    tpot = _capacity_trial(5.0, "p95_tpot_ms<=150")
    assert symptom_of(tpot) == "tpot_prefill_interference"
    queue = _capacity_trial(5.0, "p95_ttft_ms<=2000")
    assert symptom_of(queue) == "ttft_queue"
    preempted = _capacity_trial(
        5.0, "p95_ttft_ms<=2000", server_metrics={"vllm:num_preemptions_total": 12.0}
    )
    assert symptom_of(preempted) == "ttft_kv_full"
    assert symptom_of(_capacity_trial(64.0, None)) is None  # nothing broke at any load tried


@pytest.mark.parametrize(
    ("broke", "metrics", "param", "value"),
    [
        ("p95_tpot_ms<=150", {}, "max-num-batched-tokens", 256),
        ("p95_ttft_ms<=2000", {}, "max-num-batched-tokens", 4096),
        ("p95_ttft_ms<=2000", {"vllm:num_preemptions_total": 3.0}, "kv-cache-memory-bytes", None),
    ],
)
def test_the_first_move_from_the_baseline_follows_its_symptom(
    broke: str, metrics: dict[str, float], param: str, value: Any
) -> None:
    base = _capacity_trial(5.0, broke, server_metrics=metrics)
    base.number = 0
    found = guide_proposal([base], SPACE, optuna.study.StudyDirection.MAXIMIZE)
    assert found is not None
    config, move = found
    assert move["param"] == param and move["from"] == 0
    start = {
        "max-num-seqs": 64,
        "max-num-batched-tokens": 1024,
        "enable-prefix-caching": True,
        "kv-cache-memory-bytes": 2**26,
    }  # the baseline's nearest point (2048 -> 1024 or 4096, 128 -> 64 or 256: the lower on a
    # tie; the KV cache, which its arguments leave out: the middle choice)
    changed = {k for k in config if config[k] != start[k]}
    assert changed == {param}
    assert config[param] == (value if value is not None else 2**28)


def _guided_study(sampler: GuidedSampler, values: dict[str, Any], n: int) -> optuna.Study:
    """A study as the driver runs one: the FAKE baseline first (param-less, its engine
    arguments recorded), then n trials told FAKE capacities from ``values``."""
    study = optuna.create_study(sampler=sampler, direction="maximize")
    study.add_trial(_capacity_trial(values["baseline"], "p95_tpot_ms<=150"))
    for _ in range(n):
        t = study.ask()
        point = {k: t.suggest_categorical(k, list(d.choices)) for k, d in SPACE.items()}
        value, broke = values["score"](point)
        for k, v in {
            "status": "complete",
            "capacity": {"rps": value, "scale": value, "broke_first": broke, "steps": []},
            "summary": {"completed": 100},
        }.items():
            t.set_user_attr(k, v)
        study.tell(t, value)
    return study


def _score(point: dict[str, Any]) -> tuple[float, str]:
    """FAKE capacities: the token budget's TPOT cliff, then more KV helps; TPOT breaks first
    until the budget is 256, TTFT after."""
    budget = point["max-num-batched-tokens"]
    value = 10.0 - {256: 0, 1024: 3, 4096: 6}[budget]
    value += {2**24: 0.0, 2**26: 1.0, 2**28: 2.0}[point["kv-cache-memory-bytes"]]
    return value, ("p95_tpot_ms<=150" if budget > 256 else "p95_ttft_ms<=2000")


def test_guided_trials_move_one_parameter_from_the_incumbent_and_repeat_what_worked() -> None:
    sampler = GuidedSampler(SPACE, model_sampler("tpe", 0, 4))
    study = _guided_study(sampler, {"baseline": 5.0, "score": _score}, 4)
    trials = study.get_trials()
    moves = [t.system_attrs[MOVE_ATTR] for t in trials[1:]]
    assert all(t.system_attrs[ORIGIN_ATTR] == "guided" for t in trials[1:])
    # TPOT broke at the baseline: the budget goes down (1024 -> 256), then, at 256, TTFT
    # breaks with KV to spare... the guide's next moves come from the new incumbent.
    assert moves[0]["param"] == "max-num-batched-tokens" and moves[0]["to"] == 256
    for t, move in zip(trials[1:], moves, strict=True):
        parent = trials[move["from"]]
        if parent.params:
            assert sum(parent.params[k] != t.params[k] for k in SPACE) == 1
    assert len({json.dumps(t.params, sort_keys=True) for t in trials[1:]}) == 4


def test_the_guide_hands_over_to_its_fallback_when_capped() -> None:
    fallback = model_sampler("tpe", 0, 2)
    sampler = GuidedSampler(SPACE, fallback, max_guided=2)
    study = _guided_study(sampler, {"baseline": 5.0, "score": _score}, 8)
    origins = [t.system_attrs.get(ORIGIN_ATTR) for t in study.get_trials()[1:]]
    assert origins[:2] == ["guided", "guided"]
    assert "guided" not in origins[2:] and sampler.guided == 2
    assert len({json.dumps(t.params, sort_keys=True) for t in study.get_trials()[1:]}) == 8


def test_the_baselines_nearest_point_is_not_held() -> None:
    # vLLM's defaults (128 sequences, a 2048 budget) are off this grid: the point nearest them
    # was never measured, so a move may land on it (here: the budget back up from 256).
    base = _capacity_trial(5.0, "p95_tpot_ms<=150")
    base.number = 0
    first = optuna.trial.create_trial(
        params={
            "max-num-seqs": 64,
            "max-num-batched-tokens": 256,
            "enable-prefix-caching": True,
            "kv-cache-memory-bytes": 2**26,
        },
        distributions=dict(SPACE),
        value=6.0,  # the incumbent: the moves start from it
        user_attrs={"status": "complete"},
    )
    first.number = 1
    trials = [base, first]
    seen = set()
    for _ in range(12):
        found = guide_proposal(trials, SPACE, optuna.study.StudyDirection.MAXIMIZE)
        if found is None:
            break
        config, _ = found
        seen.add(json.dumps(config, sort_keys=True))
        t = optuna.trial.create_trial(
            params=config, distributions=dict(SPACE), value=1.0, user_attrs={"status": "complete"}
        )
        t.number = len(trials)
        trials.append(t)
    start = {
        "max-num-seqs": 64,
        "max-num-batched-tokens": 1024,
        "enable-prefix-caching": True,
        "kv-cache-memory-bytes": 2**26,
    }
    assert json.dumps(start, sort_keys=True) in seen
