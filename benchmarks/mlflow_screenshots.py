"""Screenshots of a study's MLflow pages (issue 17), taken by headless Chromium.

Starts ``mlflow ui`` on the study folder's own store, opens the pages a reviewer reads and saves
them under ``docs/``:

- ``mlflow-runs.png``: the experiment's runs table (the view the tuner links to, not MLflow 3's
  GenAI pages), parent run and its trials, bad trials named and marked;
- ``mlflow-parent-run.png``: the study's parent run (description = headline + report, gain
  metrics);
- ``mlflow-child-run.png``: one trial's run (the best Pareto trial, else the baseline);
- ``mlflow-pareto.png``: the Pareto projection PNG in MLflow's artifact viewer (the interactive
  ``pareto_front.html`` loads plotly.js from its CDN, which a machine without internet cannot).

Known gaps: in MLflow 3.17 the runs table shows the parent run collapsed (the click on its
expander does not take; the child runs are listed on the parent run's page); a study with one
objective (a capacity study) has no Pareto projection, so no ``mlflow-pareto.png``.

Needs ``pip install playwright`` and a Chromium: Playwright's own (``python -m playwright install
chromium``, needs internet) or a system one (``apt-get install chromium``), found on PATH or given
with ``--chromium``.

    python benchmarks/mlflow_screenshots.py runs/cpu-demo --out docs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def mlflow_ui(study: Path, port: int) -> Iterator[str]:
    """``mlflow ui`` on the study folder's store, until the block ends."""
    db = (study / "mlflow.db").resolve()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        f"sqlite:///{db}",
        "--default-artifact-root",
        str((study / "mlartifacts").resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = open(study / "mlflow-ui.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"mlflow ui exited ({proc.returncode}); see {log.name}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"mlflow ui not up after 120 s; see {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        log.close()


def pages(study: Path, url: str) -> dict[str, tuple[str, str]]:
    """File name -> (page URL, a text the page shows once its data is there)."""
    from mlflow.tracking import MlflowClient

    from optimizer.tracking import runs_url

    client = MlflowClient(f"sqlite:///{(study / 'mlflow.db').resolve()}")
    runs = [
        r
        for exp in client.search_experiments()
        for r in client.search_runs([exp.experiment_id], max_results=1000)
    ]
    parent = next(r for r in runs if r.data.tags.get("vllm_autotune.role") == "study")
    children = [r for r in runs if r.data.tags.get("vllm_autotune.role") == "trial"]
    pick = next(
        (
            r
            for r in children
            if r.data.tags.get("class") == "pareto" and r.data.tags.get("baseline") != "true"
        ),
        next(r for r in children if r.data.tags.get("baseline") == "true"),
    )
    exp = parent.info.experiment_id
    pngs = [
        a.path
        for a in client.list_artifacts(parent.info.run_id, "pareto")
        if a.path.endswith(".png")
    ]
    table = runs_url(exp, url)
    run_page, query = table.split("?", 1)  # the runs table's view (not the GenAI pages)
    out = {
        "mlflow-runs.png": (table, parent.info.run_name),
        "mlflow-parent-run.png": (f"{run_page}/{parent.info.run_id}?{query}", "Best gain"),
        "mlflow-child-run.png": (f"{run_page}/{pick.info.run_id}?{query}", pick.info.run_name),
    }
    if pngs:
        out["mlflow-pareto.png"] = (
            f"{run_page}/{parent.info.run_id}/artifacts/{pngs[0]}?{query}",
            pngs[0].rsplit("/", 1)[-1],
        )
    return out


def shoot(targets: dict[str, tuple[str, str]], out: Path, chromium: str | None) -> list[Path]:
    """Open every page in headless Chromium and save a screenshot of it."""
    from playwright.sync_api import sync_playwright

    written = []
    with sync_playwright() as p:
        launch: dict[str, Any] = {"headless": True}
        if chromium:
            launch["executable_path"] = chromium
        browser = p.chromium.launch(**launch)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        for name, (target, wait_for) in targets.items():
            # Not "networkidle": some MLflow pages poll for as long as they are open.
            page.goto(target, wait_until="load", timeout=120_000)
            with contextlib.suppress(Exception):  # the data arrives after the page
                page.get_by_text(wait_for, exact=False).first.wait_for(timeout=90_000)
            with contextlib.suppress(Exception):  # MLflow 3.17's assistant panel: not ours
                page.locator("button[aria-label*='lose' i]").last.click(timeout=3000)
            if name == "mlflow-runs.png":
                with contextlib.suppress(Exception):  # show the trials under the study's run
                    # the expander left of the parent run's name (it has no accessible name)
                    box = page.locator("a", has_text=wait_for).first.bounding_box()
                    if box:
                        page.mouse.click(box["x"] - 33, box["y"] + box["height"] / 2)
                    page.get_by_text("baseline", exact=False).first.wait_for(timeout=30_000)
            page.wait_for_timeout(4000)  # charts and images render after the data
            path = out / name
            page.screenshot(path=str(path), full_page=False)
            written.append(path)
            print(f"{path}  <- {target}")
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", type=Path, help="a study folder written by `vllm-autotune tune`")
    ap.add_argument("--out", type=Path, default=REPO / "docs")
    ap.add_argument("--port", type=int, default=0, help="mlflow ui's port (default: a free one)")
    ap.add_argument(
        "--chromium",
        default=None,
        help="a Chromium executable (default: chromium on PATH, else Playwright's own)",
    )
    ns = ap.parse_args(argv)
    chromium = ns.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    ns.out.mkdir(parents=True, exist_ok=True)
    with mlflow_ui(ns.study, ns.port or _free_port()) as url:
        shoot(pages(ns.study, url), ns.out, chromium)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
