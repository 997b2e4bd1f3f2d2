"""Render a configuration for a deployment target, with a header that says where it came from.

``vllm-config`` (YAML for ``vllm serve --config``, kebab-case keys, DESIGN.md §7.4),
``vllm-cli``, ``kubernetes`` (Deployment + Service), ``helm`` (values of vLLM's
production-stack chart, checked against its values contract) or ``ray-serve`` (a Serve config
for ``ray.serve.llm``). Every file opens with a header: study, trial, vLLM version and hardware,
trace, measured gain.

Names and paths are data, never structure: every document is written by a serializer
(``yaml.safe_dump``, ``json.dumps``, ``shlex.quote`` for the script), never pasted into a
template, and every comment line goes through :func:`_comments`, which escapes control
characters (a model path with a newline stays one comment line, not a second YAML document or
shell command).
"""

from __future__ import annotations

import functools
import json
import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from optimizer.errors import ConfigError
from optimizer.text import escape_controls, text_problem
from search_spaces.speculation import synthetic_assumption, without_synthetic

__all__ = [
    "CPU_IMAGE",
    "DEPLOY_FORMATS",
    "FORMATS",
    "GPU_IMAGE",
    "Deployment",
    "ExportContext",
    "check_deployment",
    "default_filename",
    "helm_schema_problems",
    "render",
    "trace_label",
    "write_export",
]

FORMATS = ("vllm-config", "vllm-cli", "kubernetes", "helm", "ray-serve")
#: Formats that run somewhere else than the tuning machine: model, image and GPUs are asked.
DEPLOY_FORMATS = ("kubernetes", "helm", "ray-serve")

#: vLLM's published images (docs.vllm.ai, "Using Docker"): the CUDA one and the x86 CPU one.
GPU_IMAGE = "vllm/vllm-openai:latest"
CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:latest"

# The values contract of vLLM's production-stack chart for the keys the helm exporter writes.
HELM_SCHEMA = Path(__file__).parent.parent / "schemas" / "production-stack-values.schema.json"

# Flags that describe where a server runs, not how it serves: never exported.
_LOCAL_ONLY = frozenset({"load-format", "host", "port", "kv-cache-memory-bytes"})
# A name the script can export (POSIX shell variable names).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _comments(lines: Iterable[str], comment: str = "#") -> str:
    """Comment lines, one per item, each with its control characters escaped: no text given
    to a header or note can end its comment line and start a document or a command."""
    return "".join(f"{comment} {escape_controls(ln)}\n" for ln in lines)


@dataclass(frozen=True)
class Deployment:
    """Where a Kubernetes, Helm or Ray Serve export runs, as the user says (``export`` flags);
    None: the study's own value (see :class:`ExportContext`'s ``deploy_*``).

    Attributes:
        model: The model the deployment loads (hub name or a path inside the image).
        served_model_name: The name clients request (vLLM's ``--served-model-name``).
        image: Container image.
        gpus: GPUs per server (0: a CPU deployment).
    """

    model: str | None = None
    served_model_name: str | None = None
    image: str | None = None
    gpus: int | None = None


def check_deployment(deployment: Deployment) -> Deployment:
    """``deployment`` as given, once its names are plain text (:mod:`optimizer.text`): no
    control characters, at most 1024 characters.

    Raises:
        ConfigError: The flag whose value is not (``--model``, ``--served-model-name``,
            ``--image``), and what to fix.
    """
    for key in ("model", "served_model_name", "image"):
        value = getattr(deployment, key)
        problem = text_problem(value, 1024) if value is not None else None
        if problem is not None:
            raise ConfigError(f"--{key.replace('_', '-')}: {problem}")
    return deployment


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
        deployment: What the user set for a deployment format (model, name, image, GPUs).
        stored_as: The study's name in its Optuna storage where it differs from ``study``
            (the service stores a job's study as ``TEAM/JOB_ID``).
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
    python: str = "python3"
    notes: tuple[str, ...] = ()
    deployment: Deployment = field(default_factory=Deployment)
    stored_as: str = ""

    @property
    def tuned_on_cpu(self) -> bool:
        """The study ran on the CPU build (its hardware line says ``CPU (...)``)."""
        return self.hardware.startswith("CPU")

    @property
    def deploy_model(self) -> str:
        """The model a deployment loads: ``--model``, else the study's."""
        return self.deployment.model or self.model

    @property
    def deploy_gpus(self) -> int:
        """GPUs per server of a deployment: ``--gpus``, else 0 for a study tuned on a CPU, else
        the tuned configuration's (tensor x pipeline parallel)."""
        if self.deployment.gpus is not None:
            return self.deployment.gpus
        return 0 if self.tuned_on_cpu else self.gpus

    @property
    def deploy_image(self) -> str:
        """``--image``, else vLLM's CPU image for a server without GPUs, its CUDA image else."""
        return self.deployment.image or (CPU_IMAGE if self.deploy_gpus == 0 else GPU_IMAGE)

    def deploy_notes(self) -> list[str]:
        """What a deployment export must warn about (header and console): a study tuned on a
        CPU, a model that is the tuning machine's path or had no weights, defaults taken."""
        lines = []
        if self.tuned_on_cpu:
            lines.append(
                f"WARNING: this study ran on a CPU ({self.hardware}), with the CPU build of vLLM: "
                "its numbers and tuned values (max-num-seqs, token budgets, ...) describe that "
                "CPU, not a GPU. Tune again on the hardware you deploy to."
            )
        if self.deployment.model is None and _local_path(self.model):
            lines.append(
                f"Model: {self.model} is a path on the tuning machine; pass --model with the "
                "hub name or the path inside the image that the deployment loads."
            )
        if self.random_weights and self.deployment.model is None:
            lines.append(
                "Weights: the study served random weights (its model folder had none); deploy a "
                "model with real weights (--model)."
            )
        if self.deployment.image is None:
            kind = "CPU" if self.deploy_gpus == 0 else "CUDA"
            lines.append(f"Image: vLLM's {kind} image {self.deploy_image} (--image to change).")
        if self.deployment.gpus is None and self.tuned_on_cpu:
            lines.append(
                "Resources: no GPU requested, as tuned (--gpus N for a GPU deployment); set the "
                "CPU and memory requests your nodes need."
            )
        return lines

    @property
    def random_weights(self) -> bool:
        """Tuned with ``load-format: dummy``: the model folder had no weights."""
        return self.args.get("load-format") == "dummy"

    def local_args(self) -> dict[str, Any]:
        """Arguments for a server on the tuning machine (vllm-config, vllm-cli): the deployed
        ones, plus ``load-format: dummy`` when the study served random weights."""
        if self.random_weights:
            # As measured: the synthetic sampler stands in for the random weights' draft.
            return {"load-format": "dummy", **_served(self.args)}
        return self.deploy_args()

    def local_notes(self) -> list[str]:
        """What a user of a local export must know: random weights, the server environment."""
        lines = []
        if self.random_weights:
            lines.append(
                "Weights: the model folder has no weight files; the study served random "
                "weights (load-format: dummy). For real traffic, point the model at real "
                "weights and remove load-format."
            )
        if self.env:
            lines.append(
                "Server environment (set it before starting): "
                + " ".join(f"{k}={v}" for k, v in self.env.items())
            )
        return lines

    def header(self, comment: str = "#", *, deploy: bool = False) -> str:
        """The comment block every export opens with; ``deploy``: with :meth:`deploy_notes`."""
        stored = (
            f" (stored as '{self.stored_as}')"
            if self.stored_as and self.stored_as != self.study
            else ""
        )
        lines = [
            f"Exported by vllm-autotune from study '{self.study}'{stored}, trial {self.trial}.",
            f"Tuned on: {self.vllm}; hardware: {self.hardware}.",
            f"Trace: {self.trace}",
            f"Measured: {self.gain}",
        ]
        if self.capacity:
            lines.append(f"Capacity at SLO: {self.capacity}")
        assumed = synthetic_assumption(self.args)
        if assumed:
            kept = (
                "kept (this file starts a server on random weights, as measured)"
                if self.random_weights and not deploy
                else "left out here"
            )
            lines.append(
                f"ASSUMED: {assumed}. The synthetic sampler's keys are {kept}; the numbers "
                "hold for a real draft whose acceptance matches the stated one."
            )
        lines += [f"NOTE: {n}" for n in self.notes]
        if deploy:
            lines += self.deploy_notes()
        return _comments(lines, comment)

    def deploy_args(self) -> dict[str, Any]:
        """The tuned arguments a deployment runs: without tuning-machine-only flags and without
        the synthetic sampler that stood in for a real draft's acceptance."""
        return _served(without_synthetic(self.args))


def _served(args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments a server gets: tuning-machine-only flags and unset values left out."""
    return {k: v for k, v in args.items() if k not in _LOCAL_ONLY and v is not None}


def _local_path(model: str) -> bool:
    """True for a filesystem path (``/models/x``, ``./x``, ``~/x``), False for a hub name."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).is_absolute()


def _served_args(ctx: ExportContext) -> list[str]:
    name = ctx.deployment.served_model_name
    return ["--served-model-name", name] if name else []


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
    body = {"model": ctx.model, **ctx.local_args()}
    notes = _comments(ctx.local_notes())
    return ctx.header() + notes + yaml.safe_dump(body, sort_keys=False, default_flow_style=False)


def _vllm_cli(ctx: ExportContext) -> str:
    # The tuner's own launcher (optimizer.engine.process): `python -m ...api_server` runs with
    # the CPU build too, whose `vllm` console script does not; VLLM_PYTHON picks another Python.
    words = ["-m", "vllm.entrypoints.openai.api_server", "--model", ctx.model]
    words += _cli_words(ctx.local_args())
    notes = _comments(n for n in ctx.local_notes() if not n.startswith("Server env"))
    return (
        "#!/usr/bin/env bash\n"
        + ctx.header()
        + notes
        + "set -euo pipefail\n"
        + _shell_exports(ctx.env)
        # every value a quoted word: the Python's path is a variable's value, not script text
        + f"default_python={shlex.quote(ctx.python)}\n"
        + f'exec "${{VLLM_PYTHON:-$default_python}}" {shlex.join(words)} "$@"\n'
    )


def _shell_exports(env: Mapping[str, str]) -> str:
    """``export NAME='value'`` lines.

    Raises:
        ConfigError: A name that is not a shell variable name.
    """
    for key in env:
        if not _ENV_NAME.fullmatch(key):
            raise ConfigError(
                f"engine.env: {escape_controls(key[:80])!r} is not an environment variable "
                "name (letters, digits and _); the script cannot export it"
            )
    return "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())


def _name(ctx: ExportContext) -> str:
    """A DNS-1123 label from the study name (Kubernetes object and Helm model names)."""
    text = "".join(c if c.isascii() and c.isalnum() else "-" for c in f"vllm-{ctx.study}".lower())
    return re.sub(r"-+", "-", text)[:50].strip("-")


def _kubernetes(ctx: ExportContext) -> str:
    name = _name(ctx)
    gpus = ctx.deploy_gpus
    container: dict[str, Any] = {
        "name": "vllm",
        "image": ctx.deploy_image,
        "args": ["--model", ctx.deploy_model, *_served_args(ctx), *_cli_words(ctx.deploy_args())],
        "ports": [{"containerPort": 8000, "name": "http"}],
        "env": [{"name": k, "value": str(v)} for k, v in ctx.env.items()],
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
    if gpus:
        container["resources"] = {
            "limits": {"nvidia.com/gpu": gpus},
            "requests": {"nvidia.com/gpu": gpus},
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
    return ctx.header(deploy=True) + yaml.safe_dump_all([deployment, service], sort_keys=False)


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
    extra = _served_args(ctx) + extra
    if extra:
        vllm_config["extraArgs"] = extra
    repository, tag = _image_parts(ctx.deploy_image)
    values = {
        "servingEngineSpec": {
            "modelSpec": [
                {
                    "name": _name(ctx),
                    "repository": repository,
                    "tag": tag,
                    "modelURL": ctx.deploy_model,
                    "replicaCount": 1,
                    "requestGPU": ctx.deploy_gpus,
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
    return ctx.header(deploy=True) + yaml.safe_dump(values, sort_keys=False)


def _image_parts(image: str) -> tuple[str, str]:
    """``repo/name:tag`` -> (``repo/name``, ``tag``); no tag: ``latest``."""
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:  # no tag, or the colon was a registry's port
        return image, "latest"
    return name, tag


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
        "model_loading_config": {
            "model_id": ctx.deployment.served_model_name or _name(ctx),
            "model_source": ctx.deploy_model,
        },
        "accelerator_type": _accelerator_type(ctx.hardware) if ctx.deploy_gpus else None,
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
    warn = _comments(
        f"WARNING: --{f} is not accepted by the vLLM that ray[llm] pins; check it."
        for f in unknown_flags
    )
    return ctx.header(deploy=True) + warn + yaml.safe_dump(app, sort_keys=False)


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
    if text.startswith("#!"):
        path.chmod(0o755)  # a script: runnable as written
    return path
