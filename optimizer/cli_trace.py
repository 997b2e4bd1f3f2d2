"""``vllm-autotune trace inspect``, ``trace convert`` and ``replay``: a trace read and shaped by
the shaping options every trace command shares, and one measured replay (against a running
server, or a server started for it) with its exit status.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from optimizer.cli_engine import engine_config_for, parse_engine_args
from optimizer.cli_support import console, err_console
from optimizer.errors import ConfigError

__all__ = ["load_shaped_trace", "register", "shape_spec_from"]


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


def register(sub: Any) -> None:
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
