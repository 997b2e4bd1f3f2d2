"""The stability check of a study folder end to end, with FAKE servers (tests/fakes/stability.py;
the study itself from test_tracking's FAKE runner) and a real local SQLite MLflow store: the
job's ``stability.after_study`` stage, stability.json, the plots, the check on the MLflow parent
run (metrics, tags, artifacts, report and description), ``stability --replot``, and
``export --require-stable`` refusing with one line until a check lets the trial ship."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from optimizer import cli, cli_support, study
from optimizer.config import load_job
from optimizer.stability.plots import LATENCY_PNG, SERVER_PNG
from optimizer.stability_check import workflow
from optimizer.tracking import local_tracking_uri
from tests.fakes.stability import FakeServer, fake_run_on_new_server
from tests.unit.test_tracking import FakeRunner, _job, _runs

# A short plan: 1 minute sustained, 5 s windows.
STABILITY = {
    "after_study": True,
    "minutes": 1,
    "burst_s": 5,
    "recovery_s": 10,
    "long_s": 10,
    "window_s": 5,
}
LEAKING = {"chosen": FakeServer(rss_growth_mib_per_min=60), "baseline": FakeServer()}
LEVEL = {"chosen": FakeServer(), "baseline": FakeServer()}


@pytest.fixture()
def fake_servers(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, FakeServer]]:
    """Servers are FAKES; the job is prepared without asking the installed vLLM for its flags."""
    servers = {"now": LEAKING}
    monkeypatch.setattr(
        workflow,
        "run_on_new_server",
        lambda *a, **k: fake_run_on_new_server(servers["now"])(*a, **k),
    )
    monkeypatch.setattr(study, "prepare", functools.partial(study.prepare, check_flags=False))
    return servers


def _export(folder: Path, *extra: str) -> int:
    out = str(folder / "export" / "x.yaml")
    return cli.main(
        ["export", str(folder), "--format", "vllm-config", "--no-validate", *extra, "--out", out]
    )


def _refusal(err: str) -> str:
    (line,) = [x for x in err.splitlines() if "refusing to export" in x]
    return line


def _study(folder: Path) -> optuna.Study:
    return optuna.load_study(study_name="fake-mlflow", storage=f"sqlite:///{folder / 'study.db'}")


def _parent(folder: Path) -> Any:
    parent, _ = _runs(local_tracking_uri(folder))
    return parent


def test_the_after_study_stage_checks_plots_and_logs_and_export_requires_it(
    tmp_path: Path,
    fake_servers: dict[str, dict[str, FakeServer]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = _job(tmp_path, stability=STABILITY)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert load_job(job, base=tmp_path)[0].stability.options().settings.sustained_s == 60
    monkeypatch.setattr(
        cli_support, "make_runner", lambda *_a: FakeRunner()
    )  # trials are FAKES too
    assert cli.main(["tune", str(tmp_path / "job.yaml"), "--runner", "local"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "out"
    doc = json.loads((folder / "stability.json").read_text())
    trial = doc["trial"]
    assert doc["status"] == "unstable" and doc["slos"] == ["p95_ttft_ms<=1000"]
    assert [w.split(":")[0] for w in doc["worse_than_baseline"]] == ["memory_rss"]
    runs_dir = folder / doc["runs_dir"]
    assert (runs_dir / LATENCY_PNG).is_file() and (runs_dir / SERVER_PNG).is_file()
    assert "logged to the study's MLflow parent run: run " in out
    assert out.index("Stability check") < out.index("study folder: ")  # tune's last stage

    parent = _parent(folder)
    m, tags = parent.data.metrics, parent.data.tags
    assert m["stability.stable"] == 0 and m["stability.trial"] == trial
    assert m["stability.chosen.memory_rss"] == 0 and m["stability.baseline.memory_rss"] == 1
    assert m["stability.chosen.rss_mib_per_min"] == pytest.approx(60, rel=0.01)
    assert m["stability.worse_than_baseline"] == 1
    assert tags["stability.status"] == "unstable"
    assert tags["stability.worse_than_baseline"] == "memory_rss"
    assert "**Stability check** of trial" in tags["mlflow.note.content"]
    client = MlflowClient(local_tracking_uri(folder))
    files = {a.path for a in client.list_artifacts(parent.info.run_id, "stability")}
    assert files == {f"stability/{n}" for n in ("stability.json", LATENCY_PNG, SERVER_PNG)}
    report = Path(client.download_artifacts(parent.info.run_id, "report.md", str(tmp_path)))
    text = report.read_text()
    assert "## Stability check" in text and "**worse than the baseline**: memory_rss" in text
    _, children = _runs(local_tracking_uri(folder))
    child = next(r for r in children if r.data.tags["vllm_autotune.trial"] == str(trial))
    assert child.data.tags["stability"] == "unstable"

    assert _export(folder, "--require-stable") == 6
    line = _refusal(capsys.readouterr().err)
    assert "stability check says unstable (failed: memory_rss)" in line
    assert f"vllm-autotune stability {folder} --trial {trial}" in line
    # A FAKE document: stable on its own, but worse than the baseline on one verdict.
    stored = (folder / "stability.json").read_text()
    fake = {**doc, "status": "stable", "worse_than_baseline": ["spikes: chosen warn vs pass"]}
    (folder / "stability.json").write_text(json.dumps(fake))
    assert _export(folder, "--require-stable") == 6
    assert "did worse than the baseline in its stability check on spikes" in _refusal(
        capsys.readouterr().err
    )
    (folder / "stability.json").write_text(stored)
    other = next(t.number for t in _study(folder).get_trials() if t.number != trial)
    assert _export(folder, "--require-stable", "--trial", str(other)) == 6
    assert f"is of trial {trial}, not of trial {other}" in _refusal(capsys.readouterr().err)

    # Without a check, export says how to run one; --require-stable refuses in one line.
    stored = (folder / "stability.json").read_text()
    (folder / "stability.json").unlink()
    assert _export(folder) == 0
    assert f"hint: trial {trial} has no stability check" in capsys.readouterr().out
    assert _export(folder, "--require-stable") == 6
    line = _refusal(capsys.readouterr().err)
    assert "has no stability check" in line and "vllm-autotune stability" in line
    (folder / "stability.json").write_text(stored)

    # A new check, both level: stable, the worse-than-baseline tag gone, export lets it ship.
    fake_servers["now"] = LEVEL
    args = ["stability", str(folder), "--minutes", "1", "--window-s", "5", "--burst-s", "5"]
    assert cli.main([*args, "--recovery-s", "10", "--long-s", "10"]) == 0
    parent = _parent(folder)
    assert parent.data.metrics["stability.stable"] == 1
    assert "stability.worse_than_baseline" not in parent.data.tags
    assert _export(folder, "--require-stable") == 0
    assert (folder / "export" / "x.yaml").read_text().count("Stability check") == 1

    # --replot makes the plots again from the stored files, and logs them once more.
    for png in (folder / json.loads((folder / "stability.json").read_text())["runs_dir"]).glob(
        "*.png"
    ):
        png.unlink()
    capsys.readouterr()
    assert cli.main(["stability", str(folder), "--replot", "--no-mlflow"]) == 0
    out = capsys.readouterr().out
    assert "plots: " in out and "MLflow" not in out

    # --rejudge recomputes the verdicts from the stored runs: a document whose verdicts were
    # judged by other rules (here a FAKE edit: the chosen failed on memory, drift wiped) is
    # judged again and is stable, with the drift of whole loops of the trace.
    good = json.loads((folder / "stability.json").read_text())
    edited = json.loads(json.dumps(good))
    chosen = edited["runs"]["chosen"]
    chosen["status"], edited["status"] = "unstable", "unstable"
    chosen["verdicts"] = [
        {**v, "status": "fail"} if v["name"] == "memory_rss" else v
        for v in chosen["verdicts"]
        if v["name"] != "drift"
    ]
    del edited["plan"]["trace_period_s"]
    (folder / "stability.json").write_text(json.dumps(edited))
    assert cli.main(["stability", str(folder), "--rejudge", "--no-mlflow"]) == 0
    again = json.loads((folder / "stability.json").read_text())
    assert again["status"] == "stable" and "rejudged_at" in again
    assert again["plan"]["trace_period_s"] > 0
    assert [v["name"] for v in again["runs"]["chosen"]["verdicts"]] == [
        v["name"] for v in good["runs"]["chosen"]["verdicts"]
    ]
    # A run whose records are gone cannot be judged again: one clear error, nothing rewritten.
    (folder / again["runs_dir"] / "chosen" / "records.jsonl.gz").unlink()
    capsys.readouterr()
    assert cli.main(["stability", str(folder), "--rejudge", "--no-mlflow"]) == 2
    assert "cannot be judged again" in " ".join(capsys.readouterr().err.split())
    assert json.loads((folder / "stability.json").read_text()) == again


def test_a_job_stability_section_is_strict(tmp_path: Path) -> None:
    from optimizer.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"stability\.minuts: unknown key; did you mean 'minutes'"
    ):
        load_job(_job(tmp_path, stability={"minuts": 3}), base=tmp_path)
    with pytest.raises(ConfigError, match=r"stability\.fraction"):
        load_job(_job(tmp_path, stability={"fraction": 0}), base=tmp_path)
    job, _ = load_job(_job(tmp_path, stability={"recovery_s": 45}), base=tmp_path)
    assert not job.stability.after_study  # off unless asked for
    options = job.stability.options()
    assert options.settings.recovery_s == 45 and not options.auto_recovery
    default = load_job(_job(tmp_path), base=tmp_path)[0].stability.options()
    assert default.auto_recovery and default.settings.sustained_s == 180
    assert default.fraction == 0.7 and default.burst_factor == 3.0 and default.baseline
