"""``vllm-autotune make-model`` and ``engine check``: a weight-less model folder, and one server
started, asked one request and stopped; and the engine arguments a command line gives
(``--engine-arg KEY=VALUE``) with the defaults a local server needs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from optimizer.cli_support import console, err_console
from optimizer.errors import ConfigError, EngineError

__all__ = ["engine_config_for", "parse_engine_args", "register"]


def parse_engine_args(items: Sequence[str]) -> dict[str, Any]:
    """``["max-num-seqs=64", "enforce-eager=true"]`` -> ``{"max-num-seqs": 64, ...}``.

    Values are read as YAML scalars, so ``true``/``false``, numbers and JSON objects (for
    ``speculative-config``) keep their types.

    Raises:
        ConfigError: An item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. max-num-seqs=64")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out[key.strip().lstrip("-")] = value
    return out


def engine_config_for(
    model: str, engine_args: dict[str, Any], *, python: str | None, kv_cache_gib: float | None
) -> tuple[Any, list[str]]:
    """Build an EngineConfig with the defaults a local run needs; returns it and notes to show.

    The defaults are study preparation's (:mod:`optimizer.engine.defaults`: dummy weights for
    a folder without weight files, the CPU build's KV cache variable). Arguments are validated
    against the installed vLLM before anything starts.
    """
    from optimizer.engine.defaults import apply_engine_defaults
    from optimizer.engine.flags import accepted_flags, installed_vllm, validate_engine_args
    from optimizer.types import EngineConfig

    install = installed_vllm(python)
    defaults = apply_engine_defaults(
        model,
        engine_args,
        cpu_build=install.is_cpu_build,
        kv_cache_gib=None if kv_cache_gib is None else int(kv_cache_gib),
    )
    validate_engine_args(defaults.args, accepted_flags(install))
    build = "CPU build" if install.is_cpu_build else "GPU build"
    notes = [*defaults.notes, f"{build} {install.dist} {install.version}"]
    return EngineConfig(model=model, args=defaults.args, env=defaults.env), notes


def cmd_make_model(ns: argparse.Namespace) -> int:
    from optimizer.engine.models import PRESETS, make_model

    out = make_model(ns.dir, ns.preset, max_model_len=ns.max_model_len)
    spec = PRESETS[ns.preset]
    console.print(
        f"wrote [bold]{out}[/] ({ns.preset}: {spec['architectures'][0]}, "
        f"{spec['num_hidden_layers']} layers, hidden {spec['hidden_size']}, "
        f"vocab {spec['vocab_size']}); serve it with --load-format dummy"
    )
    return 0


def _startup_table(doc: dict[str, dict[str, float]]) -> Table:
    """Where the start went, phase by phase (vLLM's own figure for the same work beside it)."""
    from optimizer.engine.startup import phase_table_rows

    table = Table(title="startup (launch to healthy), by phase")
    table.add_column("phase")
    table.add_column("s", justify="right")
    table.add_column("vLLM's own figure (s)", justify="right")
    for row in phase_table_rows(doc):
        table.add_row(*row)
    return table


def _memory_table(account: Any, startup_s: float | None) -> Table:
    table = Table(title="engine", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("startup (launch to healthy)", f"{startup_s:.1f} s" if startup_s else "-")
    for key in account.__slots__:
        value = getattr(account, key)
        table.add_row(
            key, "-" if value is None else f"{value:,}" if isinstance(value, int) else f"{value:g}"
        )
    return table


def cmd_engine_check(ns: argparse.Namespace) -> int:
    import httpx

    from optimizer.engine.process import EngineProcess

    config, notes = engine_config_for(
        ns.model, parse_engine_args(ns.engine_arg), python=ns.python, kv_cache_gib=ns.kv_cache_gib
    )
    for note in notes:
        console.print(f"[dim]{note}[/]")
    log_path = Path(ns.log or Path(ns.workdir) / f"engine-check-{int(time.time())}.log")
    engine = EngineProcess(
        config, log_path=log_path, python=ns.python, startup_timeout_s=ns.startup_timeout
    )
    console.print(f"starting vLLM ({' '.join(engine.argv[1:])}); log: {log_path}")
    try:
        with console.status("waiting for /health ..."):
            engine.start()
    except EngineError as exc:
        err_console.print(f"[bold red]engine failed: {exc.failure_class.value}[/]")
        err_console.print(exc.explanation)
        for line in exc.log_lines[-12:]:
            err_console.print(f"  [dim]{line[:240]}[/]")
        err_console.print(f"full log: {exc.log_path}")
        return 1
    try:
        console.print(_startup_table(engine.startup_phases))
        console.print(_memory_table(engine.memory_account(), engine.startup_s))
        from optimizer.engine.models import model_info

        low = 256
        if Path(ns.model).is_dir():
            with_info = model_info(ns.model)
            low = with_info.prompt_low
        body = {
            "model": ns.model,
            "prompt": list(range(low, low + 32)),
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": False,
            "skip_special_tokens": False,
        }
        t0 = time.monotonic()
        resp = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120)
        took = time.monotonic() - t0
        if resp.status_code != 200:
            err_console.print(
                f"[bold red]request failed: HTTP {resp.status_code}[/] {resp.text[:300]}"
            )
            return 1
        usage = resp.json().get("usage", {})
        console.print(
            f"one request: {usage.get('prompt_tokens')} prompt + "
            f"{usage.get('completion_tokens')} output tokens in {took * 1000:.0f} ms"
        )
    finally:
        with console.status("stopping the server ..."):
            engine.stop()
    console.print(
        "[green]engine check passed[/]: server started, answered, stopped (no process left)"
    )
    return 0


def register(sub: Any) -> None:
    """make-model, engine check: model folders and one server."""
    p = sub.add_parser(
        "make-model", help="write a weight-less model folder for --load-format dummy"
    )
    p.add_argument("dir")
    from optimizer.engine.models import PRESETS

    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="lower the model's context length (max_position_embeddings)",
    )
    p.set_defaults(func=cmd_make_model)

    eng = sub.add_parser("engine", help="engine utilities").add_subparsers(
        dest="engine_cmd", required=True
    )
    p = eng.add_parser(
        "check", help="start a server, print its memory account, send one request, stop"
    )
    p.add_argument("--model", required=True, help="model folder (make-model) or hub name")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vllm serve flag, e.g. max-num-seqs=64 (repeatable)",
    )
    p.add_argument(
        "--python", default=None, help="interpreter with vLLM installed (default: this one)"
    )
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=None,
        help="CPU build: KV cache size in whole GiB (default 2)",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for /health"
    )
    p.add_argument("--workdir", default=".", help="folder for the server log")
    p.add_argument("--log", default=None, help="server log file (default: in --workdir)")
    p.set_defaults(func=cmd_engine_check)
