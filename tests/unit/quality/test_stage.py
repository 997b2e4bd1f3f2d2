"""The gate as a study stage on a real (in-memory) Optuna study, with a FAKE check (the servers
are in tests/integration/test_quality_vllm.py): a refused member leaves the front, the member it
dominated joins and is checked, and the export policy picks the best that passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.export.choose import select_trial
from optimizer.quality import stage
from optimizer.quality.check import QualitySettings, Verdict
from optimizer.trial_view import feasible_front, quality_verdicts, refused_trials

BASE = {"max-num-seqs": 128}


def _study() -> optuna.Study:
    study = optuna.create_study(directions=["maximize"])
    study.set_metric_names(["capacity_rps"])
    rows = [
        (BASE, 10.0, True),
        ({"max-num-seqs": 64, "kv-cache-dtype": "fp8", "quantization": "fp8"}, 30.0, False),
        ({"max-num-seqs": 64, "kv-cache-dtype": "fp8"}, 20.0, False),
        ({"max-num-seqs": 64}, 15.0, False),
    ]
    for args, cap, baseline in rows:
        study.add_trial(
            optuna.trial.create_trial(
                values=[cap],
                user_attrs={
                    "engine_args": json.dumps(args),
                    "status": "complete",
                    "baseline": baseline,
                },
            )
        )
    return study


def _gate(study: optuna.Study, workdir: Path, **kw: Any) -> list[tuple[int, Verdict]]:
    """``gate_front`` on ``study`` against :data:`BASE` with no server environment."""
    args: dict[str, Any] = {
        "model": "m",
        "baseline_args": BASE,
        "env_for": lambda args: {},
        "prompts": [[1, 2]],
        "workdir": workdir,
        "settings": QualitySettings(),
        **kw,
    }
    return stage.gate_front(study, **args)


def test_a_refused_member_leaves_the_front_and_the_export_picks_the_best_that_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[dict[str, Any]] = []

    def fake_check(model: str, args: dict[str, Any], *_a: Any, **_k: Any) -> Verdict:
        checked.append(args)
        status = "fail" if args.get("quantization") else "pass"
        return Verdict(status, f"fake: {status}", {"x": "y"})

    monkeypatch.setattr(stage, "check_configuration", fake_check)
    study = _study()
    assert [t.number for t in feasible_front(study)] == [1]
    done = _gate(study, tmp_path)
    assert [(n, v.status) for n, v in done] == [(1, "fail"), (2, "pass")]
    assert [a.get("quantization") for a in checked] == ["fp8", None]
    assert [t.number for t in refused_trials(study)] == [1]
    assert [t.number for t in feasible_front(study)] == [2]
    assert [t.number for t in feasible_front(study, gated=False)] == [1]
    assert select_trial(study, "max-capacity").number == 2
    assert quality_verdicts(study)[1] == {
        "status": "fail",
        "reason": "fake: fail",
        "levers": {"x": "y"},
        "comparison": None,
        "floor": None,
        "seconds": 0.0,
    }


def test_only_named_trials_are_checked_and_unchanged_ones_need_no_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    monkeypatch.setattr(
        "optimizer.quality.run.EngineProcess", lambda *a, **k: started.append("server")
    )
    study = _study()
    done = _gate(study, tmp_path / "q", model=str(tmp_path), only=[3])
    assert [(n, v.status) for n, v in done] == [(3, "unchanged")]
    assert started == []


def test_the_verdicts_reach_the_export_header_and_report_md(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from optimizer.analysis.documents import quality_section
    from optimizer.export.command import _with_quality_notes
    from optimizer.export.render import ExportContext
    from optimizer.quality.check import Comparison
    from optimizer.quality.stage import quality_notes

    def fake_check(model: str, args: dict[str, Any], *_a: Any, **_k: Any) -> Verdict:
        moved = 0.3 if args.get("quantization") else 0.01
        comparison = Comparison(64, 0.9 if moved > 0.1 else 1.0, moved, 2 * moved)
        floor = Comparison(64, 1.0, 0.0, 0.0)
        status = "fail" if moved > 0.1 else "pass"
        return Verdict(status, f"fake {status}", {"x": "y"}, comparison, floor)

    monkeypatch.setattr(stage, "check_configuration", fake_check)
    study = _study()
    _gate(study, tmp_path, prompts=[[1]])
    notes = quality_notes(study, 2)
    assert notes[0].startswith("Quality gate, trial 2: pass: top-1 agreement 1.000")
    assert notes[1].startswith(
        "Refused by the quality gate: trial 1 (kv-cache-dtype, quantization): fail: "
        "top-1 agreement 0.900, logprob drift 0.3000"
    )
    ctx = ExportContext(
        study="s", trial=2, model="m", args={}, vllm="v", hardware="h", trace="t", gain="g"
    )
    header = _with_quality_notes(ctx, study, 2).header()
    assert "# NOTE: Refused by the quality gate: trial 1" in header
    section = "\n".join(quality_section(study))
    assert "| 1 | kv-cache-dtype, quantization | fail | 0.900 | 0.3000 | 0.0000 | fake fail |" in (
        section
    )
    assert quality_notes(study, 3) == [notes[1]]  # no levers: only the refusals
    unchecked = quality_notes(_study(), 1)
    assert unchecked == [
        "Quality gate: trial 1 changes numerics (kv-cache-dtype, quantization) and was not "
        "checked: run `vllm-autotune quality` on the study folder, or check its answers against "
        "the baseline's yourself."
    ]


def test_a_numeric_changing_check_runs_where_place_puts_it_and_unchanged_ones_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``place`` (a study's runner: an actor on the GPUs the servers need) gets every
    numeric-changing member's check with its arguments; a member that changes nothing numeric
    is recorded here, without placing anything."""
    from optimizer.quality.run import check_configuration

    def fake_check(model: str, args: dict[str, Any], *_a: Any, **_k: Any) -> Verdict:
        return Verdict("fail" if args.get("quantization") else "pass", "fake", {"x": "y"})

    placed: list[dict[str, Any]] = []

    def place(check: Any, args: Any) -> Verdict:
        placed.append(dict(args))
        verdict: Verdict = check()
        return verdict

    monkeypatch.setattr(stage, "check_configuration", fake_check)
    study = _study()
    done = _gate(study, tmp_path, place=place)
    assert [(n, v.status) for n, v in done] == [(1, "fail"), (2, "pass")]
    assert [a.get("quantization") for a in placed] == ["fp8", None]
    # ... and an unchanged member (trial 3, named) is judged without being placed
    monkeypatch.setattr(stage, "check_configuration", check_configuration)
    placed.clear()
    done = _gate(study, tmp_path, only=[3], place=place)
    assert [(n, v.status) for n, v in done] == [(3, "unchanged")] and placed == []
