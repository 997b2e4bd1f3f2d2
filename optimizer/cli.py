"""The ``vllm-autotune`` command line: thin wiring from arguments to the library.

Every command validates its input up front and fails with exit code 2 and a message that names
what to fix; long work shows progress; results are printed as tables (rich) or JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.markup import escape
from rich.table import Table

from optimizer import cli_support
from optimizer.cli_support import console, err_console
from optimizer.errors import AutotuneError, ConfigError, EngineError

__all__ = ["main"]


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


# --- commands ---------------------------------------------------------------------------------


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


def _add_shaping(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "shaping (applied in this order: window, spread ticks, sample, compress, rate, "
        "lengths, clip)"
    )
    g.add_argument("--format", default="auto", help="trace format (default: detect)")
    g.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="skip and count malformed rows instead of failing on the first",
    )
    g.add_argument(
        "--window",
        default=None,
        metavar="START:END",
        help="keep requests arriving in [START, END) seconds (END may be empty); seconds "
        "from the file's own first arrival (for a slice, the slice's start)",
    )
    g.add_argument(
        "--preroll",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --window: the requests of this stretch before it warm the prefix cache "
        "before the replay, never measured (default: enough to cover the window's prefix "
        "references; 0: none)",
    )
    g.add_argument(
        "--spread-ticks",
        action="store_true",
        help="spread requests that arrive in one clock tick (jitter within 50 ms included) "
        "uniformly over the tick (seeded; for coarse clocks such as the Mooncake conversation "
        "trace's 3 s ticks)",
    )
    g.add_argument(
        "--tick-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the tick to spread over (default: detected, as trace inspect reports it)",
    )
    g.add_argument(
        "--sample",
        type=float,
        default=None,
        metavar="FRACTION",
        help="keep this share of requests (seeded)",
    )
    g.add_argument(
        "--compress",
        type=float,
        default=None,
        metavar="FACTOR",
        help="divide inter-arrival times by FACTOR",
    )
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="compress (or stretch) the trace to last SECONDS",
    )
    _add_scales(g)


def _add_scales(g: argparse._ArgumentGroup) -> None:
    """The shaping options that scale rates and lengths, and the clip."""
    g.add_argument("--rate-scale", type=float, default=None, help="multiply the request rate")
    g.add_argument(
        "--length-scale", type=float, default=None, help="multiply input and output lengths"
    )
    g.add_argument(
        "--output-scale",
        type=float,
        default=None,
        help="multiply output lengths by this instead (prompts by --length-scale, if given)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="clip lengths so input + output fits this context",
    )
    g.add_argument("--max-output-tokens", type=int, default=None, help="cap output lengths")
    g.add_argument(
        "--seed", type=int, default=0, help="seed for sampling, tick spreading and prompts"
    )


def shape_spec_from(ns: argparse.Namespace) -> Any:
    """Build a ShapeSpec from the shaping options."""
    from optimizer.workload.shaping import ShapeSpec

    window = None
    if ns.window:
        start, sep, end = ns.window.partition(":")
        try:
            window = (float(start or 0), float(end) if end else None)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"--window {ns.window!r}: expected START:END in seconds, e.g. 0:600")
    return ShapeSpec(
        window_s=window,
        preroll_s=ns.preroll,
        spread_ticks=ns.spread_ticks,
        tick_s=ns.tick_s,
        sample_fraction=ns.sample,
        compress=ns.compress,
        target_duration_s=ns.duration,
        rate_scale=ns.rate_scale,
        length_scale=ns.length_scale,
        output_scale=ns.output_scale,
        max_model_len=ns.max_model_len,
        max_output_tokens=ns.max_output_tokens,
        seed=ns.seed,
    )


def load_shaped_trace(ns: argparse.Namespace) -> tuple[Any, list[str]]:
    """Read, then shape, the trace the options name; returns it and report lines."""
    from optimizer.workload.formats import read_trace
    from optimizer.workload.shaping import shape

    trace, report = read_trace(ns.trace, ns.format, skip_bad_rows=ns.skip_bad_rows)
    lines = [report.summary()]
    shaped, reports = shape(trace, shape_spec_from(ns))
    lines += [r.summary() for r in reports]
    return shaped, lines


def cmd_trace_inspect(ns: argparse.Namespace) -> int:
    from optimizer.workload.formats import read_trace
    from optimizer.workload.stats import inspect_trace, render_inspect

    trace, report = read_trace(ns.trace, ns.format, skip_bad_rows=ns.skip_bad_rows)
    stats = inspect_trace(trace)
    if ns.json:
        print(json.dumps({"stats": stats, "read": report.summary()}, indent=2, sort_keys=True))
    else:
        console.print(report.summary())
        console.print(render_inspect(stats))
    return 0


def cmd_trace_convert(ns: argparse.Namespace) -> int:
    from optimizer.workload.formats import export_vllm_custom, write_trace
    from optimizer.workload.stats import inspect_trace, render_inspect

    trace, lines = load_shaped_trace(ns)
    for line in lines:
        console.print(line)
    if ns.to == "vllm-custom":
        bench_args = export_vllm_custom(trace, ns.out, seed=ns.seed)
        console.print(f"wrote {ns.out}; replay it with: vllm bench serve {' '.join(bench_args)}")
    else:
        write_trace(trace, ns.out)
        console.print(f"wrote {len(trace)} requests to {ns.out}")
    if trace.preroll:
        console.print(
            f"not written: the window's pre-roll ({len(trace.preroll)} requests); replay the "
            "original file with --window to have it, or --preroll 0 to say it is not wanted"
        )
    console.print(render_inspect(inspect_trace(trace), title="Converted trace"))
    return 0


def _summary_table(summary: dict[str, float], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("mean", justify="right")
    table.add_column("p50", justify="right")
    table.add_column("p95", justify="right")
    table.add_column("p99", justify="right")
    for fam, label in (
        ("ttft", "TTFT (ms)"),
        ("ttft_from_scheduled", "TTFT from schedule (ms)"),
        ("tpot", "TPOT (ms)"),
        ("itl", "ITL (ms)"),
        ("e2el", "E2EL (ms)"),
        ("send_lag", "send lag (ms)"),
    ):
        cells = [summary.get(f"{k}_{fam}_ms", float("nan")) for k in ("mean", "p50", "p95", "p99")]
        table.add_row(label, *(f"{v:.1f}" for v in cells))
    return table


def cmd_replay(ns: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from objectives import parse_slo
    from optimizer.workload.replay import ReplayProgress

    if bool(ns.url) == bool(ns.model):
        raise ConfigError("give exactly one of --url (a running server) or --model (start one)")
    slos = [parse_slo(s) for s in ns.slo]
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    trace, lines = load_shaped_trace(ns)
    for line in lines:
        console.print(f"[dim]{line}[/]")
    if len(trace) == 0:
        raise ConfigError(f"{ns.trace}: no request left after shaping")
    served = ns.served_model or ns.model
    token_range = _replay_token_range(ns, served)

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        console=console,
        # Rendering holds the GIL: a slow refresh keeps the replay's send lag low.
        refresh_per_second=2,
    ) as bar:
        task = bar.add_task("replay", total=len(trace), detail="")

        def on_progress(p: ReplayProgress) -> None:
            bar.update(
                task,
                completed=p.completed + p.failed,
                detail=f"sent {p.sent} in-flight {p.in_flight} failed {p.failed}",
            )

        def on_engine_start() -> None:
            bar.update(task, detail="starting the engine ...")

        outcome: tuple[dict[str, Any], bool, str] | None
        if ns.url:
            outcome = _replay_at_url(ns, trace, served, token_range, slos, out, on_progress)
        else:
            outcome = _replay_on_engine(ns, trace, token_range, out, on_progress, on_engine_start)
        if outcome is None:
            return 1
    summary, kept, message = outcome
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    console.print(_summary_table(summary, f"replay of {len(trace)} requests"))
    console.print(
        f"completed {summary['completed']}  failed {summary['failed']}  "
        f"duration {summary['duration_s']:.1f} s  output {summary['output_throughput']:.1f} tok/s  "
        f"requests {summary['request_throughput']:.2f}/s"
        + (f"  goodput {summary['request_goodput']:.2f}/s" if "request_goodput" in summary else "")
    )
    console.print(f"wrote {out / 'summary.json'} and {out / 'records.jsonl.gz'}")
    return _replay_exit_code(ns, summary, out, kept, message)


def _replay_token_range(ns: argparse.Namespace, served: str | None) -> tuple[int, int]:
    """The token ids prompts use: --token-range, else the server's or the model's vocabulary."""
    from optimizer.engine.defaults import prompt_token_range

    explicit = None
    if ns.token_range:
        low, _, high = ns.token_range.partition(":")
        explicit = (int(low), int(high))
    if explicit is None and ns.url:
        # A running server: its own vocabulary (model folder it names, else probed).
        from optimizer.workload.served import served_token_range

        if not served:
            raise ConfigError("--url needs --served-model (the model name the server serves)")
        found, how = served_token_range(ns.url, served)
        console.print(f"[dim]prompts use {how}[/]")
        return (found.low, found.high)
    return prompt_token_range(ns.model, explicit)


def _replay_at_url(
    ns: argparse.Namespace,
    trace: Any,
    served: str,
    token_range: tuple[int, int],
    slos: list[Any],
    out: Path,
    on_progress: Any,
) -> tuple[dict[str, Any], bool, str]:
    """Replay against the running server at --url: (summary, schedule kept, message)."""
    from objectives import summarize
    from optimizer.trial import boost_priority, write_records
    from optimizer.workload.prompts import TokenRange
    from optimizer.workload.replay import run_replay

    if ns.boost_priority:
        boost_priority()  # the client keeps its schedule even when the server is busy
    result = run_replay(
        trace,
        ns.url,
        served,
        vocab=TokenRange(*token_range),
        seed=ns.seed,
        warmup_requests=ns.warmup,
        max_duration_s=ns.max_duration,
        progress=on_progress,
    )
    summary = dict(summarize(result.records, slos=slos))
    write_records(result.records, out / "records.jsonl.gz")
    return summary, result.schedule_kept, result.message


def _replay_on_engine(
    ns: argparse.Namespace,
    trace: Any,
    token_range: tuple[int, int],
    out: Path,
    on_progress: Any,
    on_start: Any,
) -> tuple[dict[str, Any], bool, str] | None:
    """Start --model, replay against it, stop it: (summary, kept, message); None: it failed."""
    from optimizer.trial import run_trial
    from optimizer.types import TrialSpec, TrialStatus

    config, notes = engine_config_for(
        ns.model,
        parse_engine_args(ns.engine_arg),
        python=ns.python,
        kv_cache_gib=ns.kv_cache_gib,
    )
    for note in notes:
        console.print(f"[dim]{note}[/]")
    on_start()
    spec = TrialSpec(
        number=0,
        engine=config,
        trace=trace,
        workdir=str(out),
        token_range=token_range,
        seed=ns.seed,
        warmup_requests=ns.warmup,
        max_duration_s=ns.max_duration,
        slos=tuple(ns.slo),
        python=ns.python,
    )
    trial = run_trial(spec, progress=on_progress)
    if trial.status is TrialStatus.FAILED:
        err_console.print(f"[bold red]engine failed: {trial.failure_class}[/]\n{trial.message}")
        for line in trial.log_lines[:8]:
            err_console.print(f"  [dim]{line[:240]}[/]")
        return None
    summary = dict(trial.summary)
    if trial.startup_s:
        summary["startup_s"] = trial.startup_s
    return summary, trial.status is TrialStatus.COMPLETE, trial.message


def _replay_exit_code(
    ns: argparse.Namespace, summary: dict[str, Any], out: Path, kept: bool, message: str
) -> int:
    """4: too many measured requests failed; 3: the schedule was not kept; else 0."""
    failed, completed = int(summary["failed"]), int(summary["completed"])
    if failed and (not completed or failed / (failed + completed) > ns.max_error_rate):
        from collections import Counter

        from optimizer.trial_io import read_records

        try:
            records = read_records(out / "records.jsonl.gz")
        except OSError:
            records = []
        errors = Counter(r.error for r in records if r.error and not r.warmup)
        worst = "; ".join(f"{n} x {e}" for e, n in errors.most_common(3)) or "see the records"
        err_console.print(
            f"[bold red]{failed} of {failed + completed} measured requests failed[/] "
            f"(error rate {failed / (failed + completed):.1%}, limit {ns.max_error_rate:.1%} "
            f"set by --max-error-rate): {worst}"
        )
        return 4
    if not kept:
        err_console.print(f"[bold yellow]the client could not keep the schedule:[/] {message}")
        return 3
    return 0


def _job_with_overrides(ns: argparse.Namespace) -> tuple[Any, Any]:
    """The job file, with --trials, --budget, --until, --ray-address, --storage, --out and
    --seed over it (--out relative to the working directory, as paths on a command line are)."""
    from optimizer.config import load_job

    overrides: dict[str, Any] = {}
    job, base = load_job(ns.job)
    if ns.trials is not None:
        overrides["trials"] = ns.trials
    if ns.budget is not None:
        overrides["budget"] = ns.budget
    if ns.until is not None:
        overrides["until"] = ns.until
    if ns.ray_address is not None:
        overrides["ray_address"] = ns.ray_address
    if ns.out is not None:
        overrides["out"] = str(Path(ns.out).resolve())
    if ns.seed is not None:
        overrides["sampler"] = {**job.sampler.model_dump(), "seed": ns.seed}
    storage = ns.storage or (None if job.storage else os.environ.get("VLLM_AUTOTUNE_STORAGE"))
    if storage:
        overrides["storage"] = storage
    if overrides:
        job, base = load_job({**job.model_dump(), **overrides}, base=base)
    return job, base


def _finished_trial_line(number: int, r: Any, trial: Any = None) -> str:
    """One line for a finished trial: status, then its capacity or its latencies, which SLO it
    missed, then timings."""
    s = r.summary
    text = f"[cyan]trial {number}[/] {r.status.value}"
    if r.failure_class:
        text += f" ({r.failure_class.value})"
    cap = r.capacity
    if cap and cap.get("raced_out"):
        text += f": {r.message}"
    elif cap and not cap.get("rps"):
        text += f": capacity 0: {r.message}"
    elif cap:
        from optimizer.trial_view import CapacityView

        text += (
            f": capacity {CapacityView.from_doc(cap).rps_text()} "
            f"(rate x{cap.get('scale', 0):.3g}, {len(cap.get('steps') or [])} steps"
            + (f"; above it {cap['broke_first']} broke" if cap.get("broke_first") else "")
            + ")"
        )
    elif s.get("completed"):
        text += (
            f": p95 TTFT {s.get('p95_ttft_ms', float('nan')):.0f} ms, "
            f"p95 TPOT {s.get('p95_tpot_ms', float('nan')):.1f} ms, "
            f"{s.get('output_throughput', 0):.1f} tok/s"
        )
    text += _slo_note(trial)
    if r.startup_s:
        text += f"  [dim](startup {r.startup_s:.0f} s, replay {r.replay_s or 0:.0f} s)[/]"
    return text


def _study_progress_line(driver: Any, elapsed: float) -> str:
    """The study's counts, time spent and left, front size and best values."""
    from optimizer.report import study_status

    st = study_status(driver.study)
    left = driver.budget_left()
    best = ", ".join(f"{k} {v:,.1f}" for k, v in st.best.items()) or "-"
    return (
        f"  [dim]done {st.done} running {st.running} failed {st.failed} "
        f"infeasible {st.infeasible} | elapsed {elapsed / 60:.1f} min"
        + (f", budget left {left.total_seconds() / 60:.0f} min" if left is not None else "")
        + f" | front {st.front_size} | best {best}[/]"
    )


def cmd_tune(ns: argparse.Namespace) -> int:
    from optimizer.report import front_table
    from optimizer.study import prepare
    from optimizer.study_driver import StudyDriver, StudyEvent

    job, base = _job_with_overrides(ns)
    with console.status("checking the job against the installed vLLM ..."):
        plan = prepare(job, base)
    console.print(
        f"study [bold]{job.name}[/] -> {plan.out}  ({plan.vllm}; storage {plan.storage_url})"
    )
    if plan.priors.trials:
        console.print(
            f"[dim]warm start: the sampler is given {len(plan.priors.trials)} told trials of "
            "the earlier studies as prior observations[/]"
        )
    for w in plan.warm_start:
        console.print(
            f"[dim]warm start: {escape(w.folder)} trial {w.trial} ({escape(w.measured)}) "
            f"enqueued: {escape(json.dumps(w.args, sort_keys=True))}[/]"
        )
    for note in plan.notes:
        console.print(f"[yellow]{escape(note)}[/]")
    for note in plan.trace_notes:
        console.print(f"[dim]{note}[/]")
    t0 = time.monotonic()
    runner = cli_support.make_runner(ns.runner, plan, job.ray_address)
    driver: StudyDriver | None = None

    def on_event(ev: StudyEvent) -> None:
        elapsed = time.monotonic() - t0
        if ev.kind == "started":
            console.print(f"[cyan]trial {ev.number}[/] started: {ev.detail}")
        elif ev.kind == "progress":
            console.print(f"[dim]trial {ev.number}: {ev.detail}[/]")
        elif ev.kind == "finished" and ev.result is not None:
            r = ev.result
            console.print(_finished_trial_line(ev.number, r, ev.trial))
            if r.message and r.status.value != "complete":
                console.print(f"  [dim]{r.message[:300]}[/]")
        elif ev.kind in ("rejected", "retry", "stale", "enqueued", "enqueue_refused", "exhausted"):
            console.print(_event_line(ev))
        if driver is not None and ev.kind in ("finished", "rejected"):
            console.print(_study_progress_line(driver, elapsed))

    try:
        driver = StudyDriver(plan, runner, on_event=on_event)
        tracker = _tracker_for(plan, ns)
        if tracker is not None:
            driver.on_event = _chain(on_event, tracker.on_event)
        study = driver.run()
        if tracker is not None and tracker.finish(study) and tracker.experiment_id:
            from optimizer.tracking import review_url

            console.print(
                f"[dim]MLflow runs table: {review_url(tracker.target, tracker.experiment_id)}[/]"
            )
    finally:
        runner.close()
    console.print(front_table(study))
    from optimizer.analysis.capacity import capacity_answer

    job_cap = plan.job.capacity
    _print_capacity(
        capacity_answer(
            study,
            peak_rps=ns.peak_rps if ns.peak_rps is not None else job_cap.peak_rps,
            gpu_hour_price=(
                ns.gpu_hour_price if ns.gpu_hour_price is not None else job_cap.gpu_hour_price
            ),
            cpu_build=plan.context.cpu_build,
        )
    )
    _stability_stage(plan, ns)
    console.print(f"study folder: {plan.out}  (vllm-autotune show {plan.out})")
    return 0


def _stability_stage(plan: Any, ns: argparse.Namespace) -> None:
    """The job's ``stability.after_study``: the stability check of the configuration export
    would pick, run once the study's servers are down (its exit status is not tune's:
    ``export --require-stable`` is the gate)."""
    if not plan.job.stability.after_study:
        return
    from optimizer.stability_check.command import check_study

    console.print("[bold]Stability check[/] (the job's stability.after_study)")
    saved, study = cli_support.load_study_dir(Path(plan.out))
    try:
        check_study(
            Path(plan.out),
            saved,
            study,
            plan.job.stability.options(),
            mlflow=not getattr(ns, "no_mlflow", False),
        )
    except ConfigError as exc:  # no trial to check, no capacity: the study itself stands
        err_console.print(f"[yellow]stability check not run:[/] {escape(str(exc))}")


def _slo_note(trial: Any) -> str:
    """ "  SLOs met" / "  ✗SLO missed: p95_tpot_ms<=50" for a measured trial ("" otherwise)."""
    from optimizer.trial_view import TrialView

    if trial is None or not TrialView(trial).measured:
        return ""
    verdicts = {k: v for k, v in TrialView(trial).slo_verdicts().items() if k != "engine_served"}
    missed = [k for k, ok in verdicts.items() if not ok]
    if not verdicts:
        return ""
    return "  [yellow]✗SLO missed: " + ", ".join(missed) + "[/]" if missed else "  SLOs met"


def _event_line(ev: Any) -> str:
    """A study event that is not a trial's start or end, as the tune console prints it."""
    if ev.kind == "enqueue_refused":
        return f"[yellow]enqueue: not run[/]: {ev.detail[:400]}"
    if ev.kind == "exhausted":
        return f"[yellow]no new configuration proposed[/]: {ev.detail[:400]}"
    return f"[yellow]trial {ev.number} {ev.kind}[/]: {ev.detail[:300]}"


def _chain(*handlers: Any) -> Any:
    def call(ev: Any) -> None:
        for h in handlers:
            h(ev)

    return call


def _tracker_for(plan: Any, ns: argparse.Namespace) -> Any:
    if getattr(ns, "no_mlflow", False) or not plan.job.mlflow.enabled:
        return None
    from optimizer import tracking

    tracker = tracking.tracker_for_plan(plan)
    if tracker is not None:
        console.print(
            f"[dim]MLflow: experiment {tracker.target.experiment!r} at "
            f"{tracking.ui_command(tracker.target)}[/]"
        )
    return tracker


def cmd_show(ns: argparse.Namespace) -> int:
    from optimizer.analysis.capacity import answer_for_plan, study_json
    from optimizer.report import front_table, status_table

    plan, study = cli_support.load_study_dir(Path(ns.dir))
    answer = answer_for_plan(study, plan, peak_rps=ns.peak_rps, gpu_hour_price=ns.gpu_hour_price)
    if ns.json:
        print(json.dumps(study_json(study, plan, answer), indent=2, default=str))
        return 0
    console.print(status_table(study))
    console.print(front_table(study))
    _print_capacity(answer)
    _print_trial_cost(study)
    return 0


def _print_trial_cost(study: Any) -> None:
    """Where the trials' time went: replaying vs starting servers, and the start's phases."""
    from optimizer.analysis.trial_cost import study_cost

    lines = study_cost(study.get_trials(deepcopy=False)).lines()
    if lines:
        console.print("[bold]Trial time[/]")
        for line in lines:
            console.print(f"  {line}")


def _print_capacity(answer: Any) -> None:
    """The capacity answer under the tables (capacity studies only)."""
    if answer is None:
        return
    console.print("[bold]Capacity at SLO[/] (how much of this traffic one server carries)")
    for line in answer.lines():
        console.print(f"  {line}")


def cmd_mlflow_sync(ns: argparse.Namespace) -> int:
    from optimizer.tracking import sync_study

    try:
        with console.status("logging the study to MLflow ..."):
            summary = sync_study(ns.dir, tracking_uri=ns.tracking_uri, experiment=ns.experiment)
    except AutotuneError:
        raise
    except Exception as exc:  # MLflow unreachable or refusing: say so, no traceback
        err_console.print(f"[bold red]MLflow sync failed:[/] {type(exc).__name__}: {exc}")
        return 1
    console.print(
        f"MLflow: {summary.trials} trials, {summary.created} runs created, {summary.updated} "
        f"updated, {summary.duplicates_deleted} duplicates deleted; parent run "
        f"{summary.parent_run_id}; Pareto front {list(summary.front)}"
    )
    console.print(f"runs table: {summary.runs_url}")
    return 0


# --- wiring -----------------------------------------------------------------------------------


def _add_model_commands(sub: Any) -> None:
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


def _add_trace_commands(sub: Any) -> None:
    """trace inspect / convert, and replay: traces and one measurement."""
    tr = sub.add_parser("trace", help="inspect and convert traces").add_subparsers(
        dest="trace_cmd", required=True
    )
    p = tr.add_parser("inspect", help="rate, burstiness, lengths and prefix reuse of a trace")
    p.add_argument("trace")
    p.add_argument("--format", default="auto")
    p.add_argument("--skip-bad-rows", action="store_true")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_trace_inspect)
    p = tr.add_parser("convert", help="import (and shape) a trace into canonical JSONL")
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument(
        "--to",
        default="canonical",
        choices=["canonical", "vllm-custom"],
        help="canonical JSONL, or vLLM's custom dataset for `vllm bench serve`",
    )
    _add_shaping(p)
    p.set_defaults(func=cmd_trace_convert)

    p = sub.add_parser(
        "replay", help="replay a trace open-loop against a vLLM server and measure it"
    )
    p.add_argument("--trace", required=True)
    p.add_argument("--url", default=None, help="a running server's base URL")
    p.add_argument("--served-model", default=None, help="model name the server serves (with --url)")
    p.add_argument("--model", default=None, help="start a server for this model folder or name")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--python", default=None)
    p.add_argument("--kv-cache-gib", type=int, default=None)
    p.add_argument(
        "--token-range",
        default=None,
        metavar="LOW:HIGH",
        help="token ids prompts may use (default: from the model folder, or asked of the "
        "server with --url)",
    )
    p.add_argument("--warmup", type=int, default=0, help="leading requests excluded from metrics")
    p.add_argument("--max-duration", type=float, default=None, help="stop the replay after SECONDS")
    p.add_argument("--slo", action="append", default=[], help="e.g. p95_ttft_ms<=500 (for goodput)")
    p.add_argument("--out", required=True, help="folder for records.jsonl.gz and summary.json")
    p.add_argument(
        "--max-error-rate",
        type=float,
        default=0.01,
        help="exit with status 4 when more than this share of measured requests failed "
        "(or all of them did); default 0.01",
    )
    p.add_argument(
        "--boost-priority",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="raise the client's CPU priority when it can (with --url); turn it off to "
        "compare with a client running at normal priority",
    )
    _add_shaping(p)
    p.set_defaults(func=cmd_replay)


def _add_study_commands(sub: Any) -> None:
    """tune, export, show, mlflow-sync: a study and what comes of it."""
    p = sub.add_parser("tune", help="run (or resume) a tuning study from a job file")
    p.add_argument("job", help="job YAML file")
    p.add_argument("--trials", type=int, default=None, help="override the job's trial count")
    p.add_argument("--budget", default=None, help="stop launching after e.g. 8h or 90m")
    p.add_argument("--until", default=None, help="stop launching at local time HH:MM")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster")
    p.add_argument(
        "--out", default=None, help="study folder (default: the job's out); e.g. a repeat's own"
    )
    p.add_argument("--seed", type=int, default=None, help="override the sampler's seed")
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL (default: the job's, else $VLLM_AUTOTUNE_STORAGE, "
        "else SQLite in the study folder)",
    )
    p.add_argument(
        "--runner",
        default="ray",
        choices=["ray", "local"],
        help="ray: one actor per trial pinned to its GPUs (default); local: in-process",
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    cli_support.add_capacity_pricing(p)
    p.set_defaults(func=cmd_tune)

    from optimizer.export.command import register as register_export

    register_export(sub)

    p = sub.add_parser("show", help="trials and the Pareto front of a study folder")
    p.add_argument("dir")
    p.add_argument(
        "--json", action="store_true", help="one JSON document: every trial, the front, capacity"
    )
    cli_support.add_capacity_pricing(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "mlflow-sync", help="(re)build the MLflow view of a study folder from its Optuna storage"
    )
    p.add_argument("dir", help="study folder")
    p.add_argument(
        "--tracking-uri", default=None, help="log here (default: the study's, or DIR/mlflow.db)"
    )
    p.add_argument("--experiment", default=None, help="experiment name (default: the study's)")
    p.set_defaults(func=cmd_mlflow_sync)


def build_parser() -> argparse.ArgumentParser:
    """The vllm-autotune command line: one sub-command per job."""
    parser = argparse.ArgumentParser(
        prog="vllm-autotune",
        description="Find the vLLM engine configuration that serves your real traffic best.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_model_commands(sub)
    _add_trace_commands(sub)
    _add_study_commands(sub)
    from optimizer.service.client import register as register_service

    register_service(sub)
    from optimizer.stability_check.command import register as register_stability

    register_stability(sub)
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
