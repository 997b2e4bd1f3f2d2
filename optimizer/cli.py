"""The ``vllm-autotune`` command line: thin wiring from arguments to the library.

Every command validates its input up front and fails with exit code 2 and a message that names
what to fix; long work shows progress; results are printed as tables (rich) or JSON.

This module builds the parser and runs a command; the commands live with what they drive:
:mod:`optimizer.cli_engine` (make-model, engine check), :mod:`optimizer.cli_trace` (trace,
replay), :mod:`optimizer.cli_study` (tune, show, mlflow-sync) and each room's ``command.py``
(export, stability, regress, spec-sweep; the service's in :mod:`optimizer.service.client`)
and :mod:`optimizer.quality_check` (quality).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from optimizer import cli_engine, cli_study, cli_trace
from optimizer.cli_support import err_console
from optimizer.errors import AutotuneError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The vllm-autotune command line: one sub-command per job."""
    parser = argparse.ArgumentParser(
        prog="vllm-autotune",
        description="Find the vLLM engine configuration that serves your real traffic best.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    cli_engine.register(sub)
    cli_trace.register(sub)
    cli_study.register(sub)
    from optimizer.service.client import register as register_service

    register_service(sub)
    from optimizer.stability_check.command import register as register_stability

    register_stability(sub)
    from optimizer.quality_check import register as register_quality

    register_quality(sub)
    from optimizer.regress.command import register as register_regress

    register_regress(sub)
    from optimizer.speculation.command import register as register_spec_sweep

    register_spec_sweep(sub)
    return parser


def _quiet_libraries() -> None:
    """Keep library chatter (experimental-feature notices, per-trial INFO lines) off the screen."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*is an experimental feature")
    warnings.filterwarnings("ignore", message=r".*is experimental \(supported from")
    import optuna

    # Optuna sets its own level when first imported: set it through Optuna, after the import
    # ("A new study created in memory ..." lines come from in-memory studies of the analysis).
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    quiet = {
        # An empty feasible front is said by our own tables; the plot just has no points.
        "optuna.visualization._pareto_front": logging.ERROR,
        # MLflow's embedded SQLite store announces its table creation and migrations.
        "mlflow.store.db.utils": logging.WARNING,
        "alembic": logging.WARNING,
        "alembic.runtime.migration": logging.WARNING,
    }
    for name, level in quiet.items():
        logging.getLogger(name).setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vllm-autotune`` console script."""
    _quiet_libraries()
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns))
    except AutotuneError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        return 2
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
