"""What a reviewer reads of a stability check: report.md's section and the values MLflow gets,
from the FAKE check of test_plots (two FAKE servers, the chosen one's memory growing)."""

from __future__ import annotations

import json
from pathlib import Path

from optimizer.analysis.documents import headline_md, stability_section
from optimizer.stability.stored import tracking_values
from tests.unit.stability.test_plots import _fake_check


def test_report_section_has_the_status_the_comparison_the_plan_and_every_verdict(
    tmp_path: Path,
) -> None:
    doc = json.loads(json.dumps(_fake_check(tmp_path)))
    lines = stability_section(doc)
    text = "\n".join(lines)
    assert lines[1] == "## Stability check"
    assert "- trial 3 (policy knee), checked " in text and ": **unstable**" in text
    assert "- **worse than the baseline**: memory_rss: chosen fail" in text
    assert "sustained 60 s at rate x1; burst 6 s at rate x3; recovery 12 s" in text
    assert "SLOs: p95_ttft_ms<=200, p99_tpot_ms<=30, error_rate<=0.01" in text
    assert "| verdict | chosen (trial 3) | baseline (trial 0) |" in lines
    memory = next(x for x in lines if x.startswith("| memory_rss |"))
    chosen_cell, baseline_cell = memory.split(" | ")[1:3]
    assert chosen_cell.startswith("**fail**: growing") and baseline_cell.startswith("pass: level")
    assert all(x.count("|") == 4 for x in lines if x.startswith("| "))  # no stray pipes
    assert "**worse than the baseline** on memory_rss" in headline_md([], {}, stability=doc)
    assert "Stability" not in headline_md([], {})

    alone = {**doc, "runs": {"chosen": doc["runs"]["chosen"]}, "worse_than_baseline": []}
    assert "- no baseline run: nothing to compare with" in stability_section(alone)
    assert stability_section(None) == [] and stability_section({"runs": {}}) == []


def test_mlflow_values_per_verdict_and_the_worse_tag_only_when_worse(tmp_path: Path) -> None:
    doc = json.loads(json.dumps(_fake_check(tmp_path)))
    metrics, tags = tracking_values(doc)
    assert metrics["stability.stable"] == 0 and metrics["stability.trial"] == 3
    assert metrics["stability.chosen.memory_rss"] == 0.0
    assert metrics["stability.baseline.memory_rss"] == 1.0
    assert metrics["stability.chosen.rss_mib_per_min"] > 59
    assert tags["stability.worse_than_baseline"] == "memory_rss"
    assert tags["stability.status"] == "unstable"
    chosen = doc["runs"]["chosen"]
    chosen["verdicts"].append({"name": "made_up", "status": "n/a", "text": "", "numbers": {}})
    chosen["p99_send_lag_ms"] = None  # NaN is stored as null, and never logged
    metrics, tags = tracking_values({**doc, "worse_than_baseline": [], "status": "stable"})
    assert "stability.worse_than_baseline" not in tags and metrics["stability.stable"] == 1
    assert "stability.chosen.p99_send_lag_ms" not in metrics
    assert "stability.chosen.made_up" not in metrics  # n/a: no number to log
