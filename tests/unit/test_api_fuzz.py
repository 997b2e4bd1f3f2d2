"""Property-based fuzz of the HTTP API from its own OpenAPI document (schemathesis).

The app is the one of ``test_api`` (a real JobService, a FAKE driver launcher: no Ray, no
vLLM); the schema is loaded from ``/openapi.json`` through the ASGI app. With a valid bearer
token, no generated request (positive or negative) may get a 5xx; without one, every route but
``/healthz`` answers 401, never 5xx. Path ids are sometimes replaced by those of real studies
(one queued, one running with a baseline and a winner) so the fuzz reaches the detail, trial,
cancel and export code rather than only the 404s of random ids; and valid jobs with one key
set to arbitrary JSON and any time window reach the job loader and the scheduler's times.
Control characters (NUL, line breaks as YAML reads them, escapes, bidi overrides) go into every
string field: schemathesis's own strings may hold them (``allow_x00``, UTF-8), and valid
submissions with one control character or lone surrogate (``"\\ud800"`` in JSON) in any string
or key of the job or its envelope must be refused naming the key (issues 24 and 42), never
accepted or answered with a 5xx. Query and path
parameters get the same characters, lone surrogates among them (sent as their bytes,
percent-encoded, as no UTF-8 URL can hold one): never a 5xx, and no error answer holds a
character that does not print (FastAPI's own 422 echoed its input raw: issue 42).
Derandomized (the same cases every run); ``-s`` prints the case counts and statuses.
"""

from __future__ import annotations

import base64
import copy
import json
import time
import unicodedata
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import schemathesis
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error

from optimizer.service.api import create_app
from optimizer.service.facade import JobService
from optimizer.service.study_host import DriverStatus
from optimizer.text import text_problem
from tests.unit.test_api import AUTH, fake_study
from tests.unit.test_jobs import TRACE, FakeLauncher, job_doc, make_service, submit

OPERATIONS = {
    "GET /healthz",
    "GET /v1/studies",
    "POST /v1/studies",
    "GET /v1/studies/{study_id}",
    "GET /v1/studies/{study_id}/trials/{number}",
    "POST /v1/studies/{study_id}/cancel",
    "POST /v1/studies/{study_id}/export",
    "GET /v1/studies/{study_id}/validations/{validation_id}",
    "GET /v1/studies/{study_id}/validations/{validation_id}/export",
}
# Examples per operation (operations without inputs take one), and mutated valid jobs:
# about 400 requests in all (250 with a token, 50 without, 100 mutated jobs), ~10 s.
AUTHED_EXAMPLES = 50
ANON_EXAMPLES = 10
MUTANT_EXAMPLES = 100
HOSTILE_EXAMPLES = 60
CONTROL_EXAMPLES = 80
PARAMETER_EXAMPLES = 15  # for each query and path parameter of each operation

CASES: Counter[str] = Counter()  # requests sent, by pass and operation
STATUSES: Counter[str] = Counter()  # what they got, with a token


class _App:
    def __init__(
        self, app: FastAPI, service: JobService, ids: list[str], validations: list[str]
    ) -> None:
        self.app, self.service, self.ids, self.validations = app, service, ids, validations


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_App]:
    tmp = tmp_path_factory.mktemp("api-fuzz")
    launcher = FakeLauncher()
    service = make_service(tmp, launcher, max_upload_bytes=64 * 1024)
    service.validator = lambda _rec, _study, _choice, runs, _force: (
        f"fake, {runs} runs",
        [],
    )
    running, queued = submit(service, "fuzz-running"), submit(service, "fuzz-queued")
    service.scheduler.tick()
    launcher.drivers[running] = DriverStatus("starting")
    service.scheduler.tick()
    fake_study(service, running)
    launcher.drivers[running] = DriverStatus("running", remaining=0)
    service.scheduler.tick()
    validation = service.request_validation(running, "vllm-config")["id"]
    for _ in range(200):  # the fake validator answers at once; its thread ends soon after
        if service.validation(running, validation)["state"] == "done":
            break
        time.sleep(0.05)
    yield _App(create_app(service), service, [running, queued], [validation])
    print(f"\napi fuzz: {sum(CASES.values())} requests {dict(sorted(CASES.items()))}")
    print(f"statuses with a token: {dict(sorted(STATUSES.items()))}")


@pytest.fixture(scope="module")
def api_schema(fuzz_app: _App) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app.app, headers=AUTH)
    # The tests send the token (or none) themselves: no generated, dropped or mangled one.
    # Every generated string may hold NUL and any other control character.
    schema.config.generation.update(with_security_parameters=False, allow_x00=True, codec="utf-8")
    return schema


_FUZZ = settings(
    max_examples=AUTHED_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _operations(schema: schemathesis.BaseSchema) -> list[APIOperation[Any, Any, Any, Any]]:
    return [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]


def _cases(operation: APIOperation[Any, Any, Any, Any]) -> st.SearchStrategy[Case[Any]]:
    """Valid and invalid requests (bodies, query and path parameters) for ``operation``."""
    return st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


_ZONES: st.SearchStrategy[Any] = st.none() | st.sampled_from(
    [timezone(timedelta(hours=h)) for h in (0, -12, 14)]
)
_TIMES = st.one_of(  # anywhere, and near the edges of what datetime (and time zones) allow
    st.datetimes(timezones=_ZONES),
    st.datetimes(max_value=datetime(1, 1, 2), timezones=_ZONES),
    st.datetimes(min_value=datetime(9999, 12, 30), timezones=_ZONES),
).map(datetime.isoformat)


def _paths(doc: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path of a nested mapping (the places a mutation may hit)."""
    out: list[tuple[str, ...]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    return out


# Every string field of the job file's schema holds a value here or in _ENVELOPES' other jobs
# (test_the_fuzz_reaches_every_string_field_of_the_job checks it against JobConfig).
_JOB = job_doc(
    "fuzz-mutant",
    budget="2h",
    until="07:00",
    objectives={"preset": None, "objectives": ["min:p95_ttft_ms"], "slos": ["p95_ttft_ms<=900"]},
    storage="sqlite:///elsewhere.db",
    out="somewhere",
    ray_address="ray://head:10001",
    mlflow={"enabled": False, "tracking_uri": "http://mlflow:5000", "experiment": "e"},
    sampler={"name": "random"},
    trace={
        "path": str(TRACE),
        "format": "auto",
        "shaping": {"window_s": [0, 10]},
        "client_priority": "nice",
    },
    engine={
        "env": {"HF_TOKEN": "hf_secret", "VLLM_LOGGING_LEVEL": "INFO"},
        "args": {"kv-cache-dtype": "auto"},
        "baseline_args": {"max-num-seqs": 8},
    },
    search_space={
        "name": "t",
        "params": {"kv-cache-dtype": {"type": "categorical", "choices": ["auto", "fp8"]}},
    },
    enqueue=[{"kv-cache-dtype": "fp8"}],
)
#: Jobs with the string fields that cannot share one valid job: a preset (or a preset space),
#: a made model, a sampler's startup, an engine interpreter, earlier study folders and an eval
#: set (refused, but strings).
_OTHER_JOBS = [
    job_doc(
        "fuzz-other",
        model={"path": "tiny-fuzz", "make": "tiny"},
        objectives={"preset": "default"},
        search_space="default",
        sampler={"name": "tpe", "startup": "guided"},
    ),
    job_doc(
        "fuzz-refused",
        engine={"python": "python3"},
        warm_start={"studies": ["earlier"]},
        quality={"eval_set": "evals.jsonl"},
    ),
]
_PATHS = [*_paths({"job": _JOB}), ("job", "extra"), ("not_before",), ("trace_upload",)]


@st.composite
def _mutant_job(draw: st.DrawFn) -> dict[str, Any]:
    """A valid submission with one key (anywhere in it) set to an arbitrary JSON value, and a
    time window of any times (naive or not, year 1 to 9999): random bodies almost never get
    past the first type check, these reach the job loader's and the scheduler's insides."""
    doc: dict[str, Any] = {"job": copy.deepcopy(_JOB)}
    for key in ("not_before", "until"):
        when = draw(st.none() | _TIMES)
        if when is not None:
            doc[key] = when
    path = draw(st.sampled_from(_PATHS))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = draw(_JSON)
    return doc


def _aim(case: Case[Any], data: st.DataObject, app: _App) -> None:
    """Sometimes aim the case at a real study, trial or validation (else random ids only
    answer 404), and sometimes send a mutated valid job, or one with a control character in a
    string."""
    params = case.path_parameters or {}
    if "study_id" in params:
        params["study_id"] = data.draw(st.sampled_from([params["study_id"], *app.ids, *app.ids]))
        if "number" in params:
            params["number"] = data.draw(st.sampled_from([params["number"], 0, 1]))
        if "validation_id" in params:
            params["validation_id"] = data.draw(
                st.sampled_from([params["validation_id"], *app.validations])
            )
    if case.method == "POST" and case.path == "/v1/studies":
        kind = data.draw(st.sampled_from(["generated", "mutated", "control"]))
        if kind != "generated":
            case.media_type = "application/json"
            mutant = data.draw(_mutant_job()) if kind == "mutated" else None
            case.body = mutant if mutant is not None else data.draw(_control_job())[0]
            STATUSES[f"(POST /v1/studies sent a {kind} job)"] += 1


# Issue 24: one control character in any string (a value or a key) of a valid submission; issue
# 42: or a lone surrogate.
_CONTROLS = st.sampled_from(
    [
        "\n",
        "\r",
        "\r\n",
        "\x00",
        "\t",
        "\x1b",
        "\x7f",
        "\x85",
        "\u2028",
        "\u2029",
        "\u202e",
        "\ufeff",
        "\ud800",  # lone surrogates (issue 42): half of a UTF-16 pair, no character at all
        "\udfff",
    ]
)
_UPLOAD = {"filename": "t.csv", "content_b64": base64.b64encode(TRACE.read_bytes()).decode()}
_ENVELOPES: list[dict[str, Any]] = [
    {"job": _JOB, "not_before": "2030-01-01T00:00:00", "until": "2031-01-01T00:00:00"},
    {"job": _JOB, "trace_upload": _UPLOAD},
    *({"job": job} for job in _OTHER_JOBS),
]


def _strings(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], bool]]:
    """(key path, is the key itself) of every key and every string value of a document, in
    lists too (a list item's place is its index)."""
    out: list[tuple[tuple[Any, ...], bool]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.append(((*prefix, key), True))
            out.extend(_strings(value, (*prefix, key)))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out.extend(_strings(value, (*prefix, i)))
    elif isinstance(doc, str):
        out.append((prefix, False))
    return out


def _schema_string_fields(model: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The key path of every field of a pydantic model (nested models followed) whose value
    is or holds a string: str, Literal words, lists and mappings of them."""
    from typing import Literal, get_args, get_origin

    from pydantic import BaseModel

    def kinds(ann: Any) -> list[Any]:
        if get_origin(ann) is Literal:
            return [str]
        args = get_args(ann)
        return [k for a in args for k in kinds(a)] if args else [ann]

    found: set[tuple[str, ...]] = set()
    for name, info in model.model_fields.items():
        for kind in kinds(info.annotation):
            if kind is str:
                found.add((*prefix, name))
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= _schema_string_fields(kind, (*prefix, name))
    return found


_PLACES = [(i, path, is_key) for i, env in enumerate(_ENVELOPES) for path, is_key in _strings(env)]


@st.composite
def _control_job(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[str, ...], bool]:
    """A valid submission with one control character put into one string or key: (body, where,
    whether the key itself)."""
    i, path, is_key = draw(st.sampled_from(_PLACES))
    doc = copy.deepcopy(_ENVELOPES[i])
    node = doc
    for key in path[:-1]:
        node = node[key]
    text = path[-1] if is_key else node[path[-1]]
    at = draw(st.integers(0, len(text)))
    changed = text[:at] + draw(_CONTROLS) + text[at:]
    if is_key:
        node[changed] = node.pop(path[-1])
    else:
        node[path[-1]] = changed
    return doc, path, is_key


def test_the_fuzz_reaches_every_string_field_of_the_job() -> None:
    """Every string field of the job file's schema (JobConfig, nested sections included) holds
    a string in a fuzzed submission, so a control character is tried in each (issue 33: the
    fuzz had missed budget, until, objectives, slos, storage, out, ray_address, mlflow)."""
    from optimizer.config import JobConfig

    reached = {p for env in _ENVELOPES for p in _job_places(env)}
    missing = _schema_string_fields(JobConfig) - reached
    assert not missing, sorted(missing)


def _job_places(envelope: dict[str, Any]) -> set[tuple[str, ...]]:
    """The job's key paths (list indices left out) where an envelope holds a string or key."""
    return {
        tuple(str(p) for p in path[1:] if not isinstance(p, int))
        for path, _is_key in _strings(envelope)
        if path and path[0] == "job" and len(path) > 1
    }


def test_no_server_errors_with_a_token(api_schema: schemathesis.BaseSchema, fuzz_app: _App) -> None:
    operations = _operations(api_schema)
    assert {op.label for op in operations} == OPERATIONS  # a new route: check the budget
    for operation in operations:

        @_FUZZ
        @given(case=_cases(operation), data=st.data())
        def fuzz(case: Case[Any], data: st.DataObject) -> None:
            _aim(case, data, fuzz_app)
            case.headers.update(AUTH)
            CASES[f"authed {case.method} {case.path}"] += 1
            response = case.call_and_validate(checks=[not_a_server_error])
            STATUSES[f"{case.method} {case.path} -> {response.status_code}"] += 1
            if 400 <= response.status_code < 500:
                assert not unplain_strings(response), response.text[:300]

        fuzz()
    # The aiming works: real studies were read, exported and cancelled, not only 404s.
    for reached in (
        "GET /v1/studies/{study_id}",
        "POST /v1/studies/{study_id}/export",
        "GET /v1/studies/{study_id}/validations/{validation_id}",
    ):
        assert STATUSES[f"{reached} -> 200"] > 0, reached


def test_mutated_jobs_are_refused_not_crashed(api_schema: schemathesis.BaseSchema) -> None:
    """Valid submissions with one key anywhere set to arbitrary JSON: 201 or a 4xx, never 5xx."""
    submit_op = api_schema["/v1/studies"]["POST"]

    @settings(_FUZZ, max_examples=MUTANT_EXAMPLES)
    @given(job=_mutant_job())
    def fuzz(job: dict[str, Any]) -> None:
        case = submit_op.Case(body=job, media_type="application/json", headers=dict(AUTH))
        CASES["mutated POST /v1/studies"] += 1
        response = case.call_and_validate(checks=[not_a_server_error])
        STATUSES[f"mutated POST /v1/studies -> {response.status_code}"] += 1

    fuzz()


def test_a_control_character_in_any_string_is_refused_naming_the_key(
    api_schema: schemathesis.BaseSchema, fuzz_app: _App
) -> None:
    """Never a 201 that would carry it into a plan, a command line or an export (an uploaded
    file's name excepted: the service stores it under a clean name), never a 5xx; a changed
    value's key is named in the answer."""
    submit_op = api_schema["/v1/studies"]["POST"]

    @settings(_FUZZ, max_examples=CONTROL_EXAMPLES)
    @given(drawn=_control_job())
    def fuzz(drawn: tuple[dict[str, Any], tuple[str, ...], bool]) -> None:
        body, path, is_key = drawn
        case = submit_op.Case(body=body, media_type="application/json", headers=dict(AUTH))
        CASES["control POST /v1/studies"] += 1
        response = case.call_and_validate(checks=[not_a_server_error])
        STATUSES[f"control POST /v1/studies -> {response.status_code}"] += 1
        if path == ("trace_upload", "filename") and not is_key:
            assert response.status_code == 201, response.text[:300]
            stored = fuzz_app.service.get(response.json()["id"]).job["trace"]["path"]
            assert text_problem(stored) is None
            return
        assert response.status_code in (403, 422), (path, is_key, response.text[:300])
        detail = response.json()["detail"]
        # one plain line an error: the character is never echoed (issue 33)
        assert all(text_problem(line) is None for line in detail.split("\n")), detail[:300]
        if not is_key:
            dotted = ".".join(str(p) for p in (path[1:] if path[0] == "job" else path))
            assert dotted in detail, (path, response.text[:300])

    fuzz()


# Issue 13's attacks as strategies: code-loading flags and env anywhere a job names flags,
# paths outside the roots, YAML alias bombs and deep nesting, unreadable traces.
_HOSTILE_FLAGS = st.sampled_from(
    [
        "tool-parser-plugin",
        "reasoning-parser-plugin",
        "chat-template",
        "tokenizer",
        "download-dir",
        "config",
        "trust-remote-code",
        "served-model-name",
        "logging-config",
        "max-num-seqz",
    ]
)
_HOSTILE_ENV = st.sampled_from(["VLLM_PLUGINS", "OPENSSL_CONF", "HF_HOME", "LD_PRELOAD", "X"])
_SOMEWHERE = st.sampled_from(["/tmp/fuzz-outside/x", "../../x", "~/x", "/etc/passwd", "x.py"])


@st.composite
def _hostile_body(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(kind, content type, body) of one of issue 13's attacks, with drawn details."""
    job = copy.deepcopy(_JOB)
    kind = draw(
        st.sampled_from(["flag", "baseline", "space", "env", "paths", "yaml", "deep", "trace"])
    )
    if kind in ("flag", "baseline"):
        key = "args" if kind == "flag" else "baseline_args"
        job["engine"][key] = {draw(_HOSTILE_FLAGS): draw(_SOMEWHERE | st.booleans())}
    elif kind == "space":
        job["search_space"]["params"][draw(_HOSTILE_FLAGS)] = {
            "type": "categorical",
            "choices": [draw(_SOMEWHERE)],
        }
    elif kind == "env":
        job["engine"]["env"] = {draw(_HOSTILE_ENV): draw(_SOMEWHERE)}
    elif kind == "paths":
        target = draw(_SOMEWHERE)
        job[draw(st.sampled_from(["model", "storage", "mlflow"]))] = draw(
            st.sampled_from(
                [
                    {"path": target, "make": "tiny"},
                    {"path": target},
                    f"sqlite:///{target}.db",
                    {"enabled": True, "tracking_uri": f"sqlite:///{target}.db"},
                ]
            )
        )
    elif kind == "yaml":
        levels = draw(st.integers(1, 9))
        lines = ['a0: &a0 ["xxxxxxxx"]']
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
        text = yaml.safe_dump(job) + "\n".join(lines) + f"\nextra: *a{levels}\n"
        return kind, "application/yaml", text.encode()
    elif kind == "deep":
        n = draw(st.integers(33, 200_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return kind, "application/json", ('{"job": ' + opener * n + "1" + closer * n + "}").encode()
    else:
        data = draw(st.binary(min_size=1, max_size=2000)) + draw(
            st.sampled_from([b"", b"x" * 200_000, b'{"format": "nope", "version": 1}\n'])
        )
        doc = {
            "job": job,
            "trace_upload": {
                "filename": draw(st.sampled_from(["t.csv", "t.jsonl", "t.py", "../t.csv"])),
                "content_b64": base64.b64encode(data).decode(),
            },
        }
        return kind, "application/json", json.dumps(doc).encode()
    return kind, "application/json", json.dumps({"job": job}).encode()


def test_hostile_submissions_are_refused_with_a_4xx(
    api_schema: schemathesis.BaseSchema, fuzz_app: _App
) -> None:
    """Issue 13's attacks with drawn details: never a 201 that would run them, never a 5xx, and
    no file planted outside the service's folders."""
    submit_op = api_schema["/v1/studies"]["POST"]
    outside = Path("/tmp/fuzz-outside")

    @settings(_FUZZ, max_examples=HOSTILE_EXAMPLES)
    @given(body=_hostile_body())
    def fuzz(body: tuple[str, str, bytes]) -> None:
        kind, ctype, data = body
        case = submit_op.Case(media_type=ctype, headers={**AUTH, "Content-Type": ctype})
        case.body = data
        CASES["hostile POST /v1/studies"] += 1
        response = case.call(headers={"Content-Type": ctype}, data=data)
        STATUSES[f"hostile POST /v1/studies -> {response.status_code}"] += 1
        assert response.status_code < 500, response.text[:300]
        assert not outside.exists()
        if response.status_code != 201:
            return
        # Accepted: a trace this app's (fake) plan check does not read, or a path the service
        # rewrote itself (storage, MLflow: with a note) or a hub name (not a path at all).
        rec = fuzz_app.service.get(response.json()["id"])
        assert kind in ("trace", "paths"), (kind, response.text[:300])
        if kind == "paths":
            model = rec.job["model"]["path"]
            assert (
                "ignored" in " ".join(response.json()["notes"])
                or not Path(model).is_absolute()
                or Path(model).is_relative_to(fuzz_app.service.data_dir)
            ), rec.job
            assert rec.storage_url == f"sqlite:///{rec.out}/study.db"

    fuzz()


def test_without_a_token_only_healthz_answers(api_schema: schemathesis.BaseSchema) -> None:
    for operation in _operations(api_schema):

        @settings(_FUZZ, max_examples=ANON_EXAMPLES)
        @given(case=_cases(operation))
        def fuzz(case: Case[Any]) -> None:
            case.headers.pop("Authorization", None)  # case-insensitive
            CASES[f"anon {case.method} {case.path}"] += 1
            response = case.call()
            case.validate_response(response, checks=[not_a_server_error])
            if case.path == "/healthz":
                assert response.status_code == 200
            else:
                assert response.status_code == 401, (case.method, case.path, response.text)
                assert response.headers.get("www-authenticate") == ["Bearer"]

        fuzz()


# Issue 42: what a query or path parameter may hold, lone surrogates included.
_PARAMETER_PIECES = st.sampled_from(
    [
        "\n",
        "\r\n",
        "\x00",
        "\x1b[31m",
        "\x7f",
        "\x85",
        "\u2028",
        "\u202e",
        "\ufeff",
        "\ud800",
        "\udfff",
        "\udc80",
        "vllm-config",
        "max-throughput",
        "p95_ttft_ms=1",
        "1",
        "true",
        "/",
        "%",
        " ",
        "\u00e9",
    ]
)
_PARAMETER_TEXT = st.lists(_PARAMETER_PIECES | st.text(max_size=4), min_size=1, max_size=6).map(
    "".join
)
#: Categories that never print on a line: controls, format characters, line and paragraph
#: separators, lone surrogates.
_UNPLAIN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def unplain_strings(response: Any) -> list[str]:
    """The lines of an answer's strings (keys too; a JSON answer decoded) that hold a
    character that does not print: a control, format or separator character, a lone
    surrogate."""
    try:
        doc = response.json()
    except ValueError:
        doc = response.text
    found: list[str] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node
        elif isinstance(node, str):
            found += [
                line
                for line in node.split("\n")
                if any(unicodedata.category(ch) in _UNPLAIN for ch in line)
            ]
    return found


def _parameters(app: FastAPI) -> list[tuple[str, str, str, str]]:
    """(method, path, where, name) of every query and path parameter in the app's OpenAPI."""
    found = []
    for path, methods in app.openapi()["paths"].items():
        for method, op in methods.items():
            for param in op.get("parameters", []):
                if param["in"] in ("query", "path"):
                    found.append((method.upper(), path, param["in"], param["name"]))
    return found


def _encoded(value: str) -> str:
    """``value`` percent-encoded from its UTF-8 bytes (a lone surrogate as its own three)."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


def test_query_and_path_parameters_never_echo_unprintable_input(fuzz_app: _App) -> None:
    """One query or path parameter of any operation set to text with control characters,
    escapes, bidi overrides or lone surrogates, the others valid (a real study, trial and
    validation; a valid format): never a 5xx, and no line of an error answer holds a character
    that does not print (``export?format=vllm-config%0A%1B%5B31m`` was echoed raw)."""
    params = _parameters(fuzz_app.app)
    assert {(w, n) for _m, _p, w, n in params} >= {
        ("path", "study_id"),
        ("path", "number"),
        ("path", "validation_id"),
        ("query", "format"),
        ("query", "runs"),
        ("query", "weight"),
    }
    valid = {
        "study_id": fuzz_app.ids[0],
        "number": "0",
        "validation_id": fuzz_app.validations[0],
        "format": "vllm-config",
    }
    client = TestClient(fuzz_app.app)
    for target in params:

        @settings(_FUZZ, max_examples=PARAMETER_EXAMPLES)
        @given(value=_PARAMETER_TEXT, at=st.just(target))
        def fuzz(value: str, at: tuple[str, str, str, str]) -> None:
            method, path, where, name = at
            query = {"format": _encoded(valid["format"])} if "export" in path else {}
            for key in [k for k in valid if f"{{{k}}}" in path]:
                path = path.replace(f"{{{key}}}", _encoded(value if key == name else valid[key]))
            if where == "query":
                query[name] = _encoded(value)
            url = path + "?" + "&".join(f"{k}={v}" for k, v in query.items())
            CASES[f"parameter {method} {where} {name}"] += 1
            response = client.request(method, url.rstrip("?"), headers=AUTH)
            STATUSES[f"parameter {where} {name} -> {response.status_code}"] += 1
            assert response.status_code < 500, (url, response.text[:300])
            if response.status_code >= 400:
                assert not unplain_strings(response), (url, response.text[:300])

        fuzz()
