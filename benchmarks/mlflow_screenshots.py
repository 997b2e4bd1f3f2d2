"""Screenshots of a study's MLflow pages (issue 17), taken by headless Chromium.

Starts ``mlflow ui`` on the study folder's own store, opens the pages a reviewer reads and saves
them under ``docs/``:

- ``mlflow-runs.png``: the experiment's runs table as the tuner's link opens it (not MLflow 3's
  GenAI pages; the saved view "vllm-autotune review" picks the columns: objectives, gains,
  class), the study's parent run expanded to show its trials, bad trials named and marked;
- ``mlflow-parent-run.png``: the study's parent run (description = headline + report, gain
  metrics);
- ``mlflow-child-run.png``: one trial's run (the best Pareto trial, else the baseline);
- ``mlflow-pareto.png``: the Pareto projection PNG in MLflow's artifact viewer (the interactive
  ``pareto_front.html`` loads plotly.js from its CDN, which a machine without internet cannot).

Paths of the machine the shots were taken on (storage URL, artifact location) are masked by grey
boxes. Known gap: a study with one objective (a capacity study) has no Pareto projection, so no
``mlflow-pareto.png``. PNGs are written with a 256-colour palette (Pillow) to keep them small.

Needs ``pip install playwright`` and a Chromium: Playwright's own (``python -m playwright install
chromium``, needs internet) or a system one (``apt-get install chromium``), found on PATH or given
with ``--chromium``.

    python benchmarks/mlflow_screenshots.py runs/cpu-demo --out docs [--only runs pareto]
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
    # The projection on the first two objectives (for a latency study: P95 TTFT vs P95 TPOT).
    names = [
        o.strip().rsplit(":", 1)[-1] for o in parent.data.params.get("objectives", "").split(",")
    ]
    first_two = f"pareto/pareto_{names[0]}__{names[1]}.png" if len(names) > 1 else ""
    pngs.sort(key=lambda p: p != first_two)
    if pngs:
        out["mlflow-pareto.png"] = (
            f"{run_page}/{parent.info.run_id}/artifacts/{pngs[0]}?{query}",
            pngs[0].rsplit("/", 1)[-1],
        )
    return out


def expand_parent(page: Any, parent_name: str) -> str:
    """Click the expander of the study's run (the button in its name cell) so that its trials
    are listed under it; '' when they are, else a note for the output."""
    cell = page.locator("[role=gridcell]", has=page.locator("a", has_text=parent_name)).first
    try:
        cell.locator("button[data-component-id*='runnamecellrenderer']").first.click(timeout=10_000)
        page.get_by_text("baseline", exact=False).first.wait_for(timeout=30_000)
    except Exception as exc:  # the page changed: say so rather than fail the other shots
        return f"  (the trials were not expanded: {type(exc).__name__})"
    return ""


def shrink(path: Path) -> None:
    """Rewrite a screenshot with a 256-colour palette: a third of the size, text still sharp."""
    from PIL import Image

    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def shoot(
    targets: dict[str, tuple[str, str]], out: Path, chromium: str | None, hide: str = ""
) -> list[Path]:
    """Open every page in headless Chromium and save a screenshot of it; text containing
    ``hide`` (the study folder's path on this machine) is masked by a solid box."""
    from playwright.sync_api import sync_playwright

    written = []
    with sync_playwright() as p:
        # Without the background-networking flags Chromium keeps trying hosts it cannot reach.
        args = ["--disable-background-networking", "--disable-component-update", "--no-first-run"]
        launch: dict[str, Any] = {"headless": True, "args": args}
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
            note = ""
            if name == "mlflow-runs.png":
                note = expand_parent(page, wait_for)
            page.wait_for_timeout(4000)  # charts and images render after the data
            path = out / name
            mask = [page.get_by_text(hide, exact=False)] if hide else []
            page.screenshot(path=str(path), full_page=False, mask=mask, mask_color="#888")
            shrink(path)
            written.append(path)
            print(f"{path}  ({path.stat().st_size // 1024} KiB)  <- {target}{note}")
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
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="take only these (runs, parent-run, child-run, pareto); default: all",
    )
    ns = ap.parse_args(argv)
    chromium = ns.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    ns.out.mkdir(parents=True, exist_ok=True)
    with mlflow_ui(ns.study, ns.port or _free_port()) as url:
        targets = pages(ns.study, url)
        if ns.only:
            targets = {k: v for k, v in targets.items() if k[len("mlflow-") : -4] in ns.only}
        written = shoot(targets, ns.out, chromium, hide=str(ns.study.resolve().parent))
    missing = sorted(set(ns.only or ()) - {p.name[len("mlflow-") : -4] for p in written})
    if missing:
        print(f"not taken: {', '.join(missing)} (this study has no such page)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
