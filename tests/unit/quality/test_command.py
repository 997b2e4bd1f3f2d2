"""``vllm-autotune quality`` on a study folder made by a real study loop with a FAKE runner (no
server); the check itself is faked where a test says so (its servers are in
tests/integration/test_quality_vllm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from optimizer import cli, study
from optimizer.quality import stage
from optimizer.quality.check import Verdict
from optimizer.trial_view import quality_verdicts
from tests.unit.test_study_folder import _study


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    real = study.prepare
    monkeypatch.setattr(study, "prepare", lambda job, base: real(job, base, check_flags=False))
    return _study(tmp_path, tmp_path / "study", trials=3)


def _verdicts(out: Path) -> dict[int, dict[str, Any]]:
    from optimizer.cli_support import load_study_dir

    return quality_verdicts(load_study_dir(out)[1])


def test_the_front_is_checked_once_and_unchanged_members_start_no_server(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["quality", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "unchanged" in out and "Quality gate" in out
    verdicts = _verdicts(folder)
    assert verdicts and {v["status"] for v in verdicts.values()} == {"unchanged"}
    assert not (folder / "quality" / "reference.json").exists()
    assert cli.main(["quality", str(folder)]) == 0
    assert "holds no unchecked configuration" in capsys.readouterr().out


def test_a_refused_trial_exits_4_and_an_unknown_one_is_named(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_check(*_a: Any, **_k: Any) -> Verdict:
        return Verdict("fail", "fake: drift too large", {"kv-cache-dtype": "auto -> fp8"})

    monkeypatch.setattr(stage, "check_configuration", fake_check)
    assert cli.main(["quality", str(folder), "--trial", "1"]) == 4
    assert "fake: drift too large" in capsys.readouterr().out
    assert _verdicts(folder)[1]["status"] == "fail"
    assert cli.main(["quality", str(folder), "--trial", "99"]) == 2
    assert "--trial 99: no such trial" in " ".join(capsys.readouterr().err.split())


def test_show_names_a_refused_configuration_with_its_numbers(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from optimizer.quality.check import Comparison

    def fake_check(*_a: Any, **_k: Any) -> Verdict:
        moved = Comparison(64, 0.875, 0.25, 1.5)
        floor = Comparison(64, 1.0, 0.0, 0.0)
        return Verdict("fail", "fake: drift", {"kv-cache-dtype": "auto -> fp8"}, moved, floor)

    monkeypatch.setattr(stage, "check_configuration", fake_check)
    assert cli.main(["quality", str(folder), "--trial", "2"]) == 4
    capsys.readouterr()
    assert cli.main(["show", str(folder)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Quality gate" in out
    assert "trial 2: fail: top-1 agreement 0.875, logprob drift 0.2500 (floor 0.0000)" in out
    assert cli.main(["show", str(folder), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trials"][2]["quality"]["status"] == "fail"
    assert doc["trials"][0]["quality"] is None


def test_export_picks_the_best_that_passes_and_refuses_a_named_refused_trial(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from optimizer.cli_support import load_study_dir
    from optimizer.export.choose import select_trial
    from optimizer.quality.stage import record_verdict
    from optimizer.trial_view import TrialView

    real = study.prepare
    monkeypatch.setattr(study, "prepare", lambda job, base: real(job, base, check_flags=False))
    folder = _study(tmp_path, tmp_path / "big", trials=8)
    _saved, st = load_study_dir(folder)
    assert sum(TrialView(t).feasible for t in st.trials) >= 2
    best = select_trial(st, "max-throughput")
    record_verdict(st, best, Verdict("fail", "fake: drift", {"kv-cache-dtype": "auto -> fp8"}))
    out = tmp_path / "e.yaml"
    argv = ["export", str(folder), "--format", "vllm-config", "--no-validate", "--out", str(out)]
    assert cli.main(argv) == 0
    text = out.read_text()
    assert f"trial {best.number}." not in text.splitlines()[0]
    assert f"Refused by the quality gate: trial {best.number}" in text
    named = [*argv, "--trial", str(best.number)]
    capsys.readouterr()
    assert cli.main(named) == 4
    assert "refused by the quality gate" in " ".join(capsys.readouterr().err.split())
    assert cli.main([*named, "--force"]) == 0
