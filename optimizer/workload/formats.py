"""Trace files: the canonical JSONL format, importers for published traces, and exporters.

Every trace the tuner replays passes through :func:`read_trace`, which detects the format (or
takes it by name), turns each row into a :class:`~optimizer.types.TraceRequest` and returns a
:class:`ReadReport` that accounts for every row: read, skipped as malformed, or dropped by a
format's rule (e.g. BurstGPT's failed requests). A bad row raises :class:`TraceError` naming the
file, the 1-based line and the field, unless ``skip_bad_rows`` asks to count it instead; nothing
is dropped silently. Imported arrival times are rebased so the first request arrives at 0 s.
:func:`write_trace` writes the canonical format, and :func:`export_vllm_custom` writes the
``custom`` dataset that ``vllm bench serve`` replays, so the tuner's numbers can be cross-checked
against vLLM's own benchmark on the same requests.

Formats (names accepted by ``fmt``):

- ``canonical``: this project's JSONL, one request per line:
  ``{"arrival_s", "input_tokens", "output_tokens", "prefix_blocks"?, "session_id"?}``, with an
  optional first header line ``{"format": "vllm-autotune-trace", "version": 1,
  "block_size": 512, "source": "..."}``.
- ``azure``: Azure LLM inference traces 2023/2024, CSV ``TIMESTAMP,ContextTokens,
  GeneratedTokens``; ``TIMESTAMP`` is an absolute datetime with up to 7 (read: 9) fractional
  digits and an optional UTC offset, parsed exactly (integer nanoseconds).
- ``mooncake``: Mooncake (FAST'25) JSONL ``{"timestamp" (ms, relative), "input_length",
  "output_length", "hash_ids"}``; ``hash_ids`` are 512-token prefix blocks.
- ``burstgpt``: BurstGPT CSV, read by header name so both published layouts parse:
  ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` (v1.x files) and
  ``Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,
  Log Type`` (v2.0 ``BurstGPT_3.csv``). ``Timestamp`` is in seconds. Rows with 0 response
  tokens are failed requests and are dropped with a count.
- ``bailian``: Alibaba Qwen-Bailian anonymized traces (alibaba-edu/qwen-bailian-usagetraces-anon,
  the KVCache-in-the-wild ATC'25 data), JSONL ``{"chat_id", "parent_chat_id", "timestamp" (s,
  relative), "input_length", "output_length", "type", "turn", "hash_ids"}`` with 16-token blocks
  (a ``blksz_<N>`` in the file name overrides the block size). The session of a request is the
  root of its ``parent_chat_id`` chain.
- ``vllm-custom``: vLLM's benchmark ``custom`` dataset JSONL ``{"prompt", "output_tokens"}``.
  It carries no timing, so every arrival is 0 s. Input lengths come from an ``input_tokens`` key
  when present (the exporter writes one); otherwise they are approximated by the prompt's
  whitespace word count, and the report says so.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any

from optimizer.errors import TraceError
from optimizer.types import Trace, TraceRequest

__all__ = [
    "CANONICAL_FORMAT",
    "FORMATS",
    "ReadReport",
    "detect_format",
    "export_vllm_custom",
    "prompt_text",
    "read_trace",
    "write_trace",
]

CANONICAL_FORMAT = "vllm-autotune-trace"
"""Value of the ``format`` key in a canonical trace's header line."""

FORMATS = ("canonical", "azure", "mooncake", "burstgpt", "bailian", "vllm-custom")
"""Format names :func:`read_trace` accepts (plus ``"auto"``)."""

_CANONICAL_VERSION = 1
_MOONCAKE_BLOCK_SIZE = 512
_BAILIAN_BLOCK_SIZE = 16
_MAX_REASONS = 5

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_CANONICAL_KEYS = frozenset({"arrival_s", "input_tokens", "output_tokens"})
_CANONICAL_OPTIONAL = frozenset({"prefix_blocks", "session_id"})
_MOONCAKE_KEYS = frozenset({"timestamp", "input_length", "output_length"})
_BAILIAN_MARKERS = frozenset({"chat_id", "parent_chat_id"})

_AZURE_TIME = re.compile(
    r"^(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:?\d{2})?$"
)
_EPOCH = datetime(1970, 1, 1)


@dataclass(frozen=True, slots=True)
class ReadReport:
    """What :func:`read_trace` did with every row of a file.

    ``rows_read == requests + rows_skipped + rows_dropped`` always holds.

    Attributes:
        format: The format the file was read as (one of :data:`FORMATS`).
        path: The file read.
        rows_read: Data rows seen (header and blank lines excluded).
        requests: Requests in the returned trace.
        rows_skipped: Malformed rows skipped because ``skip_bad_rows`` was set.
        skip_reasons: The first few skip reasons, each naming line and field.
        rows_dropped: Well-formed rows removed by a rule of the format.
        drop_reason: Why those rows were dropped ("" when none were).
        notes: Approximations or interpretations the reader had to make.
    """

    format: str
    path: str
    rows_read: int
    requests: int
    rows_skipped: int = 0
    skip_reasons: tuple[str, ...] = ()
    rows_dropped: int = 0
    drop_reason: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        """One human-readable line (plus notes) for logs and the CLI."""
        text = f"{self.path}: {self.format}, {self.rows_read} rows -> {self.requests} requests"
        if self.rows_skipped:
            text += f"; {self.rows_skipped} malformed rows skipped"
            if self.skip_reasons:
                text += f" (first: {self.skip_reasons[0]})"
        if self.rows_dropped:
            text += f"; {self.rows_dropped} rows dropped: {self.drop_reason}"
        for note in self.notes:
            text += f"\n  note: {note}"
        return text


class _RowError(Exception):
    """A row cannot be read; turned into a TraceError or a skip by the common loop."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name
        self.message = message


@dataclass(frozen=True, slots=True)
class _Row:
    """One parsed row in the source's own time unit (see ``_Reader.seconds_per_unit``)."""

    time: int | float
    input_tokens: int
    output_tokens: int
    prefix_blocks: tuple[int, ...] = ()
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class _Drop:
    """A well-formed row that a format's rule removes (counted in the report)."""

    reason: str


_Record = tuple[int, Any]  # (1-based line, raw record), or (line, _RowError) when unparsable


# --------------------------------------------------------------------------- field parsing


def _as_int(value: Any, field_name: str) -> int:
    """An integer from JSON (int, or a float with no fraction) or a CSV string."""
    if isinstance(value, bool):
        raise _RowError(field_name, f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise _RowError(field_name, f"expected an integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            raise _RowError(field_name, f"expected an integer, got {value!r}") from None
        if math.isfinite(number) and number.is_integer():
            return int(number)
        raise _RowError(field_name, f"expected an integer, got {value!r}")
    raise _RowError(field_name, f"expected an integer, got {value!r}")


def _as_float(value: Any, field_name: str) -> float:
    """A finite number from JSON or a CSV string."""
    if isinstance(value, bool):
        raise _RowError(field_name, f"expected a number, got {value!r}")
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _RowError(field_name, f"expected a number, got {value!r}") from None
    else:
        raise _RowError(field_name, f"expected a number, got {value!r}")
    if not math.isfinite(number):
        raise _RowError(field_name, f"expected a finite number, got {value!r}")
    return number


def _length(value: Any, field_name: str) -> int:
    """A token count, which must be > 0."""
    number = _as_int(value, field_name)
    if number <= 0:
        raise _RowError(field_name, f"token count must be > 0, got {number}")
    return number


def _blocks(value: Any, field_name: str) -> tuple[int, ...]:
    """A list of integer block hash ids."""
    if not isinstance(value, list):
        raise _RowError(field_name, f"expected a list of integers, got {value!r}")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise _RowError(field_name, f"expected a list of integers, found {item!r}")
        out.append(item)
    return tuple(out)


def _require(record: Mapping[str, Any], key: str) -> Any:
    if key not in record or record[key] is None:
        raise _RowError(key, "missing")
    return record[key]


def _azure_time_ns(value: Any, field_name: str) -> int:
    """Nanoseconds since 1970 (UTC when an offset is given), exactly, from an Azure TIMESTAMP.

    ``datetime.fromisoformat`` would truncate the 7th fractional digit, so the fraction is
    parsed as an integer on its own.
    """
    match = _AZURE_TIME.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise _RowError(
            field_name, f"expected a datetime like 2023-11-16 18:17:03.9799600, got {value!r}"
        )
    base, fraction, zone = match.groups()
    try:
        moment = datetime.fromisoformat(base.replace("T", " "))
    except ValueError:
        raise _RowError(field_name, f"invalid datetime {value!r}") from None
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        digits = zone[1:].replace(":", "")
        moment -= sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    delta = moment - _EPOCH
    fraction_ns = int((fraction or "0").ljust(9, "0"))
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + fraction_ns


# --------------------------------------------------------------------------- raw readers


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return path.open(encoding="utf-8-sig", newline="")


def _base_suffix(path: Path) -> str:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return Path(name).suffix.lower()


def _json_lines(handle: IO[str]) -> Iterator[_Record]:
    """Yield (line, object) for every non-blank line; unparsable lines yield a _RowError."""
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, _RowError(None, f"malformed JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(value, dict):
            yield number, _RowError(None, f"expected a JSON object, got {type(value).__name__}")
            continue
        yield number, value


def _csv_rows(handle: IO[str], path: Path, required: Sequence[str]) -> Iterator[_Record]:
    """Yield (line, {column: text}) for every data row, columns found by header name."""
    reader = csv.reader(handle)
    header: list[str] | None = None
    for row in reader:
        if row and any(cell.strip() for cell in row):
            header = [cell.strip() for cell in row]
            break
    if header is None:
        raise TraceError("empty file: no CSV header", path=str(path))
    missing = [name for name in required if name not in header]
    if missing:
        raise TraceError(
            f"CSV header lacks column(s) {', '.join(missing)}; header is {', '.join(header)}",
            path=str(path),
            line=reader.line_num,
            field=missing[0],
        )
    for row in reader:
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            yield (
                reader.line_num,
                _RowError(
                    None, f"expected {len(header)} columns ({','.join(header)}), got {len(row)}"
                ),
            )
            continue
        yield reader.line_num, dict(zip(header, row, strict=True))


def _first_json(path: Path) -> tuple[int, dict[str, Any]]:
    with _open_text(path) as handle:
        for number, record in _json_lines(handle):
            if isinstance(record, _RowError):
                raise TraceError(
                    f"cannot detect the format: {record.message}", path=str(path), line=number
                )
            return number, record
    raise TraceError("empty file: no JSON lines", path=str(path))


def _first_csv_header(path: Path) -> list[str]:
    with _open_text(path) as handle:
        for row in csv.reader(handle):
            if row and any(cell.strip() for cell in row):
                return [cell.strip() for cell in row]
    raise TraceError("empty file: no CSV header", path=str(path))


# --------------------------------------------------------------------------- detection


def _json_format(record: Mapping[str, Any]) -> str | None:
    keys = set(record)
    if record.get("format") == CANONICAL_FORMAT or keys >= _CANONICAL_KEYS:
        return "canonical"
    if keys & _BAILIAN_MARKERS and keys >= _MOONCAKE_KEYS:
        return "bailian"
    if keys >= _MOONCAKE_KEYS:
        return "mooncake"
    if "prompt" in keys:
        return "vllm-custom"
    return None


def _csv_format(header: Sequence[str]) -> str | None:
    if all(name in header for name in _AZURE_COLUMNS):
        return "azure"
    if all(name in header for name in _BURSTGPT_COLUMNS):
        return "burstgpt"
    return None


def detect_format(path: str | Path) -> str:
    """Guess a trace file's format from its extension and its header or first JSON keys.

    ``.csv`` files are told apart by header, ``.jsonl``/``.json``/``.ndjson`` files by the keys
    of their first object; other extensions are sniffed by their first character. A ``.gz``
    suffix is looked through.

    Args:
        path: The trace file.

    Returns:
        One of :data:`FORMATS`.

    Raises:
        TraceError: The file is empty or matches no known format.
    """
    path = Path(path)
    suffix = _base_suffix(path)
    if suffix not in (".csv", ".jsonl", ".json", ".ndjson"):
        with _open_text(path) as handle:
            head = handle.read(4096).lstrip()
        suffix = ".jsonl" if head.startswith("{") else ".csv"
    if suffix == ".csv":
        header = _first_csv_header(path)
        found = _csv_format(header)
        if found is None:
            raise TraceError(
                f"unknown CSV trace format (header: {','.join(header)}); expected Azure "
                f"({','.join(_AZURE_COLUMNS)}) or BurstGPT ({','.join(_BURSTGPT_COLUMNS)}, ...)",
                path=str(path),
                line=1,
            )
        return found
    line, record = _first_json(path)
    found = _json_format(record)
    if found is None:
        raise TraceError(
            f"unknown JSONL trace format (keys: {', '.join(sorted(record))}); expected one of "
            f"{', '.join(FORMATS)}",
            path=str(path),
            line=line,
        )
    return found


# --------------------------------------------------------------------------- per-format rows


@dataclass(slots=True)
class _Reader:
    """How to turn one format's records into rows."""

    records: Callable[[IO[str], Path], Iterator[_Record]]
    parse: Callable[[Any], _Row | _Drop]
    time_field: str
    seconds_per_unit: float
    block_size: int = 512
    rebase: bool = True
    notes: list[str] = field(default_factory=list)
    late_notes: Callable[[], list[str]] = list


def _canonical_parse(record: Mapping[str, Any]) -> _Row:
    unknown = set(record) - _CANONICAL_KEYS - _CANONICAL_OPTIONAL
    if unknown:
        name = sorted(unknown)[0]
        raise _RowError(
            name,
            f"unknown key (accepted: {', '.join(sorted(_CANONICAL_KEYS | _CANONICAL_OPTIONAL))})",
        )
    arrival_s = _as_float(_require(record, "arrival_s"), "arrival_s")
    if arrival_s < 0:
        raise _RowError("arrival_s", f"must be >= 0, got {arrival_s}")
    session = record.get("session_id")
    if session is not None and not isinstance(session, str):
        raise _RowError("session_id", f"expected a string, got {session!r}")
    return _Row(
        time=arrival_s,
        input_tokens=_length(_require(record, "input_tokens"), "input_tokens"),
        output_tokens=_length(_require(record, "output_tokens"), "output_tokens"),
        prefix_blocks=_blocks(record.get("prefix_blocks", []), "prefix_blocks"),
        session_id=session,
    )


def _mooncake_parse(record: Mapping[str, Any]) -> _Row:
    return _Row(
        time=_as_float(_require(record, "timestamp"), "timestamp"),
        input_tokens=_length(_require(record, "input_length"), "input_length"),
        output_tokens=_length(_require(record, "output_length"), "output_length"),
        prefix_blocks=_blocks(record.get("hash_ids", []), "hash_ids"),
    )


def _azure_parse(record: Mapping[str, str]) -> _Row:
    return _Row(
        time=_azure_time_ns(record["TIMESTAMP"], "TIMESTAMP"),
        input_tokens=_length(record["ContextTokens"], "ContextTokens"),
        output_tokens=_length(record["GeneratedTokens"], "GeneratedTokens"),
    )


_BURSTGPT_FAILED = "Response tokens == 0 (a failed request in BurstGPT)"


def _burstgpt_parse(record: Mapping[str, str]) -> _Row | _Drop:
    time = _as_float(record["Timestamp"], "Timestamp")
    response = _as_int(record["Response tokens"], "Response tokens")
    request = _length(record["Request tokens"], "Request tokens")
    if response == 0:
        return _Drop(_BURSTGPT_FAILED)
    if response < 0:
        raise _RowError("Response tokens", f"token count must be >= 0, got {response}")
    session = (record.get("Session ID") or "").strip() or None
    return _Row(time=time, input_tokens=request, output_tokens=response, session_id=session)


def _bailian_parser() -> Callable[[Mapping[str, Any]], _Row]:
    roots: dict[int, int] = {}

    def parse(record: Mapping[str, Any]) -> _Row:
        session: str | None = None
        if "chat_id" in record:
            chat_id = _as_int(record["chat_id"], "chat_id")
            parent = _as_int(record.get("parent_chat_id", -1), "parent_chat_id")
            # A parent outside the file (a slice) still names the session it belongs to.
            root = chat_id if parent < 0 else roots.get(parent, parent)
            roots[chat_id] = root
            session = str(root)
        return _Row(
            time=_as_float(_require(record, "timestamp"), "timestamp"),
            input_tokens=_length(_require(record, "input_length"), "input_length"),
            output_tokens=_length(_require(record, "output_length"), "output_length"),
            prefix_blocks=_blocks(record.get("hash_ids", []), "hash_ids"),
            session_id=session,
        )

    return parse


class _CustomParser:
    """vLLM custom rows; counts the rows whose input length had to be approximated."""

    def __init__(self) -> None:
        self.approximated = 0

    def __call__(self, record: Mapping[str, Any]) -> _Row:
        prompt = _require(record, "prompt")
        if not isinstance(prompt, str):
            raise _RowError("prompt", f"expected a string, got {type(prompt).__name__}")
        output = _length(_require(record, "output_tokens"), "output_tokens")
        if record.get("input_tokens") is not None:
            tokens = _length(record["input_tokens"], "input_tokens")
        else:
            tokens = len(prompt.split())
            if tokens <= 0:
                raise _RowError("prompt", "empty prompt")
            self.approximated += 1
        return _Row(time=0.0, input_tokens=tokens, output_tokens=output)

    def notes(self) -> list[str]:
        if not self.approximated:
            return []
        return [
            f"input_tokens approximated by the prompt's whitespace word count for "
            f"{self.approximated} row(s) without an input_tokens key; real token counts "
            f"depend on the model's tokenizer"
        ]


def _json_records(handle: IO[str], path: Path) -> Iterator[_Record]:
    return _json_lines(handle)


def _canonical_records(handle: IO[str], path: Path) -> Iterator[_Record]:
    """Canonical lines, with the optional header consumed (and checked) first."""
    first = True
    for number, record in _json_lines(handle):
        if first and isinstance(record, dict) and "format" in record:
            first = False
            continue
        first = False
        yield number, record


def _reader(fmt: str, path: Path) -> _Reader:
    if fmt == "canonical":
        block_size, source_notes = _canonical_header(path)
        return _Reader(
            _canonical_records,
            _canonical_parse,
            "arrival_s",
            1.0,
            block_size=block_size,
            rebase=False,
            notes=source_notes,
        )
    if fmt == "azure":
        return _Reader(
            lambda h, p: _csv_rows(h, p, _AZURE_COLUMNS), _azure_parse, "TIMESTAMP", 1e-9
        )
    if fmt == "burstgpt":
        return _Reader(
            lambda h, p: _csv_rows(h, p, _BURSTGPT_COLUMNS), _burstgpt_parse, "Timestamp", 1.0
        )
    if fmt == "mooncake":
        return _Reader(
            _json_records, _mooncake_parse, "timestamp", 1e-3, block_size=_MOONCAKE_BLOCK_SIZE
        )
    if fmt == "bailian":
        match = re.search(r"blksz_(\d+)", path.name)
        block_size = int(match.group(1)) if match else _BAILIAN_BLOCK_SIZE
        return _Reader(
            _json_records,
            _bailian_parser(),
            "timestamp",
            1.0,
            block_size=block_size,
            notes=[f"block_size {block_size} tokens per hash id"],
        )
    if fmt == "vllm-custom":
        parser = _CustomParser()
        notes = [
            "the vLLM custom format carries no timing: every arrival_s is 0; "
            "replay it at a fixed request rate"
        ]
        return _Reader(_json_records, parser, "prompt", 1.0, notes=notes, late_notes=parser.notes)
    raise TraceError(
        f"unknown trace format {fmt!r}; expected 'auto' or one of {', '.join(FORMATS)}",
        path=str(path),
    )


def _canonical_header(path: Path) -> tuple[int, list[str]]:
    """Block size and notes from a canonical file's optional header line."""
    with _open_text(path) as handle:
        line, record = next(_json_lines(handle), (0, None))
    if not isinstance(record, dict) or "format" not in record:
        return 512, []  # no header (a malformed first line is reported as a row)
    if record["format"] != CANONICAL_FORMAT:
        raise TraceError(
            f"header names format {record['format']!r}, expected {CANONICAL_FORMAT!r}",
            path=str(path),
            line=line,
            field="format",
        )
    if record.get("version") != _CANONICAL_VERSION:
        raise TraceError(
            f"unsupported version {record.get('version')!r} (this reader knows "
            f"version {_CANONICAL_VERSION})",
            path=str(path),
            line=line,
            field="version",
        )
    block_size = record.get("block_size", 512)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise TraceError(
            f"block_size must be a positive integer, got {block_size!r}",
            path=str(path),
            line=line,
            field="block_size",
        )
    source = record.get("source")
    return block_size, [f"recorded source: {source}"] if source else []


# --------------------------------------------------------------------------- public API


@dataclass
class _Tally:
    """The rows of a trace file that became requests, and an account of the others."""

    rows: list[_Row] = field(default_factory=list)
    rows_read: int = 0
    skipped: int = 0
    dropped: int = 0
    reasons: list[str] = field(default_factory=list)
    drop_reason: str = ""


def _read_rows(reader: _Reader, path: Path, skip_bad_rows: bool) -> _Tally:
    """Parse every row of ``path``; a malformed one raises TraceError unless skipped."""
    tally = _Tally()
    previous: int | float | None = None

    def bad(line: int, error: _RowError) -> None:
        if not skip_bad_rows:
            raise TraceError(error.message, path=str(path), line=line, field=error.field_name)
        tally.skipped += 1
        if len(tally.reasons) < _MAX_REASONS:
            where = f"line {line}" + (f" [{error.field_name}]" if error.field_name else "")
            tally.reasons.append(f"{where}: {error.message}")

    with _open_text(path) as handle:
        for line, record in reader.records(handle, path):
            tally.rows_read += 1
            if isinstance(record, _RowError):
                bad(line, record)
                continue
            try:
                row = reader.parse(record)
            except _RowError as error:
                bad(line, error)
                continue
            if isinstance(row, _Drop):
                tally.dropped += 1
                tally.drop_reason = row.reason
                continue
            if previous is not None and row.time < previous:
                bad(
                    line,
                    _RowError(
                        reader.time_field,
                        f"timestamp goes backwards ({row.time!r} after {previous!r}); traces must "
                        f"be sorted by arrival",
                    ),
                )
                continue
            previous = row.time
            tally.rows.append(row)
    return tally


def read_trace(
    path: str | Path, fmt: str = "auto", *, skip_bad_rows: bool = False
) -> tuple[Trace, ReadReport]:
    """Read a trace file of any supported format.

    Args:
        path: The file (``.gz`` compressed files are read transparently).
        fmt: ``"auto"`` to detect the format, or one of :data:`FORMATS`.
        skip_bad_rows: Skip malformed rows (bad JSON, missing/non-numeric field, a length
            <= 0, a timestamp going backwards) and count them in the report instead of
            raising.

    Returns:
        The trace (arrivals rebased to start at 0 s, except canonical files, which are kept
        as written) and the report accounting for every row.

    Raises:
        TraceError: The format is unknown, the header is wrong, no request could be read, or
            (without ``skip_bad_rows``) a row is malformed; the error names file, line, field.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError("no such file", path=str(path))
    name = detect_format(path) if fmt == "auto" else fmt
    reader = _reader(name, path)

    tally = _read_rows(reader, path, skip_bad_rows)
    rows, skipped, dropped = tally.rows, tally.skipped, tally.dropped
    if not rows:
        detail = f" ({skipped} malformed, {dropped} dropped)" if skipped or dropped else ""
        raise TraceError(f"no requests could be read{detail}", path=str(path))

    origin = rows[0].time if reader.rebase else 0
    requests = tuple(
        TraceRequest(
            arrival_s=(row.time - origin) * reader.seconds_per_unit,
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            prefix_blocks=row.prefix_blocks,
            session_id=row.session_id,
        )
        for row in rows
    )
    trace = Trace(requests=requests, block_size=reader.block_size, source=f"{path.name} ({name})")
    report = ReadReport(
        format=name,
        path=str(path),
        rows_read=tally.rows_read,
        requests=len(requests),
        rows_skipped=skipped,
        skip_reasons=tuple(tally.reasons),
        rows_dropped=dropped,
        drop_reason=tally.drop_reason,
        notes=(*reader.notes, *reader.late_notes()),
    )
    return trace, report


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace in the canonical JSONL format (header line first).

    Floats are written with ``repr`` precision, so :func:`read_trace` gives back an equal
    trace.

    Args:
        trace: The trace to write.
        path: Destination file (overwritten).
    """
    path = Path(path)
    header = {
        "format": CANONICAL_FORMAT,
        "version": _CANONICAL_VERSION,
        "block_size": trace.block_size,
        "source": trace.source,
    }
    with path.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(header) + "\n")
        for request in trace.requests:
            row: dict[str, Any] = {
                "arrival_s": request.arrival_s,
                "input_tokens": request.input_tokens,
                "output_tokens": request.output_tokens,
            }
            if request.prefix_blocks:
                row["prefix_blocks"] = list(request.prefix_blocks)
            if request.session_id is not None:
                row["session_id"] = request.session_id
            handle.write(json.dumps(row) + "\n")


# 64 characters that a byte-level tokenizer maps to one token each and that no text
# normalisation touches (no whitespace, no quotes).
_ALPHABET = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
_TO_ALPHABET = bytes(_ALPHABET[i % len(_ALPHABET)] for i in range(256))


def _filler(key: str, length: int) -> str:
    if length <= 0:
        return ""
    return hashlib.shake_256(key.encode()).digest(length).translate(_TO_ALPHABET).decode("ascii")


def prompt_text(request: TraceRequest, index: int, block_size: int, seed: int = 0) -> str:
    """A prompt of exactly ``request.input_tokens`` ASCII characters, deterministic.

    Under a byte-level tokenizer (one byte per token) its length in tokens is its length in
    characters. Each prefix block becomes the same ``block_size`` characters wherever its id
    appears, so shared blocks hit the prefix cache as in production; the rest is derived from
    ``index`` and so fresh for every request (the same text twice would be served from the
    cache and hide the prefill).

    Args:
        request: The request.
        index: Its position in the trace (seeds the fresh part).
        block_size: Tokens per prefix block.
        seed: Another seed gives other prompts (same lengths, same sharing); seed 0 gives the
            prompts of releases that had no seed.

    Returns:
        The prompt text.
    """
    salt = f"seed:{seed}:" if seed else ""
    parts: list[str] = []
    remaining = request.input_tokens
    for block in request.prefix_blocks:
        if remaining <= 0:
            break
        size = min(block_size, remaining)
        parts.append(_filler(f"{salt}block:{block_size}:{block}", block_size)[:size])
        remaining -= size
    parts.append(_filler(f"{salt}request:{index}", remaining))
    return "".join(parts)


def export_vllm_custom(trace: Trace, path: str | Path, seed: int = 0) -> tuple[str, ...]:
    """Write the trace as vLLM's benchmark ``custom`` dataset JSONL.

    Each line is ``{"prompt": ..., "output_tokens": N, "input_tokens": M}``: vLLM's
    ``CustomDataset`` reads ``prompt`` and ``output_tokens`` (used when
    ``--custom-output-len -1`` is given) and ignores other keys; ``input_tokens`` lets
    :func:`read_trace` read the file back with exact lengths. Prompts come from
    :func:`prompt_text`: exactly ``input_tokens`` characters, one token each under the
    project's byte-level tokenizer, fresh per request except for shared prefix blocks.

    Arrival times are *not* carried by this format: ``vllm bench serve`` schedules requests
    itself from ``--request-rate`` (Poisson, or gamma with ``--burstiness``). A cross-check
    therefore replays the same requests at the same mean request rate and burstiness, which
    is what the returned arguments say. vLLM applies the model's chat template to custom
    prompts unless ``--skip-chat-template`` is given, and shuffles them, so pass the
    returned arguments unchanged to keep the prompts (and their lengths) as written.

    Args:
        trace: The requests to export.
        path: Destination ``.jsonl`` file (vLLM requires that extension).
        seed: Seeds the prompts (:func:`prompt_text`) and is passed on as ``--seed``, which
            seeds the arrival times ``vllm bench serve`` draws.

    Returns:
        The ``vllm bench serve`` arguments that replay this file with matching load.
    """
    from optimizer.workload.stats import inspect_trace  # stats never imports formats

    path = Path(path)
    with path.open("w", encoding="utf-8") as handle:
        for index, request in enumerate(trace.requests):
            row = {
                "prompt": prompt_text(request, index, trace.block_size, seed),
                "output_tokens": request.output_tokens,
                "input_tokens": request.input_tokens,
            }
            handle.write(json.dumps(row) + "\n")
    stats = inspect_trace(trace)
    rate = float(stats["mean_rate_rps"])
    cv = float(stats["burstiness_cv"])
    args = [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(path),
        "--num-prompts",
        str(len(trace)),
        "--custom-output-len",
        "-1",
        # vLLM >= 0.30 spells it --skip-chat-template (older: --custom-skip-chat-template).
        "--skip-chat-template",
        # Same order as the trace, and exactly the trace's output lengths.
        "--disable-shuffle",
        "--ignore-eos",
        "--request-rate",
        repr(rate) if rate > 0 else "inf",
        "--seed",
        str(seed),
    ]
    if rate > 0 and cv > 0:
        # vLLM draws gaps from a gamma with shape = burstiness, whose CV is 1/sqrt(shape).
        args += ["--burstiness", repr(1.0 / (cv * cv))]
    return tuple(args)
