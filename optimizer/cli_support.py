"""What several commands share: the consoles, opening a study folder, making a runner.

``cli.py`` wires arguments to the commands; the commands (``cli_engine.py``, ``cli_trace.py``,
``cli_study.py``, and those that live in their own rooms: ``export/command.py``,
``regress/command.py``, ``stability_check/command.py``, ...) use this module, never ``cli.py``, so
the command line and its commands import no circle.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from optimizer.errors import ConfigError

__all__ = ["add_capacity_pricing", "console", "err_console", "load_study_dir", "make_runner"]

# Logs and CI capture output without a terminal; rich would squeeze tables to 80 columns.
_WIDTH = None if sys.stdout.isatty() else 150
console = Console(stderr=False, width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)


def make_runner(kind: str, plan: Any, ray_address: str | None) -> Any:
    """The trial runner a command asked for: ``local`` (this process) or ``ray``."""
    from optimizer.runners import LocalRunner, RayRunner

    if kind == "local":
        return LocalRunner()
    capacity = 1 if plan.context.cpu_build else plan.job.parallel
    return RayRunner(ray_address or plan.job.ray_address, capacity=capacity)


def load_study_dir(folder: Path) -> tuple[dict[str, Any], Any]:
    """A study folder's ``plan.json`` and its Optuna study, or one clear error."""
    import optuna

    from optimizer.service.security import redact_url
    from optimizer.study import create_storage
    from optimizer.study_folder import portable_url, storage_url_of

    plan_file = folder / "plan.json"
    if not plan_file.exists():
        raise ConfigError(f"{folder}: no plan.json here; give a study folder written by `tune`")
    plan = json.loads(plan_file.read_text())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage_url_of(plan, folder)
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///") :]).is_file():
        raise ConfigError(
            f"{folder}: its storage {portable_url(url, folder)} is missing; copy the study "
            "folder whole (plan.json with study.db)"
        )
    try:
        study = optuna.load_study(study_name=plan["study"], storage=create_storage(url))
    except Exception as exc:  # a missing or foreign storage: say which, no traceback
        raise ConfigError(
            f"{folder}: cannot open study {plan.get('study')!r} in its storage "
            f"{redact_url(portable_url(url, folder))}: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    return plan, study


def add_capacity_pricing(p: argparse.ArgumentParser) -> None:
    """--peak-rps and --gpu-hour-price (tune, show, export)."""
    p.add_argument(
        "--peak-rps",
        type=float,
        default=None,
        help="capacity studies: peak request rate to provision for (GPUs needed at the "
        "baseline and the winner); default: the job's capacity.peak_rps",
    )
    p.add_argument(
        "--gpu-hour-price",
        type=float,
        default=None,
        help="capacity studies: price of a GPU-hour, for the cost per million output tokens; "
        "default: the job's capacity.gpu_hour_price",
    )
