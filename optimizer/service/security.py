"""What a submitter may ask of the service: engine flags, environment, paths, document shape.

The service runs other people's jobs as its own user, so a job is data, never code. This module
holds the allow-lists and limits that make it so; :class:`~optimizer.service.facade.JobService`
applies them at submit time and again before an export (a study stored before a rule existed is
refused, not exported). A local ``tune`` run is its user's own: none of this applies to it.

- **Engine flags**: only flags that change performance, with values of a checked shape
  (:data:`SERVICE_FLAGS`: the presets' tuning flags and their peers). A flag that loads code,
  plugins, templates or files (``*-plugin``, ``--chat-template``, ``--tokenizer``,
  ``--download-dir``, ``--config``, ``--trust-remote-code``, ...) is not on the list and is
  refused with 422 naming it. ``speculative-config`` takes only the n-gram method's keys (a
  draft model would be a path).
- **Environment**: an allow-list (:data:`SERVICE_ENV`), each value of a checked shape (no
  paths).
- **Documents**: :func:`parse_document` reads JSON or YAML of at most :data:`MAX_BODY_BYTES`
  with its cost bounded during the parse (values counted before a JSON body is parsed and
  while a YAML body's events are read, no YAML aliases: nothing is expanded, bounded
  nesting), then bounded string and container sizes; every error is a
  :class:`~optimizer.errors.ConfigError` (422, 413 above the size) that quotes none of the
  body.
- **Paths**: :func:`under` resolves a path (symlinks included) and says whether it lies under
  one of the operator's roots; it is asked before anything is read, so an answer never says
  whether a file outside the roots exists. :func:`is_hub_name` says whether a model name is a
  hub repository id (``ORG/NAME``), the only other kind of model the service may serve.
- **Traces**: :func:`check_trace_size` counts a trace's rows (lines, decompressed) before it
  is parsed, against the operator's row limit.
- **Text**: every key and string of a submitted job is plain text (:func:`check_text`, one
  rule at submission, keys the service replaces and unknown keys included), and so are a
  stored job's (:func:`check_stored_study`).
- **Study folders**: the service marks each study folder it creates (:data:`STUDY_MARKER`);
  :func:`is_service_study` recognises one (marked, or laid out as the service lays them out),
  and :func:`check_stored_study` refuses what the service would, so ``vllm-autotune export``
  on the command line applies the same policy to it as the service's own export.
- **Redaction**: the one rule for secrets: :func:`is_secret` names the environment variables
  whose values are secrets (never shown by the API, never carried into an export);
  :func:`redact_job` and :func:`redact_url` mask them, URL passwords and secret query
  parameters (``?password=``, ``?sslpassword=``, ``?token=``, ...) wherever a team reads
  them: the API's study detail, and the review files and ``plan.json`` the study's MLflow
  run holds (:mod:`optimizer.tracking`).
"""

from __future__ import annotations

import difflib
import gzip
import json
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus, urlsplit

import yaml

from optimizer.errors import ConfigError, SubmissionRefused
from optimizer.text import escape_controls, surrogate_problem, tree_problem

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_CONTAINER_ITEMS",
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_STRING",
    "SERVICE_ENV",
    "SERVICE_FLAGS",
    "STUDY_MARKER",
    "check_engine_args",
    "check_env",
    "check_space",
    "check_stored_study",
    "check_text",
    "check_trace_size",
    "is_hub_name",
    "is_secret",
    "is_service_study",
    "mark_service_study",
    "parse_document",
    "redact_job",
    "redact_url",
    "under",
]

# --- engine flags -----------------------------------------------------------------------------

#: A value check: None when fine, else what is wrong (never quoting a long value).
Check = Callable[[Any], "str | None"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(low: int, high: int) -> Check:
    def check(v: Any) -> str | None:
        if not _is_int(v) or not low <= v <= high:
            return f"an integer from {low} to {high}"
        return None

    return check


def _float(low: float, high: float) -> Check:
    def check(v: Any) -> str | None:
        ok = (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and low <= v <= high
        return None if ok else f"a number from {low} to {high}"

    return check


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _choice(*values: str) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v in values else f"one of {', '.join(values)}"

    return check


_SPEC_KEYS: dict[str, Check] = {
    "method": _choice("ngram"),
    "num_speculative_tokens": _int(1, 16),
    "prompt_lookup_min": _int(1, 64),
    "prompt_lookup_max": _int(1, 64),
}


def _speculative(v: Any) -> str | None:
    """n-gram speculation only: any other method names a draft model (a path or a download)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return "a mapping of n-gram speculation keys"
    if not isinstance(v, dict):
        return "a mapping of n-gram speculation keys"
    for key, value in v.items():
        check = _SPEC_KEYS.get(key)
        if check is None:
            return f"a mapping with only the keys {', '.join(_SPEC_KEYS)} (not {str(key)[:40]!r})"
        if value is not None and (problem := check(value)) is not None:
            return f"a mapping whose {key} is {problem}"
    return None


_GIB = 1024**3
#: Engine flags a submitter may set, each with its value check. Performance, never code: every
#: flag here takes a number, a boolean or a fixed word, none a path, module or template.
SERVICE_FLAGS: dict[str, Check] = {
    # the presets' tuning flags
    "max-num-seqs": _int(1, 65536),
    "max-num-batched-tokens": _int(1, 16 * 1024**2),
    "enable-chunked-prefill": _bool,
    "enable-prefix-caching": _bool,
    "gpu-memory-utilization": _float(0.01, 1.0),
    "max-model-len": _int(1, 16 * 1024**2),
    "block-size": _int(1, 4096),
    "kv-cache-dtype": _choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"),
    "quantization": _choice("fp8"),
    "enforce-eager": _bool,
    "speculative-config": _speculative,
    "tensor-parallel-size": _int(1, 64),
    "pipeline-parallel-size": _int(1, 64),
    # their peers: scheduling, memory, parallelism
    "data-parallel-size": _int(1, 64),
    "enable-expert-parallel": _bool,
    "long-prefill-token-threshold": _int(0, 16 * 1024**2),
    "scheduling-policy": _choice("fcfs", "priority"),
    "async-scheduling": _bool,
    "num-gpu-blocks-override": _int(1, 2**31 - 1),
    "kv-cache-memory-bytes": _int(1, 16 * 1024 * _GIB),
    "cpu-offload-gb": _float(0, 4096),
    "max-cudagraph-capture-size": _int(1, 65536),
    "disable-custom-all-reduce": _bool,
    "disable-cascade-attn": _bool,
    "disable-sliding-window": _bool,
    "dtype": _choice("auto", "half", "float16", "bfloat16", "float", "float32"),
    "load-format": _choice("auto", "dummy", "safetensors", "pt"),
    "distributed-executor-backend": _choice("mp", "uni", "ray"),
    "seed": _int(0, 2**32 - 1),
    "disable-log-stats": _bool,
    "max-logprobs": _int(0, 1024),
}


def _flag_name(raw: str) -> tuple[str, bool]:
    """``--max_num_seqs`` -> (``max-num-seqs``, False); ``no-enforce-eager`` -> (..., True)."""
    name = str(raw).lstrip("-").replace("_", "-")
    if name.startswith("no-") and name[3:] in SERVICE_FLAGS:
        return name[3:], True
    return name, False


def check_engine_arg(raw: str, value: Any, where: str) -> None:
    """One flag and its value against :data:`SERVICE_FLAGS`.

    Raises:
        ConfigError: The flag is not on the list (named, with the closest listed one) or its
            value has the wrong shape.
    """
    name, negated = _flag_name(raw)
    check = SERVICE_FLAGS.get(name)
    label = f"{where}.{escape_controls(str(raw)[:80])}"
    if check is None:
        close = difflib.get_close_matches(name, list(SERVICE_FLAGS), n=1, cutoff=0.75)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{label}: the service does not accept the engine flag "
            f"--{escape_controls(name[:80])}{hint} "
            "(it accepts only flags that change performance, not code or files: "
            f"{', '.join(SERVICE_FLAGS)})"
        )
    if value is None:
        return
    problem = _bool(value) if negated else check(value)
    if problem is not None:
        raise ConfigError(f"{label}: --{name} must be {problem}")


def check_engine_args(args: Mapping[str, Any] | None, where: str = "engine.args") -> None:
    """Every flag of ``args`` (see :func:`check_engine_arg`)."""
    for raw, value in (args or {}).items():
        check_engine_arg(raw, value, where)


# --- environment ------------------------------------------------------------------------------


def _pattern(regex: str, what: str) -> Check:
    compiled = re.compile(regex)

    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and compiled.fullmatch(v) else what

    return check


_BIT = _pattern(r"[01]", "0 or 1")
_COUNT = _pattern(r"[0-9]{1,6}", "a whole number")
_SECRET_TOKEN = _pattern(r"[A-Za-z0-9_-]{1,256}", "a token (letters, digits, _ and -)")
#: Environment variables a submitter may give the server, each with its value check. None of
#: them names a file, a module or a plugin (``VLLM_PLUGINS``, ``OPENSSL_CONF``, ``HF_HOME``,
#: ``LD_*``, ``PYTHON*`` and everything else are refused).
SERVICE_ENV: dict[str, Check] = {
    "VLLM_CPU_KVCACHE_SPACE": _COUNT,
    "VLLM_CPU_OMP_THREADS_BIND": _pattern(
        r"auto|nobind|[0-9,|-]{1,200}", "auto, nobind or CPU ids"
    ),
    "VLLM_CPU_NUM_OF_RESERVED_CPU": _COUNT,
    "OMP_NUM_THREADS": _COUNT,
    "MKL_NUM_THREADS": _COUNT,
    "VLLM_LOGGING_LEVEL": _pattern(r"DEBUG|INFO|WARNING|ERROR|CRITICAL", "a logging level"),
    "VLLM_ATTENTION_BACKEND": _pattern(r"[A-Z0-9_]{1,64}", "a backend name"),
    "VLLM_USE_V1": _BIT,
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": _BIT,
    "VLLM_ENABLE_V1_MULTIPROCESSING": _BIT,
    "VLLM_WORKER_MULTIPROC_METHOD": _pattern(r"spawn|fork", "spawn or fork"),
    "VLLM_NO_USAGE_STATS": _BIT,
    "DO_NOT_TRACK": _BIT,
    "TOKENIZERS_PARALLELISM": _pattern(r"true|false", "true or false"),
    "HF_HUB_OFFLINE": _BIT,
    "HF_TOKEN": _SECRET_TOKEN,
    "HUGGING_FACE_HUB_TOKEN": _SECRET_TOKEN,
    "NCCL_P2P_DISABLE": _BIT,
    "NCCL_IB_DISABLE": _BIT,
    "NCCL_DEBUG": _pattern(r"VERSION|WARN|INFO", "VERSION, WARN or INFO"),
    "CUDA_DEVICE_MAX_CONNECTIONS": _COUNT,
    "PYTORCH_CUDA_ALLOC_CONF": _pattern(r"[A-Za-z0-9_:,.]{1,128}", "allocator options"),
}


def check_env(env: Mapping[str, Any] | None, where: str = "engine.env") -> None:
    """Every variable of ``env`` against :data:`SERVICE_ENV`.

    Raises:
        ConfigError: A variable not on the list (named) or a value of the wrong shape.
    """
    for key, value in (env or {}).items():
        check = SERVICE_ENV.get(str(key))
        name = escape_controls(str(key)[:80])
        if check is None:
            raise ConfigError(
                f"{where}.{name}: the service does not pass this variable to servers (it "
                f"accepts only: {', '.join(SERVICE_ENV)})"
            )
        problem = check(value)
        if problem is not None:
            raise ConfigError(f"{where}.{name}: must be {problem}")


def check_space(space: Any, where: str = "search_space") -> None:
    """Every flag a search space can set (fixed flags, params and their whole domains).

    Args:
        space: A loaded :class:`~search_spaces.schema.SearchSpace`.

    Raises:
        ConfigError: A flag or a value the service does not accept.
    """
    dotted: dict[str, dict[str, list[Any]]] = {}
    items: list[tuple[str, list[Any]]] = [(n, [v]) for n, v in space.fixed.items()]
    items += [(n, list(p.domain())) for n, p in space.params.items()]
    for name, values in items:
        top, dot, key = name.partition(".")
        if dot:
            dotted.setdefault(top, {})[key] = values
            continue
        for value in values:
            check_engine_arg(name, value, f"{where}.{'fixed' if name in space.fixed else 'params'}")
    for top, keys in dotted.items():
        for key, values in keys.items():
            for value in values:
                check_engine_arg(top, {key: value}, f"{where}.params")


# --- documents --------------------------------------------------------------------------------

#: Deepest nesting of a submitted document (a job nests about 7 levels).
MAX_DEPTH = 32
#: Longest string anywhere in a submitted document (an uploaded trace's base64 is exempt: the
#: body size limit bounds it).
MAX_STRING = 64 * 1024
#: Most items of one list or mapping.
MAX_CONTAINER_ITEMS = 10_000
#: Most values in a whole document (a job holds a few hundred; a YAML body's keys count too,
#: before it is built): what building one may cost stays well under a second, as PyYAML's
#: constructor takes about 5 microseconds a value.
MAX_NODES = 20_000


#: Largest JSON or YAML body of a submission (the multipart ``job`` part too); a larger trace
#: is sent as a multipart ``trace`` part, which streams to disk. With the node count below it
#: bounds what parsing a body may cost (well under a second and 100 MiB).
MAX_BODY_BYTES = 4 * 1024**2

#: The loader of submitted YAML: libyaml's (C), else PyYAML's own. Either is a safe loader
#: (no Python objects are built).
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


class _Refused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _yaml_position(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


_STARTS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_ENDS = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _check_yaml_events(text: str) -> None:
    """Walk the YAML parser's events (no document is built) and refuse, as soon as one is
    met: an alias (nothing is ever expanded), nesting deeper than :data:`MAX_DEPTH`, or more
    than :data:`MAX_NODES` values and keys together. The parse stops there: a body of a
    million empty mappings costs its first 20,000 (a few hundredths of a second), never the
    million objects."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        kind = type(event)
        if kind is yaml.ScalarEvent:
            nodes += 1
        elif kind in _STARTS:
            nodes += 1
            depth += 1
            if depth > MAX_DEPTH:
                raise _Refused(f"the document nests deeper than {MAX_DEPTH} levels")
        elif kind in _ENDS:
            depth -= 1
        elif kind is yaml.AliasEvent:
            mark = event.start_mark
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise _Refused(
                f"YAML aliases (*name, <<: *name) are not accepted{where}: write the values out"
            )
        if nodes > MAX_NODES:
            raise _Refused(f"the document has more than {MAX_NODES} values and keys")


def _check_json_size(data: bytes) -> None:
    """At most :data:`MAX_NODES` values in a JSON body, counted before it is parsed: every
    value but the first of a container follows a comma, so the values are at most the commas,
    brackets and braces, plus one (those inside strings only make the count safe)."""
    bound = data.count(b",") + data.count(b"[") + data.count(b"{") + 1
    if bound > MAX_NODES:
        raise _Refused(
            f"the document has more than {MAX_NODES} values (counted as its commas, brackets "
            "and braces)"
        )


def _load(text: str, data: bytes, json_body: bool) -> Any:
    """The document, its cost bounded before (JSON) or while (YAML) it is parsed."""
    if json_body:
        _check_json_size(data)
        return json.loads(text)
    _check_yaml_events(text)
    return yaml.load(text, Loader=_YAML_LOADER)  # a safe loader: no Python objects


def parse_document(data: bytes, *, json_body: bool, exempt: Iterable[tuple[str, ...]] = ()) -> Any:
    """A JSON or YAML body -> its document, within the limits of this module.

    What parsing may cost is bounded before anything is built: at most
    :data:`MAX_BODY_BYTES`, at most :data:`MAX_NODES` values (counted before a JSON body is
    parsed, while a YAML body's events are read), no YAML alias, no nesting deeper than
    :data:`MAX_DEPTH`; then string and container sizes (:func:`check_limits`).

    Args:
        data: The body.
        json_body: JSON (else YAML, of which JSON is a subset).
        exempt: Key paths whose strings may be longer than :data:`MAX_STRING`.

    Raises:
        ConfigError: Not UTF-8, not parseable, a YAML alias, or over a limit. The message gives
            a position at most, never the body's content.
        SubmissionRefused: (413) More than :data:`MAX_BODY_BYTES`.
    """
    kind = "JSON" if json_body else "YAML"
    if len(data) > MAX_BODY_BYTES:
        raise SubmissionRefused(
            f"the job body is larger than {MAX_BODY_BYTES} bytes: send a large trace as a "
            "multipart `trace` part",
            status=413,
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the body is not UTF-8 text (byte {exc.start})") from None
    try:
        doc = _load(text, data, json_body)
    except _Refused as exc:
        raise ConfigError(f"the body is refused: {exc.message}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"the body is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"the body is not valid YAML{_yaml_position(exc)}") from None
    except RecursionError:
        raise ConfigError(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, OverflowError, TypeError) as exc:
        # e.g. an integer of more digits than Python converts, a date out of range
        raise ConfigError(
            f"the body is not valid {kind}: a value out of range ({type(exc).__name__})"
        ) from None
    check_limits(doc, exempt=exempt)
    return doc


def check_limits(doc: Any, *, exempt: Iterable[tuple[str, ...]] = ()) -> None:
    """Bounded depth, string size, container size and node count (iterative: no recursion);
    and every key and string text at all: no lone surrogate (``"\ud800"`` in JSON), which no
    answer, note or stored record could hold (:func:`optimizer.text.surrogate_problem`).

    Raises:
        ConfigError: The first limit passed, with the key path where (its control characters
            escaped).
    """
    exempt_paths = {tuple(p) for p in exempt}
    stack: list[tuple[Any, tuple[str, ...]]] = [(doc, ())]
    nodes = 0
    while stack:
        node, path = stack.pop()
        nodes += 1
        where = escape_controls(".".join(path)[:200]) or "(top level)"
        if nodes > MAX_NODES:
            raise ConfigError(f"the document has more than {MAX_NODES} values")
        if len(path) > MAX_DEPTH:
            raise ConfigError(f"{where}: the document nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, str):
            if len(node) > MAX_STRING and path not in exempt_paths:
                raise ConfigError(f"{where}: a string longer than {MAX_STRING} characters")
            if (problem := surrogate_problem(node)) is not None:
                raise ConfigError(f"{where}: {problem}")
        elif isinstance(node, dict):
            if len(node) > MAX_CONTAINER_ITEMS:
                raise ConfigError(f"{where}: more than {MAX_CONTAINER_ITEMS} keys")
            for key, value in node.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{where}: every key must be a string")
                if len(key) > 200:
                    raise ConfigError(f"{where}: a key longer than 200 characters")
                if (problem := surrogate_problem(key)) is not None:
                    raise ConfigError(f"{where}: a key {problem}")
                stack.append((value, (*path, key)))
        elif isinstance(node, list):
            if len(node) > MAX_CONTAINER_ITEMS:
                raise ConfigError(f"{where}: more than {MAX_CONTAINER_ITEMS} items")
            stack.extend((value, (*path, str(i))) for i, value in enumerate(node))


def check_text(job: Any) -> None:
    """Every key and string of a submitted job is plain text (:mod:`optimizer.text`): the one
    rule, applied at submission to the whole document, keys the service replaces (``out``,
    ``storage``, ``ray_address``, ``mlflow.tracking_uri``) and unknown keys included, so no
    answer, note or error ever carries one of its control characters or lone surrogates. Free
    prose (``description``) may hold control characters, as in the job file's schema, never a
    lone surrogate.

    Raises:
        ConfigError: The first key or string that is not, by its key path (never quoted).
    """
    problem = tree_problem(job, "", skip=("description",))
    if problem is not None:
        raise ConfigError(f"invalid job: every key and string is plain text\n  {problem}")


# --- paths ------------------------------------------------------------------------------------


def under(path: str | Path, roots: Iterable[Path]) -> bool:
    """``path``, resolved (``..`` and symlinks followed), lies under one of ``roots``."""
    try:
        real = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(real.is_relative_to(r.resolve()) for r in roots)


# A Hugging Face repository id: an optional owner, a name; letters, digits, '.', '_', '-'.
_HUB_NAME = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def is_hub_name(name: str) -> bool:
    """``name`` is a hub repository id (``gpt2``, ``org/model-1.5``): no ``..``, no ``--``, no
    leading ``.``, ``/`` or ``~``, at most one ``/``."""
    return bool(_HUB_NAME.fullmatch(name)) and ".." not in name and "--" not in name


# --- traces -----------------------------------------------------------------------------------


def _chunks(path: Path) -> Iterable[bytes]:
    """The file's text in 1 MiB chunks (a ``.gz`` one decompressed, as the trace reader does)."""
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        yield from iter(lambda: handle.read(1024**2), b"")


def check_trace_size(path: Path, max_rows: int, max_bytes: int | None = None) -> None:
    """The trace at ``path`` has at most ``max_rows`` rows (plus a header line), counted as
    lines without parsing anything; an uploaded one (``max_bytes``) decompresses to at most
    ``max_bytes``.

    Raises:
        ConfigError: More rows than ``max_rows``, or a file that cannot be read (the message
            quotes none of it).
        SubmissionRefused: (413) More text than ``max_bytes``.
    """
    lines = size = 0
    name = path.name[:200]
    if not path.is_file():
        raise ConfigError(f"trace: {name} is not a file")
    try:
        for chunk in _chunks(path):
            lines += chunk.count(b"\n")
            size += len(chunk)
            if lines > max_rows + 1:
                raise ConfigError(
                    f"trace: {name} has more than {max_rows} rows, the service's limit "
                    "(its --max-trace-rows): send a slice of the trace (shaping reads the "
                    "whole file before it selects a window)"
                )
            if max_bytes is not None and size > max_bytes:
                raise SubmissionRefused(
                    f"trace: {name} decompresses to more than {max_bytes} bytes, the "
                    "service's upload limit",
                    status=413,
                )
    except (OSError, EOFError, zlib.error):
        raise ConfigError(
            f"trace: {name} cannot be read (a .gz file must be gzip); the service does not "
            "quote the file"
        ) from None


# --- study folders ----------------------------------------------------------------------------

#: The file the service writes in every study folder it creates.
STUDY_MARKER = "service-study.json"
#: A study folder the service creates: ``DATA_DIR/studies/<12 hex digits>``.
_SERVICE_FOLDER = re.compile(r"[0-9a-f]{12}")


def mark_service_study(folder: Path, job_id: str) -> None:
    """Write :data:`STUDY_MARKER` in ``folder`` (created if missing); idempotent."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / STUDY_MARKER
    if not marker.exists():
        doc = {
            "written_by": "vllm-autotune serve",
            "job": job_id,
            "policy": "exports of this folder apply the service's engine-flag and "
            "environment allow-lists",
        }
        marker.write_text(json.dumps(doc, indent=2) + "\n")


def is_service_study(folder: Path) -> bool:
    """``folder`` was written by the service: it holds :data:`STUDY_MARKER`, or (a folder the
    service wrote before it marked them) it is laid out as ``.../studies/<12 hex digits>``."""
    if (folder / STUDY_MARKER).exists():
        return True
    real = folder.resolve()
    return real.parent.name == "studies" and _SERVICE_FOLDER.fullmatch(real.name) is not None


def check_stored_study(
    job: Mapping[str, Any], trials: Iterable[tuple[str, Mapping[str, Any]]] = ()
) -> None:
    """A stored job and trials' engine arguments against the service's policy.

    Args:
        job: The stored job (as the service or ``plan.json`` keeps it).
        trials: (label, engine arguments) of each trial that would be rendered or re-run.

    Raises:
        ConfigError: A string of the job that is not plain text (a control character: stored
            before the job file's schema refused them), ``engine.python``, a variable or a
            flag the service does not accept.
    """
    problem = tree_problem(dict(job), "the study's job", skip=("description",))
    if problem is not None:
        raise ConfigError(problem)
    engine = job.get("engine") or {}
    if engine.get("python"):
        raise ConfigError(
            "the study's engine.python: the service runs servers with its own vLLM only"
        )
    if engine.get("cpus") is not None:
        raise ConfigError("the study's engine.cpus: the service places servers on its own cores")
    check_env(engine.get("env") or {}, "the study's engine.env")
    for key in ("args", "baseline_args"):
        check_engine_args(engine.get(key) or {}, f"the study's engine.{key}")
    for label, args in trials:
        check_engine_args(args, label)


_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


# --- redaction: what a response or an export may not show -------------------------------------


#: A query parameter of a URL whose value is a secret: its name holds one of these words
#: (``password``, ``passwd``, ``pwd``, ``sslpassword``, ``secret``, ``token``, ``key``,
#: ``access_key``, ``aws_secret_access_key``, ``sslkey``, ``credentials``, ``auth``, ...).
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|credential|auth|signature", re.IGNORECASE)
#: A value that itself holds a secret setting (an ODBC connection string: ``...;PWD=x``).
_SECRET_SETTING = re.compile(r"(?:pass|pwd|secret|token|key|credential)\w*\s*=", re.IGNORECASE)


def _redact_query(query: str) -> str:
    """``query`` with the value of every secret parameter replaced by ``***`` (each
    parameter's name and every other value kept as written)."""
    pieces = re.split(r"([&;])", query)
    for i in range(0, len(pieces), 2):
        name, eq, value = pieces[i].partition("=")
        if eq and (
            _SECRET_PARAM.search(unquote_plus(name)) or _SECRET_SETTING.search(unquote_plus(value))
        ):
            pieces[i] = f"{name}=***"
    return "".join(pieces)


def redact_url(url: str | None) -> str | None:
    """A database or tracking URL fit to show to a team: the password of its user info and
    the value of every query parameter that is a secret (``?password=``, ``?sslpassword=``,
    ``?token=``, ``?access_key=``, ...: :data:`_SECRET_PARAM`) replaced by ``***``; the
    scheme, user, host, path and every other parameter kept as written. A URL that cannot be
    parsed is ``***`` whole."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "***"
    shown = url
    if password is not None:
        userinfo, _, host = parts.netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        shown = shown.replace(parts.netloc, f"{user}:***@{host}", 1)
    if parts.query:
        head, _, tail = shown.partition("?")
        query = tail[: len(parts.query)]
        shown = f"{head}?{_redact_query(query)}{tail[len(parts.query) :]}"
    return shown


def is_secret(key: str) -> bool:
    """True for an environment variable whose value is a secret (a token, key or password)."""
    return any(w in key.upper() for w in _SECRET_WORDS)


def _escape_surrogates(node: Any) -> Any:
    """``node`` with every key and string that holds a lone surrogate escaped (``\\ud800``):
    a job stored before they were refused at submission is still shown, never a 500."""
    if isinstance(node, str):
        return escape_controls(node) if surrogate_problem(node) is not None else node
    if isinstance(node, dict):
        return {_escape_surrogates(k): _escape_surrogates(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_escape_surrogates(v) for v in node]
    return node


def redact_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """A job document fit for an API response or a file a team reads: secret env values
    masked, the operator's URLs (``storage``, ``mlflow.tracking_uri``) as :func:`redact_url`
    shows them, lone surrogates of a job stored before they were refused escaped."""
    doc = _escape_surrogates(json.loads(json.dumps(job, default=str)))
    engine = doc.get("engine") or {}
    env = engine.get("env") or {}
    engine["env"] = {k: ("***" if is_secret(k) else v) for k, v in env.items()}
    if "storage" in doc:
        doc["storage"] = redact_url(doc["storage"])
    ml = doc.get("mlflow") or {}
    if ml.get("tracking_uri"):
        ml["tracking_uri"] = redact_url(ml["tracking_uri"])
    return dict(doc)
