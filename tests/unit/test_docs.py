"""The documentation, checked against the code (issue 43: a test keeps the docs honest).

- Every job file in ``docs/`` and ``examples/`` (a fenced ``yaml`` block of README.md or a page
  of docs/, a ``.yaml`` file) parses and validates with the project's own loader
  (:func:`optimizer.config.load_job`), its search space, objectives, capacity and stability
  settings included. A block that shows only some sections of a job is validated on a minimal
  job; a block that is a search space is loaded as one. Model paths need not exist.
- Every ``vllm-autotune ...`` command quoted in README.md and docs/ (in a shell block or an
  inline code span) names a command that exists and only flags it has, and parses with the
  real argument parser (:func:`optimizer.cli.build_parser`).
- The key reference of docs/job-file.md names every key of the job models, no other, with the
  models' defaults.
- Every relative link of README.md, docs/, benchmarks/RESULTS.md and benchmarks/records/ leads
  to a file (and, with ``#anchor``, to a heading of it); every path of README's "Layout" exists.

The checkers are tested too, on a renamed flag, key and job key, so the test cannot pass by
finding nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import subprocess
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from objectives.presets import load_objectives
from optimizer.cli import build_parser
from optimizer.config import JobConfig, load_job
from optimizer.errors import ConfigError
from search_spaces.schema import load_space

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
GUIDE = [README, *sorted(DOCS.glob("*.md"))]
RECORDS = REPO / "benchmarks" / "records"
LINKED = [
    *GUIDE,
    REPO / "benchmarks" / "RESULTS.md",
    *sorted(RECORDS.glob("*.md")),
    REPO / "deploy" / "README.md",
    REPO / "deploy" / "SERVICE.md",
]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
JOB_REFERENCE = DOCS / "job-file.md"

#: What a job fragment (a block showing some sections only) is completed with.
BASE_JOB: dict[str, Any] = {
    "name": "docs-check",
    "model": {"path": "org/some-model"},
    "trace": {"path": "traces/azure2023_code_600.csv"},
    "trials": 2,
}

_FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_SHELL = frozenset({"bash", "sh", "shell", "console"})
_INLINE = re.compile(r"`(vllm-autotune [^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_KEY_ROW = re.compile(r"^\| `(?P<key>[a-z_][a-z0-9_.]*)` \| (?P<default>required|`[^`]*`) \|", re.M)


# --- reading the documents --------------------------------------------------------------------


def fenced(text: str) -> Iterator[tuple[str, str, int]]:
    """Each fenced block: its language, its body and the line it starts on."""
    for m in _FENCE.finditer(text):
        yield m.group("lang"), m.group("body"), text.count("\n", 0, m.start()) + 1


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return _FENCE.sub("", text)


def _split_shell(line: str) -> Iterator[list[str]]:
    """The simple commands of one shell line (split at ``;``, ``&&``, ``|``, comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    words: list[str] = []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            yield words
            words = []
        else:
            words.append(token)
    yield words


def _argv(words: list[str]) -> list[str]:
    """A command's words up to a redirection."""
    for i, word in enumerate(words):
        if word in (">", ">>", "<", "2>", "2>&1") or word.startswith((">", "2>")):
            return words[:i]
    return words


def quoted_commands(path: Path) -> list[tuple[str, list[str], bool]]:
    """Every ``vllm-autotune`` command quoted in a document: (where, its arguments, whether it
    is a whole command line: a shell block's line is, an inline span may only name a command
    and some of its flags)."""
    text = path.read_text()
    out: list[tuple[str, list[str], bool]] = []
    for lang, body, line in fenced(text):
        if lang not in _SHELL:
            continue
        for offset, shell_line in enumerate(re.sub(r"\\\n", " ", body).splitlines()):
            for words in _split_shell(shell_line.strip().removeprefix("$ ")):
                if words[:1] == ["vllm-autotune"]:
                    out.append((f"{path.name}:{line + offset}", _argv(words)[1:], True))
    for m in _INLINE.finditer(prose(text)):
        for words in _split_shell(m.group(1)):
            if words[:1] == ["vllm-autotune"]:
                out.append((f"{path.name}: `{m.group(1)}`", _argv(words)[1:], False))
    return out


def yaml_blocks(path: Path) -> list[tuple[str, Any]]:
    """Every fenced ``yaml`` block of a document, parsed: (where, the document)."""
    return [
        (f"{path.name}:{line}", yaml.safe_load(body))
        for lang, body, line in fenced(path.read_text())
        if lang in ("yaml", "yml")
    ]


# --- commands ---------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_problems(
    parser: argparse.ArgumentParser, argv: list[str], *, whole: bool = True
) -> list[str]:
    """What is wrong with ``vllm-autotune ARGV`` (empty: the command exists with these flags;
    ``whole``: and the line parses, its required arguments, choices and types included)."""
    words, chain, sub = list(argv), [], parser
    while choices := _subcommands(sub):
        if not words or words[0] not in choices:
            asked = " ".join([*chain, *words[:1]]) or "(none)"
            return [f"no command {asked!r}; there are: {', '.join(sorted(choices))}"]
        chain.append(words.pop(0))
        sub = choices[chain[-1]]
    flags = {s for action in sub._actions for s in action.option_strings}
    unknown = [
        f"{' '.join(chain)}: no flag {w.split('=', 1)[0]}"
        for w in words
        if w.startswith("--") and w.split("=", 1)[0] not in flags
    ]
    if unknown or not whole:
        return unknown
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code:
                return [f"{' '.join(chain)}: {err.getvalue().strip().splitlines()[-1]}"]
    return []


def _all_commands() -> list[tuple[str, list[str], bool]]:
    return [c for path in GUIDE for c in quoted_commands(path)]


def test_every_quoted_command_exists_with_the_flags_it_shows() -> None:
    parser = build_parser()
    commands = _all_commands()
    problems = [
        f"{where}: {p}"
        for where, argv, whole in commands
        for p in command_problems(parser, argv, whole=whole)
    ]
    assert not problems, "\n".join(problems)
    # Not vacuous: the guide quotes many commands, of most of the tool's commands.
    assert len(commands) >= 60 and sum(whole for *_, whole in commands) >= 40, len(commands)
    assert len(quoted_commands(README)) >= 8
    named = {
        " ".join(argv[:2]) if argv[:1] in (["engine"], ["trace"]) else argv[0]
        for _, argv, whole in commands
        if whole
    }
    missing = set(_command_names(parser)) - named
    assert not missing, f"commands the guide never shows: {sorted(missing)}"


def _command_names(parser: argparse.ArgumentParser) -> list[str]:
    names = []
    for name, sub in _subcommands(parser).items():
        inner = _subcommands(sub)
        names += [f"{name} {n}" for n in inner] if inner else [name]
    return names


def _renamed(parser: argparse.ArgumentParser, command: str, old: str, new: str) -> None:
    """Rename one flag of one command of ``parser``, as a change to cli.py would."""
    sub = _subcommands(parser)[command]
    action = sub._option_string_actions.pop(old)
    action.option_strings = [new if s == old else s for s in action.option_strings]
    sub._option_string_actions[new] = action


def test_the_command_check_reports_a_renamed_flag_and_command() -> None:
    parser = build_parser()
    assert command_problems(parser, ["tune", "job.yaml", "--budget", "8h"]) == []
    _renamed(parser, "tune", "--budget", "--time-budget")
    assert command_problems(parser, ["tune", "job.yaml", "--budget", "8h"]) == [
        "tune: no flag --budget"
    ]
    # ... and the guide quotes that flag, so the real check would fail on such a rename.
    failing = [
        w for w, argv, whole in _all_commands() if command_problems(parser, argv, whole=whole)
    ]
    assert failing, "no quoted command uses tune --budget"
    assert command_problems(build_parser(), ["tunes", "job.yaml"])[0].startswith("no command")
    assert command_problems(build_parser(), ["trace", "inspects", "t.csv"])
    assert command_problems(build_parser(), ["export", "runs/x", "--format", "yaml"])  # a choice
    assert command_problems(build_parser(), ["export", "runs/x"])  # --format is required


def test_commands_are_found_in_shell_blocks_and_inline_spans(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `vllm-autotune show runs/a --json` first.\n\n```bash\n"
        "vllm-autotune tune a.yaml \\\n    --budget 8h   # a comment --not-a-flag\n"
        "cd x && vllm-autotune export runs/a --format helm > out.yaml\n```\n\n"
        "```text\nvllm-autotune not-checked\n```\n"
    )
    assert [(argv, whole) for _, argv, whole in quoted_commands(page)] == [
        (["tune", "a.yaml", "--budget", "8h"], True),
        (["export", "runs/a", "--format", "helm"], True),
        (["show", "runs/a", "--json"], False),
    ]


def test_the_quickstart_commands_are_kept_exactly() -> None:
    """`.ci/run` and the tests depend on these two lines."""
    blocks = [body for lang, body, _ in fenced(README.read_text()) if lang == "bash"]
    assert any(
        "bash deploy/quickstart.sh   # installs what it needs and runs a real tuning study\n"
        "bash deploy/test.sh         # installs what it needs and passes the tests (what CI runs)\n"
        in body
        for body in blocks
    )


# --- job files --------------------------------------------------------------------------------


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = (
            _merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
        )
    return out


def validate_job(doc: Mapping[str, Any], base: Path) -> None:
    """Load and validate a job as ``tune`` would before anything starts (no trace read)."""
    job, _ = load_job(dict(doc), base=base)
    space = load_space(job.search_space)
    if job.sampler.name == "grid":
        space.grid()
    section = job.objectives
    load_objectives(
        section.preset if not section.objectives else None, section.objectives, section.slos
    )
    job.capacity.settings()
    job.stability.options()


def _kind(doc: Any) -> str:
    if not isinstance(doc, dict):
        return "not a mapping"
    if set(doc) <= set(JobConfig.model_fields):
        return "job" if {"name", "model", "trace"} <= set(doc) else "job fragment"
    if "params" in doc or "fixed" in doc:
        return "search space"
    return "unknown"


def check_block(doc: Any) -> str:
    """Validate one YAML block of the guide; returns its kind."""
    kind = _kind(doc)
    if kind == "job":
        validate_job(doc, REPO / "examples")
    elif kind == "job fragment":
        validate_job(_merged(BASE_JOB, doc), REPO / "examples")
    elif kind == "search space":
        load_space(doc)
    else:
        raise AssertionError(f"a YAML block that is neither a job nor a search space ({kind})")
    return kind


def test_every_yaml_block_of_the_guide_validates() -> None:
    kinds: dict[str, int] = {}
    problems = []
    for path in GUIDE:
        for where, doc in yaml_blocks(path):
            try:
                kind = check_block(doc)
            except (ConfigError, AssertionError, ValueError) as exc:
                problems.append(f"{where}: {exc}")
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
    assert not problems, "\n\n".join(problems)
    assert kinds.get("job", 0) >= 2 and kinds.get("job fragment", 0) >= 8, kinds
    assert any(_kind(doc) == "job" for _, doc in yaml_blocks(README)), "README shows a job file"


@pytest.mark.parametrize("path", [*EXAMPLES, *sorted(DOCS.glob("*.yaml"))], ids=lambda p: p.name)
def test_every_job_file_validates(path: Path) -> None:
    job, base = load_job(path)
    validate_job(yaml.safe_load(path.read_text()), base)
    assert Path(job.trace.path).is_file(), job.trace.path


def test_there_are_example_jobs() -> None:
    assert len(EXAMPLES) >= 5


def test_a_renamed_key_in_a_job_block_fails() -> None:
    job = next(doc for _, doc in yaml_blocks(README) if _kind(doc) == "job")
    check_block(job)
    shaping = job["trace"]["shaping"]
    shaping["window"] = shaping.pop("window_s")
    with pytest.raises(ConfigError, match="did you mean 'window_s'"):
        check_block(job)


# --- the key reference ------------------------------------------------------------------------


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def job_keys(model: type[BaseModel] = JobConfig, prefix: str = "") -> dict[str, FieldInfo]:
    """Every key a job can hold (dotted), sections left out: their keys stand for them."""
    out: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None:
            out.update(job_keys(sub, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field
    return out


def shown_default(field: FieldInfo) -> str:
    """A key's default as the reference writes it: ``required``, or JSON in backticks."""
    if field.is_required():
        return "required"
    return f"`{json.dumps(field.get_default(call_default_factory=True))}`"


def key_problems(documented: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """Keys the reference lacks, keys it names that do not exist, defaults that differ."""
    problems = [f"undocumented key {k}" for k in actual if k not in documented]
    problems += [f"documented key {k} is no key of the job" for k in documented if k not in actual]
    problems += [
        f"{k}: documented default {documented[k]}, the code's {actual[k]}"
        for k in actual
        if k in documented and documented[k] != actual[k]
    ]
    return problems


def documented_keys(text: str) -> dict[str, str]:
    return {m.group("key"): m.group("default") for m in _KEY_ROW.finditer(text)}


def test_the_job_reference_names_every_key_with_its_default() -> None:
    documented = documented_keys(JOB_REFERENCE.read_text())
    actual = {k: shown_default(f) for k, f in job_keys().items()}
    assert not key_problems(documented, actual), "\n".join(key_problems(documented, actual))
    assert len(documented) >= 80


def test_the_key_check_reports_a_renamed_key_and_a_changed_default() -> None:
    class Inner(BaseModel):
        seed: int = 0

    class Job(BaseModel):
        name: str
        time_budget: str | None = None
        inner: Inner | None = None

    actual = {k: shown_default(f) for k, f in job_keys(Job).items()}
    assert actual == {"name": "required", "time_budget": "`null`", "inner.seed": "`0`"}
    documented = documented_keys(
        "| `name` | required | x |\n| `budget` | `null` | y |\n| `inner.seed` | `1` | z |\n"
    )
    assert key_problems(documented, actual) == [
        "undocumented key time_budget",
        "documented key budget is no key of the job",
        "inner.seed: documented default `1`, the code's `0`",
    ]


# --- links and the layout ---------------------------------------------------------------------


def slugs(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them."""
    out: set[str] = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+?)\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in out:
            n += 1
            candidate = f"{slug}-{n}"
        out.add(candidate)
    return out


def link_problems(path: Path, root: Path = REPO) -> list[str]:
    """The relative links of ``path`` that lead nowhere."""
    problems = []
    for m in _LINK.finditer(prose(path.read_text())):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.relative_to(root)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            problems.append(f"{path.relative_to(root)}: {target}: no such heading")
    return problems


def test_every_relative_link_resolves() -> None:
    problems = [p for path in LINKED for p in link_problems(path)]
    assert not problems, "\n".join(problems)


def test_the_link_check_reports_a_missing_file_and_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## The `capacity` key\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#the-capacity-key) [gone](c.md) [bad](b.md#nothing) [web](https://x)\n"
    )
    assert [p.split(": ", 1)[1] for p in link_problems(page, tmp_path)] == [
        "c.md: no such file",
        "b.md#nothing: no such heading",
    ]


def layout_paths() -> list[str]:
    """The paths README's "Layout" block names (a folder ends in ``/``)."""
    text = README.read_text()
    section = text.split("\n## Layout", 1)[1]
    block = next(body for lang, body, _ in fenced(section))
    paths, folder = [], ""
    for line in block.splitlines():
        m = re.match(r"^( {0,2})([\w.-]+/?)\s", line + " ")
        if not m:
            continue
        if not m.group(1):
            folder = m.group(2) if m.group(2).endswith("/") else ""
            paths.append(m.group(2))
        else:
            paths.append(folder + m.group(2))
    return paths


def test_the_layout_names_what_is_there() -> None:
    paths = layout_paths()
    assert len(paths) >= 25, paths
    # a module split into a package of its own name is the same room
    missing = [
        p
        for p in paths
        if not (REPO / p).exists() and not (p.endswith(".py") and (REPO / p[:-3]).is_dir())
    ]
    assert not missing, f"README's Layout names what the tree lacks: {missing}"


def test_the_layout_names_every_room() -> None:
    """Every folder of the project and every package and module of ``optimizer/``."""
    named = set(layout_paths())
    tracked = _tracked_files()
    rooms = {
        f"optimizer/{p.name}/" if p.is_dir() else f"optimizer/{p.name}"
        for p in (REPO / "optimizer").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.name != "__init__.py")
    }
    if tracked:  # what git tracks: a folder being written beside the tree is not a room yet
        rooms = {r for r in rooms if any(f == r or f.startswith(r) for f in tracked)}
    # a module split into a package of its own name is the same room, named either way
    same = {p.removesuffix("/").removesuffix(".py") for p in named}
    unnamed = sorted(
        r for r in _project_folders() | rooms if r.removesuffix("/").removesuffix(".py") not in same
    )
    assert not unnamed, f"README's Layout does not name: {unnamed}"


def _tracked_files() -> list[str]:
    """The files git tracks (none where git cannot say)."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return out.splitlines()


def _project_folders() -> set[str]:
    """The repository's top-level folders that git tracks."""
    return {f"{f.split('/', 1)[0]}/" for f in _tracked_files() if "/" in f} - {".ci/"}


def test_the_readme_and_the_results_stay_short() -> None:
    assert len(README.read_text().splitlines()) <= 200
    assert len((REPO / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 600
