"""The preloaded interpreter (issue 16) with a FAKE server module: it imports the module
first, says so, waits for the arguments, then runs the module as ``__main__`` with them, as
``python -m MODULE ARGS`` would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAKE_SERVER = """
import os, sys
from pathlib import Path
out = Path(os.environ["FAKE_OUT"])
with open(out, "a") as f:
    f.write(f"{__name__} {sys.argv[1:]}\\n")
"""


def test_imports_first_then_runs_as_main_with_the_arguments(tmp_path: Path) -> None:
    (tmp_path / "fake_vllm_server.py").write_text(FAKE_SERVER)
    out, go = tmp_path / "out.txt", tmp_path / "engine.log.go"
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "FAKE_OUT": str(out), "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "optimizer.engine.preload",
            str(go),
            "fake_vllm_server",
            "json",
            "no_such_module_here",
        ],
        env=env,
    )
    try:
        ready = go.with_name(go.name + ".ready")
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        facts = json.loads(ready.read_text())
        assert facts["pid"] == proc.pid and facts["cuda_initialized"] is False
        assert facts["extras"] == ["json"]  # a module that does not import is skipped
        time.sleep(0.3)
        assert proc.poll() is None  # waiting for its arguments
        assert out.read_text() == "fake_vllm_server []\n"  # imported once, as a module
        go.write_text(json.dumps({"args": ["--model", "m", "--port", "8000"]}))
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert out.read_text().splitlines() == [
        "fake_vllm_server []",
        "__main__ ['--model', 'm', '--port', '8000']",
    ]
