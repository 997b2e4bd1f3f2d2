"""Export a validated winner: pick from the Pareto front, re-measure, write deployment files.

A "best" configuration measured once is often not the best once deployed (noise, arrival
order), so export is three steps:

1. **Select** a trial from the feasible Pareto front by an explicit policy (``max-throughput``
   subject to the study's SLOs by default, ``min-ttft``, ``min-tpot``, ``knee``, ``weighted``,
   or an explicit trial number); ties go to the configuration that changes fewer defaults.
2. **Re-validate** (on by default): the chosen configuration and the baseline run again N times,
   alternating, with fresh prompts on the same hardware; the median and spread of each objective
   and the gain over the baseline with its range are reported, and export is refused when the
   gain is within the noise or an SLO fails on a re-run (unless forced).
3. **Render** for the target: ``vllm-config`` (YAML for ``vllm serve --config``, kebab-case keys,
   DESIGN.md §7.4), ``vllm-cli``, ``kubernetes`` (Deployment + Service), ``helm`` (values of
   vLLM's production-stack chart) or ``ray-serve`` (a Serve config for ``ray.serve.llm``). Every
   file opens with a header: study, trial, vLLM version and hardware, trace, measured gain.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shlex
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from optimizer.errors import ConfigError
from optimizer.report import changed_args
from optimizer.types import TrialResult, TrialSpec, TrialStatus

__all__ = [
    "FORMATS",
    "POLICIES",
    "ExportContext",
    "Validation",
    "changed_args",
    "helm_schema_problems",
    "primary_metrics",
    "render",
    "select_trial",
    "trace_label",
    "validate_choice",
]

POLICIES = (
    "max-throughput",
    "max-capacity",
    "min-ttft",
    "min-tpot",
    "knee",
    "weighted",
    "trial",
)
FORMATS = ("vllm-config", "vllm-cli", "kubernetes", "helm", "ray-serve")

# The values contract of vLLM's production-stack chart for the keys the helm exporter writes.
HELM_SCHEMA = Path(__file__).with_name("schemas") / "production-stack-values.schema.json"

# Flags that describe where a server runs, not how it serves: never exported.
_LOCAL_ONLY = frozenset({"load-format", "host", "port", "kv-cache-memory-bytes"})


def _args(trial: FrozenTrial) -> dict[str, Any]:
    raw = trial.user_attrs.get("engine_args")
    return dict(json.loads(raw)) if isinstance(raw, str) else {}


def _feasible(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def _metric_index(study: optuna.Study, metric: str) -> int:
    names = list(study.metric_names or [])
    if metric not in names:
        raise ConfigError(
            f"this study has no objective {metric!r} (objectives: {', '.join(names) or 'unnamed'})"
        )
    return names.index(metric)


def _knee(front: list[FrozenTrial], directions: Sequence[StudyDirection]) -> FrozenTrial:
    """The front point closest to the ideal point after min-max normalization."""
    values = [[float(v) for v in (t.values or ())] for t in front]
    normalized = []
    for j, d in enumerate(directions):
        col = [v[j] for v in values]
        lo, hi = min(col), max(col)
        span = (hi - lo) or 1.0
        # 0 = best, 1 = worst, whatever the direction.
        normalized.append(
            [((c - lo) / span) if d == StudyDirection.MINIMIZE else ((hi - c) / span) for c in col]
        )
    dist = [
        math.sqrt(sum(normalized[j][i] ** 2 for j in range(len(directions))))
        for i in range(len(front))
    ]
    return front[dist.index(min(dist))]


def default_policy(study: optuna.Study) -> str:
    """``max-capacity`` for a capacity study, ``max-throughput`` otherwise."""
    return "max-capacity" if "capacity_rps" in (study.metric_names or []) else "max-throughput"


def select_trial(
    study: optuna.Study,
    policy: str = "max-throughput",
    *,
    trial_number: int | None = None,
    weights: Mapping[str, float] | None = None,
) -> FrozenTrial:
    """Pick the configuration to export.

    Args:
        study: The study.
        policy: One of :data:`POLICIES`.
        trial_number: With ``trial``: the trial to export.
        weights: With ``weighted``: objective name -> weight; the score is the weighted sum of
            objectives normalized over the front (higher is better).

    Raises:
        ConfigError: Unknown policy, no feasible trial, or an unusable trial number.
    """
    trials = study.get_trials(deepcopy=False)
    # Ties: fewer changes against the baseline, feasible or not (its effective settings say
    # which flags are vLLM's own defaults).
    baseline = next((t for t in trials if t.user_attrs.get("baseline")), None)
    if policy == "trial":
        if trial_number is None or not 0 <= trial_number < len(trials):
            raise ConfigError(f"--trial {trial_number}: no such trial (0..{len(trials) - 1})")
        chosen = trials[trial_number]
        if chosen.state != TrialState.COMPLETE or chosen.user_attrs.get("status") != "complete":
            raise ConfigError(
                f"trial {trial_number} did not complete a measurement: nothing to export"
            )
        return chosen
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}")
    front = [t for t in study.best_trials if _feasible(t)]
    if not front:
        raise ConfigError(
            "no trial meets every SLO: nothing to export (relax the SLOs or tune longer)"
        )

    def fewer_changes(t: FrozenTrial) -> int:
        return len(changed_args(t, baseline))

    def best_by(metric: str, maximize: bool) -> FrozenTrial:
        i = _metric_index(study, metric)
        sign = -1.0 if maximize else 1.0
        return min(
            front, key=lambda t: (sign * float((t.values or [])[i]), fewer_changes(t), t.number)
        )

    if policy == "max-throughput":
        return best_by("output_throughput", maximize=True)
    if policy == "max-capacity":
        return best_by("capacity_rps", maximize=True)
    if policy == "min-ttft":
        return best_by("p95_ttft_ms", maximize=False)
    if policy == "min-tpot":
        return best_by("p95_tpot_ms", maximize=False)
    if policy == "knee":
        return _knee(sorted(front, key=lambda t: (fewer_changes(t), t.number)), study.directions)
    if not weights:
        raise ConfigError("the weighted policy needs weights, e.g. --weight output_throughput=2")
    names = list(study.metric_names or [])
    unknown = [k for k in weights if k not in names]
    if unknown:
        raise ConfigError(
            f"weights for unknown objectives {unknown}; objectives: {', '.join(names)}"
        )

    def score(t: FrozenTrial) -> float:
        total = 0.0
        for j, (name, d) in enumerate(zip(names, study.directions, strict=True)):
            col = [float((f.values or [])[j]) for f in front]
            lo, hi = min(col), max(col)
            x = (float((t.values or [])[j]) - lo) / ((hi - lo) or 1.0)
            total += weights.get(name, 0.0) * (1.0 - x if d == StudyDirection.MINIMIZE else x)
        return total

    return max(front, key=lambda t: (score(t), -fewer_changes(t), -t.number))


# --- re-validation ----------------------------------------------------------------------------


@dataclass
class Validation:
    """Re-measurements of the chosen configuration and the baseline.

    Attributes:
        metrics: Objective names.
        directions: Their directions.
        chosen: Per objective, the values of the chosen configuration's runs.
        baseline: Per objective, the baseline's values.
        slo_failures: Runs of the chosen configuration that missed an SLO (or failed).
        slo_met: Per label (``chosen``, ``baseline``), whether each measured run met every SLO.
    """

    metrics: list[str]
    directions: list[StudyDirection]
    chosen: dict[str, list[float]] = field(default_factory=dict)
    baseline: dict[str, list[float]] = field(default_factory=dict)
    slo_failures: list[str] = field(default_factory=list)
    slo_met: dict[str, list[bool]] = field(default_factory=lambda: {"chosen": [], "baseline": []})

    def slo_win(self) -> bool:
        """True when the chosen configuration met the SLOs in every re-run and the baseline in
        none: a separation no noise explains, whatever the objectives' medians say."""
        chosen, base = self.slo_met["chosen"], self.slo_met["baseline"]
        return bool(chosen) and bool(base) and all(chosen) and not any(base)

    def gain_pct(self, metric: str) -> tuple[float, float, float]:
        """Median gain over the baseline and its range (worst, best), in percent."""
        d = self.directions[self.metrics.index(metric)]
        sign = -1.0 if d == StudyDirection.MINIMIZE else 1.0
        base = statistics.median(self.baseline[metric])
        if base == 0:
            return (math.nan, math.nan, math.nan)

        def g(v: float, b: float) -> float:
            return sign * (v - b) / abs(b) * 100.0

        med = g(statistics.median(self.chosen[metric]), base)
        # The range pits the chosen's worst run against the baseline's best, and vice versa.
        worst_c = max(self.chosen[metric]) if sign < 0 else min(self.chosen[metric])
        best_c = min(self.chosen[metric]) if sign < 0 else max(self.chosen[metric])
        worst_b = max(self.baseline[metric]) if sign < 0 else min(self.baseline[metric])
        best_b = min(self.baseline[metric]) if sign < 0 else max(self.baseline[metric])
        return med, g(worst_c, best_b), g(best_c, worst_b)

    def within_noise(self, metric: str, min_gain_pct: float = 1.0) -> bool:
        """True when the re-runs do not separate the two: the gain's worst pairing (the
        chosen's worst run against the baseline's best) is below ``min_gain_pct``. A gain must
        be both real and worth deploying; a consistent 0.05% is neither."""
        _med, low, _high = self.gain_pct(metric)
        return not low > min_gain_pct

    def problems(self, primary: Sequence[str]) -> list[str]:
        """Why an export should be refused: no primary objective gained beyond the noise of
        the re-runs (a load-bound objective that cannot move does not veto a real gain
        elsewhere), or an SLO failed on a re-run. Empty when the export may go ahead."""
        out = []
        if all(self.within_noise(m) for m in primary):
            # Meeting SLOs the baseline always missed is a gain of its own, unless it was paid
            # for with a primary objective that got worse in every pairing.
            worse = [m for m in primary if self.gain_pct(m)[2] < -1.0]
            if not self.slo_win():
                out.append(f"the gain on {', '.join(primary)} is within the noise of the re-runs")
            elif worse:
                out.append(
                    "the SLOs are met where the baseline missed them, but "
                    + ", ".join(f"{m} is worse in every pairing" for m in worse)
                )
        if self.slo_failures:
            out.append("SLOs failed on re-run: " + "; ".join(self.slo_failures))
        return out

    def gain_text(self) -> str:
        """One line for export headers: each objective's median gain and its range."""
        runs = min(len(v) for v in self.chosen.values())

        def one(r: dict[str, Any]) -> str:
            if r["baseline_median"] == 0 and not math.isfinite(r["gain_pct"]):
                # A capacity of 0 (or any zero baseline) has no percentage: say the values.
                lo, hi = r["chosen_range"]
                return f"{r['metric']} {r['chosen_median']:.3g} ({lo:.3g}..{hi:.3g}) vs 0"
            return "{} {:+.1f}% ({:+.1f}%..{:+.1f}%)".format(
                r["metric"], r["gain_pct"], *r["gain_range_pct"]
            )

        return (
            "; ".join(one(r) for r in self.table())
            + f" vs baseline, {runs} re-runs each"
            + (
                f"; SLOs met in {sum(self.slo_met['chosen'])}/{len(self.slo_met['chosen'])}"
                f" re-runs (baseline {sum(self.slo_met['baseline'])}"
                f"/{len(self.slo_met['baseline'])})"
                # Only news when some run missed them (a study without SLOs meets them all).
                if not all(self.slo_met["chosen"] + self.slo_met["baseline"])
                else ""
            )
        )

    def table(self) -> list[dict[str, Any]]:
        """Rows for display: medians, spreads and gains."""
        rows = []
        for m in self.metrics:
            med, low, high = self.gain_pct(m)
            rows.append(
                {
                    "metric": m,
                    "baseline_median": statistics.median(self.baseline[m]),
                    "baseline_range": [min(self.baseline[m]), max(self.baseline[m])],
                    "chosen_median": statistics.median(self.chosen[m]),
                    "chosen_range": [min(self.chosen[m]), max(self.chosen[m])],
                    "gain_pct": med,
                    "gain_range_pct": [low, high],
                }
            )
        return rows


_PRIMARY = {
    "max-throughput": "output_throughput",
    "max-capacity": "capacity_rps",
    "min-ttft": "p95_ttft_ms",
    "min-tpot": "p95_tpot_ms",
}


def primary_metrics(policy: str, metrics: Sequence[str]) -> list[str]:
    """The objectives a policy's choice must improve: its own one, else all of them."""
    own = _PRIMARY.get(policy)
    return [own] if own is not None and own in metrics else list(metrics)


def validate_choice(
    run: Callable[[TrialSpec], TrialResult],
    make_spec: Callable[[str, dict[str, Any], int], TrialSpec],
    chosen_args: dict[str, Any],
    baseline_args: dict[str, Any],
    *,
    metrics: list[str],
    directions: list[StudyDirection],
    values: Callable[[Mapping[str, float]], list[float]],
    feasible: Callable[[Mapping[str, float]], bool],
    runs: int = 3,
    retries: int = 2,
    progress: Callable[[str], None] | None = None,
) -> Validation:
    """Re-run the chosen configuration and the baseline ``runs`` times each, alternating.

    Args:
        run: Runs one trial spec to completion (a runner's submit + wait, or run_trial).
        make_spec: (label, engine args, run index) -> spec with a fresh seed.
        chosen_args: The chosen configuration.
        baseline_args: The baseline configuration.
        metrics: Objective names.
        directions: Their directions.
        values: Summary -> objective values.
        feasible: Summary -> all SLOs met.
        runs: Re-runs of each.
        retries: Extra attempts for a run whose replay could not keep its schedule.
        progress: Called with a line per finished run.
    """
    val = Validation(
        metrics=metrics,
        directions=directions,
        chosen={m: [] for m in metrics},
        baseline={m: [] for m in metrics},
    )
    for k in range(runs):
        # Alternate so slow drift of the machine hits both alike.
        for label, args, bucket in (
            ("baseline", baseline_args, val.baseline),
            ("chosen", chosen_args, val.chosen),
        ):
            # A replay the client could not keep on schedule is re-run, never scored (as in
            # the study); each attempt gets fresh prompts.
            for attempt in range(retries + 1):
                result = run(make_spec(label, args, k + 100 * attempt))
                if result.status is not TrialStatus.INVALID_REPLAY:
                    break
            ok = result.status is TrialStatus.COMPLETE
            if ok:
                for m, v in zip(metrics, values(result.summary), strict=True):
                    bucket[m].append(v)
                val.slo_met[label].append(bool(feasible(result.summary)))
            if label == "chosen" and (not ok or not feasible(result.summary)):
                val.slo_failures.append(
                    f"run {k + 1}: {result.status.value}"
                    + (f" ({result.failure_class.value})" if result.failure_class else "")
                    + ("" if not ok else ": an SLO was missed")
                )
            if progress:
                progress(f"{label} run {k + 1}/{runs}: {result.status.value}")
    missing = [m for m in metrics if not val.chosen[m] or not val.baseline[m]]
    if missing:
        raise ConfigError(f"re-validation measured nothing for {missing}: see the trial logs")
    return val


# --- rendering --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportContext:
    """What every export says about where its numbers come from.

    Attributes:
        study: Study name.
        trial: Trial number.
        model: Model path or name.
        args: Engine arguments to deploy (flag names).
        vllm: vLLM distribution and version tuned on.
        hardware: GPU (or CPU) it was tuned on.
        trace: The trace and shaping.
        gain: One line: the measured gain and its range.
        gpus: GPUs one server needs.
        env: Environment to carry into the deployment (secrets excluded).
        capacity: Capacity studies: how much of the trace this configuration carried within
            the SLOs, beside the baseline (``CapacityAnswer.export_line``).
    """

    study: str
    trial: int
    model: str
    args: dict[str, Any]
    vllm: str
    hardware: str
    trace: str
    gain: str
    gpus: int = 1
    env: dict[str, str] = field(default_factory=dict)
    capacity: str = ""

    def header(self, comment: str = "#") -> str:
        lines = [
            f"Exported by vllm-autotune from study '{self.study}', trial {self.trial}.",
            f"Tuned on: {self.vllm}; hardware: {self.hardware}.",
            f"Trace: {self.trace}",
            f"Measured: {self.gain}",
        ]
        if self.capacity:
            lines.append(f"Capacity at SLO: {self.capacity}")
        return "\n".join(f"{comment} {ln}" for ln in lines) + "\n"

    def deploy_args(self) -> dict[str, Any]:
        return {k: v for k, v in self.args.items() if k not in _LOCAL_ONLY and v is not None}


def _cli_words(args: Mapping[str, Any]) -> list[str]:
    words: list[str] = []
    for name, value in args.items():
        if value is True:
            words.append(f"--{name}")
        elif value is False:
            words.append(f"--no-{name}")
        elif isinstance(value, dict):
            words += [f"--{name}", json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, list | tuple):
            words += [f"--{name}", *(str(v) for v in value)]
        else:
            words += [f"--{name}", str(value)]
    return words


def _vllm_config(ctx: ExportContext) -> str:
    # kebab-case keys: `vllm serve --config` drops a snake_case `false` (DESIGN.md §7.4).
    body = {"model": ctx.model, **ctx.deploy_args()}
    return ctx.header() + yaml.safe_dump(body, sort_keys=False, default_flow_style=False)


def _vllm_cli(ctx: ExportContext) -> str:
    words = ["vllm", "serve", ctx.model, *_cli_words(ctx.deploy_args())]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in ctx.env.items())
    return ctx.header() + (env + " " if env else "") + shlex.join(words) + "\n"


def _name(ctx: ExportContext) -> str:
    """A DNS-1123 label from the study name (Kubernetes object and Helm model names)."""
    text = "".join(c if c.isascii() and c.isalnum() else "-" for c in f"vllm-{ctx.study}".lower())
    return re.sub(r"-+", "-", text)[:50].strip("-")


def _kubernetes(ctx: ExportContext) -> str:
    name = _name(ctx)
    resources = {"limits": {"nvidia.com/gpu": ctx.gpus}, "requests": {"nvidia.com/gpu": ctx.gpus}}
    container = {
        "name": "vllm",
        "image": "vllm/vllm-openai:latest",
        "args": ["--model", ctx.model, *_cli_words(ctx.deploy_args())],
        "ports": [{"containerPort": 8000, "name": "http"}],
        "env": [{"name": k, "value": str(v)} for k, v in ctx.env.items()],
        "resources": resources,
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": 8000},
            "initialDelaySeconds": 60,
            "periodSeconds": 10,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": 8000},
            "initialDelaySeconds": 600,
            "periodSeconds": 30,
        },
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [container]},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": 8000, "targetPort": "http"}]},
    }
    return ctx.header() + yaml.safe_dump_all([deployment, service], sort_keys=False)


# Fields of the production-stack chart's servingEngineSpec.modelSpec[].vllmConfig, with the
# type the chart's values schema gives them.
_HELM_KNOWN: dict[str, tuple[str, type]] = {
    "max-model-len": ("maxModelLen", int),
    "tensor-parallel-size": ("tensorParallelSize", int),
    "gpu-memory-utilization": ("gpuMemoryUtilization", float),
    "dtype": ("dtype", str),
    "enable-chunked-prefill": ("enableChunkedPrefill", bool),
    "enable-prefix-caching": ("enablePrefixCaching", bool),
    "max-num-seqs": ("maxNumSeqs", int),
}


def _helm_typed(value: Any, kind: type) -> Any:
    """``value`` converted to the chart field's type, or None when it is not one (``8k``,
    ``nan``, a bool for a number). Ranges are the contract's: see :func:`_helm_field_holds`."""
    if kind is bool:
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return None
    if kind is str:
        return value if isinstance(value, str) else None
    try:
        number = float(value)
        typed = int(number) if kind is int else kind(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(number) or (kind is int and number != typed):
        return None
    return typed


@functools.cache
def _helm_contract() -> tuple[dict[str, Any], Any]:
    """The bundled values contract and its JSON Schema validator class (read once)."""
    import jsonschema

    schema = json.loads(HELM_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return schema, cls


def _helm_field_holds(field: str, value: Any) -> bool:
    """True when the contract's ``vllmConfig.<field>`` accepts ``value`` (its type and range,
    e.g. ``maxModelLen >= 1``: vLLM's ``-1`` auto-fit is a CLI spelling, not a chart value)."""
    schema, cls = _helm_contract()
    return bool(cls(schema["$defs"]["vllmConfig"]["properties"][field]).is_valid(value))


def _helm(ctx: ExportContext) -> str:
    args = ctx.deploy_args()
    vllm_config: dict[str, Any] = {}
    extra: list[str] = []
    for k, v in args.items():
        field, kind = _HELM_KNOWN.get(k, ("", object))
        typed = _helm_typed(v, kind) if field else None
        if typed is not None and _helm_field_holds(field, typed):
            vllm_config[field] = typed
        else:  # no chart field, or a spelling only vLLM's CLI understands: pass it through
            extra += _cli_words({k: v})
    if extra:
        vllm_config["extraArgs"] = extra
    values = {
        "servingEngineSpec": {
            "modelSpec": [
                {
                    "name": _name(ctx),
                    "repository": "vllm/vllm-openai",
                    "tag": "latest",
                    "modelURL": ctx.model,
                    "replicaCount": 1,
                    "requestGPU": ctx.gpus,
                    "vllmConfig": vllm_config,
                    "env": [{"name": k, "value": str(v)} for k, v in ctx.env.items()],
                }
            ]
        }
    }
    problems = helm_schema_problems(values)
    if problems:  # the exporter's own contract: a bug here, reported without a traceback
        raise ConfigError(
            "the helm values break the exporter's chart contract (please report this): "
            + "; ".join(problems)
        )
    return ctx.header() + yaml.safe_dump(values, sort_keys=False)


def _json_path(parts: Sequence[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def helm_schema_problems(values: Any, schema_path: Path | None = None) -> list[str]:
    """Where ``values`` breaks a Helm chart's ``values.schema.json`` (JSON Schema).

    Args:
        values: Parsed Helm values.
        schema_path: A chart's ``values.schema.json`` (e.g. from ``helm pull --untar``); the
            bundled production-stack contract (:data:`HELM_SCHEMA`) when None.

    Returns:
        One line per violation, ``path.to[0].key: message``; empty when valid.

    Raises:
        ConfigError: The schema file is missing, not JSON, or not a valid JSON Schema.
    """
    import jsonschema

    if schema_path is None:
        schema, cls = _helm_contract()
    else:
        try:
            schema = json.loads(Path(schema_path).read_text())
        except OSError as exc:
            raise ConfigError(
                f"{schema_path}: cannot read the chart schema ({exc.strerror})"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{schema_path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg}); give the chart's "
                "values.schema.json"
            ) from exc
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ConfigError(f"{schema_path}: not a valid JSON Schema: {exc.message}") from exc
    errors = sorted(cls(schema).iter_errors(values), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_json_path(list(e.absolute_path))}: {e.message}" for e in errors]


def trace_label(plan_doc: Mapping[str, Any]) -> str:
    """How an export header names the trace: the file's name and the replayed request count
    (not the tuning machine's path)."""
    trace = str(plan_doc.get("trace") or "?")
    label = Path(trace).name if trace != "?" else trace
    n = plan_doc.get("requests")
    return f"{label}, {n} requests replayed" if n else label


def _accelerator_type(hardware: str) -> str | None:
    """Ray's accelerator type from e.g. "1x NVIDIA H200 (140 GiB)" -> "H200"."""
    m = re.search(r"NVIDIA\s+([A-Za-z]+\d+[A-Za-z]*)", hardware)
    return m.group(1) if m else None


def _ray_serve(ctx: ExportContext, *, unknown_flags: Sequence[str] = ()) -> str:
    kwargs = {}
    for k, v in ctx.deploy_args().items():
        # engine_kwargs are EngineArgs fields: snake_case; the model is model_loading_config's.
        kwargs[k.replace("-", "_")] = v
    llm_config = {
        "model_loading_config": {"model_id": _name(ctx), "model_source": ctx.model},
        "accelerator_type": _accelerator_type(ctx.hardware) if ctx.gpus else None,
        "engine_kwargs": kwargs,
        "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        "runtime_env": {"env_vars": dict(ctx.env)} if ctx.env else None,
    }
    llm_config = {k: v for k, v in llm_config.items() if v is not None}
    app = {
        "applications": [
            {
                "name": _name(ctx),
                "route_prefix": "/",
                "import_path": "ray.serve.llm:build_openai_app",
                "args": {"llm_configs": [llm_config]},
            }
        ]
    }
    warn = "".join(
        f"# WARNING: --{f} is not known to the vLLM that ray[llm] pins; check it.\n"
        for f in unknown_flags
    )
    return ctx.header() + warn + yaml.safe_dump(app, sort_keys=False)


def render(fmt: str, ctx: ExportContext, *, unknown_flags: Sequence[str] = ()) -> str:
    """The export file's text for ``fmt`` (one of :data:`FORMATS`).

    Raises:
        ConfigError: Unknown format.
    """
    if fmt == "vllm-config":
        return _vllm_config(ctx)
    if fmt == "vllm-cli":
        return _vllm_cli(ctx)
    if fmt == "kubernetes":
        return _kubernetes(ctx)
    if fmt == "helm":
        return _helm(ctx)
    if fmt == "ray-serve":
        return _ray_serve(ctx, unknown_flags=unknown_flags)
    raise ConfigError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")


def default_filename(fmt: str) -> str:
    """File name an export gets when ``--out`` is not given."""
    return {
        "vllm-config": "vllm-config.yaml",
        "vllm-cli": "vllm-serve.sh",
        "kubernetes": "kubernetes.yaml",
        "helm": "helm-values.yaml",
        "ray-serve": "ray-serve.yaml",
    }[fmt]


def write_export(text: str, path: Path) -> Path:
    """Write an export file (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
