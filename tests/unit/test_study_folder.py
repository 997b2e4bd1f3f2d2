"""A study folder is self-contained: copied or moved, `show` and `export` read the copy's own
storage (a real Optuna SQLite study run by a FAKE runner), never another study at the old path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from optimizer import cli
from optimizer.config import load_job
from optimizer.study import prepare
from optimizer.study_driver import StudyDriver
from optimizer.study_folder import resolve_url, storage_url_of
from tests.unit.test_study_loop import FakeRunner
from tests.unit.test_study_loop import _job as fake_job


def _study(tmp_path: Path, out: Path, trials: int) -> Path:
    doc: dict[str, Any] = {
        **fake_job(tmp_path),
        "out": str(out),
        "trials": trials,
        "mlflow": {"enabled": False},
    }
    job, base = load_job(doc, base=tmp_path)
    plan = prepare(job, base, check_flags=False)
    StudyDriver(plan, FakeRunner(), heartbeat_interval_s=1, grace_period_s=2).run()
    return plan.out


def _show_json(folder: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert cli.main(["show", str(folder), "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_plan_json_records_no_absolute_path_of_the_folder(tmp_path: Path) -> None:
    out = _study(tmp_path, tmp_path / "a" / "study", trials=2)
    text = (out / "plan.json").read_text()
    assert str(out) not in text
    plan = json.loads(text)
    assert plan["storage"] == "study.db" and plan["job"]["out"] == "."


def test_a_copied_folder_reads_its_own_study_not_the_one_at_the_old_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = _study(tmp_path, tmp_path / "a" / "study", trials=2)
    copy = tmp_path / "b" / "copy"
    shutil.copytree(original, copy)
    # The original grows afterwards: a copy that read the old path would see 4 trials.
    shutil.rmtree(original)
    _study(tmp_path, original, trials=4)
    doc = _show_json(copy, capsys)
    assert len(doc["trials"]) == 2
    assert len(_show_json(original, capsys)["trials"]) == 4
    # Moved away with nothing left at the old path: still works, console form too.
    moved = tmp_path / "c" / "moved"
    shutil.move(str(copy), moved)
    assert cli.main(["show", str(moved)]) == 0
    capsys.readouterr()
    # Export (no re-validation) writes into the moved folder.
    assert cli.main(["export", str(moved), "--format", "vllm-config", "--no-validate"]) == 0
    assert (moved / "export").is_dir() and not (original / "export").exists()


def test_folders_written_with_absolute_paths_are_read_where_they_are_now(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = _study(tmp_path, tmp_path / "a" / "study", trials=2)
    plan = json.loads((original / "plan.json").read_text())
    plan["storage"] = f"sqlite:///{original / 'study.db'}"
    plan["job"]["out"] = str(original)
    (original / "plan.json").write_text(json.dumps(plan))  # as earlier versions wrote it
    copy = tmp_path / "b" / "copy"
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    _study(tmp_path, original, trials=3)
    assert storage_url_of(plan, copy) == f"sqlite:///{(copy / 'study.db').resolve()}"
    assert len(_show_json(copy, capsys)["trials"]) == 2


def test_a_folder_without_its_storage_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = _study(tmp_path, tmp_path / "a" / "study", trials=1)
    (original / "study.db").unlink()
    assert cli.main(["show", str(original)]) == 2
    err = capsys.readouterr().err
    assert "study.db is missing" in err and "Traceback" not in err
    assert not (original / "study.db").exists()  # nothing created by looking


def test_storage_outside_the_folder_is_kept_as_given(tmp_path: Path) -> None:
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    assert resolve_url(shared, tmp_path / "x", str(tmp_path / "old")) == shared
    assert resolve_url("postgresql://u@h/db", tmp_path) == "postgresql://u@h/db"


@pytest.mark.parametrize(
    "change",
    [
        {"trace": {"path": "missing.csv"}},
        {"trace": {"path": "bad.csv"}},
        {"objectives": {"preset": "default", "slos": ["p95_tfft_ms<=400"]}},
    ],
    ids=["missing trace", "bad row", "SLO typo"],
)
def test_a_failed_start_leaves_no_study_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any]
) -> None:
    import yaml

    (tmp_path / "bad.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,not-a-number,12\n"
    )
    doc = {**fake_job(tmp_path), "out": "runs/new-study", "mlflow": {"enabled": False}}
    for key, value in change.items():
        doc[key] = {**doc[key], **value}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    assert cli.main(["tune", str(tmp_path / "job.yaml"), "--runner", "local"]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "new-study").exists()
    assert not (tmp_path / "runs").exists()
