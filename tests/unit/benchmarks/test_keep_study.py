"""benchmarks.keep_study: a study's record copied with the machine's paths out (a real Optuna
SQLite study)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna

from benchmarks.keep_study import keep


def test_the_kept_record_holds_every_trial_and_no_path_of_the_machine(tmp_path: Path) -> None:
    repo, out = tmp_path / "checkout", tmp_path / "runs" / "r1"
    out.mkdir(parents=True)
    study = optuna.create_study(storage=f"sqlite:///{out / 'study.db'}", study_name="s")
    for i in range(3):
        trial = study.ask()
        trial.set_user_attr("log", f"{out}/trials/000{i}/engine.log")
        trial.set_user_attr("model", f"{repo}/.cache/models/small")
        study.tell(trial, float(i))
    plan = {"job": {"out": str(out), "model": {"path": f"{repo}/.cache/models/small"}}}
    (out / "plan.json").write_text(json.dumps(plan))

    trials, changed = keep(out, tmp_path / "kept", [str(repo)])

    assert (trials, changed) == (3, 6)
    for name in ("plan.json", "study.db"):
        data = (tmp_path / "kept" / name).read_bytes()
        assert str(tmp_path).encode() not in data
    kept = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'kept' / 'study.db'}")
    assert [t.user_attrs["log"] for t in kept.trials][1] == "<out>/trials/0001/engine.log"
    assert kept.trials[2].user_attrs["model"] == "<repo>/.cache/models/small"
    assert json.loads((tmp_path / "kept" / "plan.json").read_text())["job"]["out"] == "<out>"
