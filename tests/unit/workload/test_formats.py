"""Trace importers, auto-detection, bad input, the canonical round trip and the vLLM export."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from optimizer.errors import TraceError
from optimizer.types import Trace, TraceRequest
from optimizer.workload.formats import (
    FORMATS,
    detect_format,
    export_vllm_custom,
    prompt_text,
    read_trace,
    write_trace,
)

EXAMPLES = Path(__file__).parents[3] / "examples" / "traces"
AZURE_SLICE = EXAMPLES / "azure2023_code_600.csv"
MOONCAKE_SLICE = EXAMPLES / "mooncake_synthetic_300.jsonl"

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURST_V1_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
BURST_V2_HEADER = (
    "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def shipped_lines(path: Path, count: int) -> str:
    """The first ``count`` lines of a shipped trace slice, as written."""
    with path.open(encoding="utf-8") as handle:
        return "".join(next(handle) for _ in range(count))


# ----------------------------------------------------------------- real rows of shipped traces


def test_azure_slice_reads_every_row_with_exact_fractions() -> None:
    trace, report = read_trace(AZURE_SLICE)
    assert report.format == "azure"
    assert (report.rows_read, report.requests, report.rows_skipped, report.rows_dropped) == (
        600,
        600,
        0,
        0,
    )
    first, second, third = trace.requests[:3]
    assert (first.arrival_s, first.input_tokens, first.output_tokens) == (0.0, 4808, 10)
    # 18:17:04.0319600 - 18:17:03.9799600 and 18:17:04.0781490 - 18:17:03.9799600
    assert second.arrival_s == pytest.approx(0.052, abs=1e-12)
    assert third.arrival_s == pytest.approx(0.098189, abs=1e-12)
    assert (second.input_tokens, second.output_tokens) == (3180, 8)
    assert trace.block_size == 512
    assert all(r.prefix_blocks == () and r.session_id is None for r in trace.requests)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert "azure2023_code_600.csv" in trace.source


def test_azure_seventh_fractional_digit_is_not_truncated(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "t.csv",
        AZURE_HEADER
        + "2023-11-16 18:17:03.0000000,10,2\n"
        + "2023-11-16 18:17:03.0000001,10,2\n"
        + "2023-11-16 18:17:04.9999999,10,2\n",
    )
    trace, _ = read_trace(path)
    assert trace.requests[1].arrival_s == pytest.approx(1e-7, abs=1e-15)
    assert trace.requests[2].arrival_s == pytest.approx(1.9999999, abs=1e-12)


def test_azure_2024_timestamps_with_utc_offset_cross_midnight(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "t.csv",
        AZURE_HEADER
        + "2024-05-10 23:59:59.5000000+00:00,100,20\n"
        + "2024-05-11 00:00:00.2500000+00:00,200,30\n"
        + "2024-05-11 02:00:01.0000000+02:00,300,40\n",
    )
    trace, report = read_trace(path)
    assert report.format == "azure"
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0.0, 0.75, 1.5])


def test_mooncake_slice_keeps_prefix_blocks_and_ms_timestamps() -> None:
    trace, report = read_trace(MOONCAKE_SLICE)
    assert report.format == "mooncake"
    assert report.requests == len(trace) == 300
    assert trace.block_size == 512
    first = json.loads(shipped_lines(MOONCAKE_SLICE, 1))
    assert trace.requests[0].prefix_blocks == tuple(first["hash_ids"])
    assert trace.requests[0].input_tokens == first["input_length"]
    assert trace.requests[0].output_tokens == first["output_length"]
    rows = [json.loads(line) for line in shipped_lines(MOONCAKE_SLICE, 300).splitlines()]
    assert [r.arrival_s for r in trace.requests] == pytest.approx(
        [(row["timestamp"] - rows[0]["timestamp"]) / 1000 for row in rows]
    )
    for request in trace.requests:
        assert len(request.prefix_blocks) == math.ceil(request.input_tokens / 512)


# ----------------------------------------------------------------- hand-written fixtures


def test_burstgpt_v1_layout_drops_failures_with_a_count(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "burst.csv",
        BURST_V1_HEADER
        + "5,ChatGPT,472,18,490,Conversation log\n"
        + "45,ChatGPT,1087,0,1087,Conversation log\n"
        + "118,GPT-4,417,276,693,API log\n"
        + "118,ChatGPT,1360,0,1360,API log\n"
        + "130,GPT-4,90,12,102,API log\n",
    )
    trace, report = read_trace(path)
    assert report.format == "burstgpt"
    assert (report.rows_read, report.requests, report.rows_dropped) == (5, 3, 2)
    assert "Response tokens == 0" in report.drop_reason
    assert [r.arrival_s for r in trace.requests] == [0.0, 113.0, 125.0]
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests] == [
        (472, 18),
        (417, 276),
        (90, 12),
    ]
    assert all(r.session_id is None for r in trace.requests)
    assert "2 rows dropped" in report.summary()


def test_burstgpt_v2_layout_reads_sessions_by_header_name(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "BurstGPT_3.csv",
        BURST_V2_HEADER + "19440110.0,1722ac82-0a46-4bf0-aa08-89794e7a2b3f,43,GPT-4,906,446,1352,"
        "Conversation log\n" + "19440161.0,d5983bf9-4b48-497b-892b-a58995247443,2,ChatGPT,36,29,65,"
        "Conversation log\n"
        + "19440170.5,,1,ChatGPT,50,0,50,API log\n"
        + "19440192.0,1722ac82-0a46-4bf0-aa08-89794e7a2b3f,8,GPT-4,1779,123,1902,"
        "Conversation log\n",
    )
    trace, report = read_trace(path)
    assert report.format == "burstgpt"
    assert (report.requests, report.rows_dropped) == (3, 1)
    assert [r.arrival_s for r in trace.requests] == [0.0, 51.0, 82.0]
    assert [r.session_id for r in trace.requests] == [
        "1722ac82-0a46-4bf0-aa08-89794e7a2b3f",
        "d5983bf9-4b48-497b-892b-a58995247443",
        "1722ac82-0a46-4bf0-aa08-89794e7a2b3f",
    ]
    assert (trace.requests[2].input_tokens, trace.requests[2].output_tokens) == (1779, 123)


BAILIAN_ROWS: list[dict[str, object]] = [
    {
        "chat_id": 10,
        "parent_chat_id": -1,
        "timestamp": 0.5,
        "input_length": 40,
        "output_length": 7,
        "type": "text",
        "turn": 1,
        "hash_ids": [1, 2, 3],
    },
    {
        "chat_id": 11,
        "parent_chat_id": -1,
        "timestamp": 1.25,
        "input_length": 17,
        "output_length": 3,
        "type": "search",
        "turn": 1,
        "hash_ids": [4, 5],
    },
    {
        "chat_id": 12,
        "parent_chat_id": 10,
        "timestamp": 2.0,
        "input_length": 60,
        "output_length": 9,
        "type": "text",
        "turn": 2,
        "hash_ids": [1, 2, 3, 6],
    },
    {
        "chat_id": 13,
        "parent_chat_id": 12,
        "timestamp": 3.5,
        "input_length": 80,
        "output_length": 4,
        "type": "text",
        "turn": 3,
        "hash_ids": [1, 2, 3, 6, 7],
    },
    {
        "chat_id": 14,
        "parent_chat_id": 7,
        "timestamp": 4.0,
        "input_length": 16,
        "output_length": 2,
        "type": "file",
        "turn": 5,
        "hash_ids": [8],
    },
]


def test_bailian_sessions_follow_parent_chain_and_blocks_are_16_tokens(tmp_path: Path) -> None:
    path = write(tmp_path, "qwen_traceA_blksz_16.jsonl", jsonl(BAILIAN_ROWS))
    trace, report = read_trace(path)
    assert report.format == "bailian"
    assert trace.block_size == 16
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.75, 1.5, 3.0, 3.5]
    # 12 and 13 continue chat 10; 14's parent lies outside the file and names its session.
    assert [r.session_id for r in trace.requests] == ["10", "11", "10", "10", "7"]
    assert trace.requests[3].prefix_blocks == (1, 2, 3, 6, 7)


def test_bailian_block_size_comes_from_file_name(tmp_path: Path) -> None:
    path = write(tmp_path, "qwen_coder_blksz_32.jsonl", jsonl(BAILIAN_ROWS[:2]))
    trace, _ = read_trace(path)
    assert trace.block_size == 32
    trace, _ = read_trace(write(tmp_path, "bailian.jsonl", jsonl(BAILIAN_ROWS[:2])))
    assert trace.block_size == 16


def test_vllm_custom_uses_explicit_input_tokens_else_word_count_and_says_so(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        "custom.jsonl",
        jsonl(
            [
                {"prompt": "What is the capital of India?", "output_tokens": 10},
                {"prompt": "xxxxxxxxxx", "output_tokens": 5, "input_tokens": 10},
                {"prompt": "one two  three\nfour", "output_tokens": 1},
            ]
        ),
    )
    trace, report = read_trace(path)
    assert report.format == "vllm-custom"
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests] == [
        (6, 10),
        (10, 5),
        (4, 1),
    ]
    assert all(r.arrival_s == 0.0 for r in trace.requests)
    assert any("no timing" in note for note in report.notes)
    assert any("approximated" in note and "2 row(s)" in note for note in report.notes)


def test_vllm_custom_without_approximation_has_no_approximation_note(tmp_path: Path) -> None:
    path = write(
        tmp_path, "custom.jsonl", jsonl([{"prompt": "abc", "output_tokens": 2, "input_tokens": 3}])
    )
    _, report = read_trace(path)
    assert not any("approximated" in note for note in report.notes)


def test_gzip_files_are_read_transparently(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(shipped_lines(AZURE_SLICE, 11))
    trace, report = read_trace(path)
    assert (report.format, len(trace)) == ("azure", 10)


# ----------------------------------------------------------------- auto-detection


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("a.csv", AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n", "azure"),
        ("b.csv", BURST_V1_HEADER + "5,ChatGPT,472,18,490,Conversation log\n", "burstgpt"),
        ("c.csv", BURST_V2_HEADER + "1.0,s,3,GPT-4,9,9,18,API log\n", "burstgpt"),
        (
            "d.jsonl",
            jsonl([{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}]),
            "mooncake",
        ),
        ("e.jsonl", jsonl(BAILIAN_ROWS[:1]), "bailian"),
        ("f.jsonl", jsonl([{"prompt": "hi", "output_tokens": 3}]), "vllm-custom"),
        (
            "g.jsonl",
            jsonl([{"arrival_s": 0.0, "input_tokens": 5, "output_tokens": 2}]),
            "canonical",
        ),
        (
            "h.jsonl",
            jsonl(
                [
                    {"format": "vllm-autotune-trace", "version": 1},
                    {"arrival_s": 0.0, "input_tokens": 5, "output_tokens": 2},
                ]
            ),
            "canonical",
        ),
        ("i.txt", AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n", "azure"),
        ("j.log", jsonl([{"prompt": "hi", "output_tokens": 3}]), "vllm-custom"),
    ],
)
def test_detect_format(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = write(tmp_path, name, text)
    assert detect_format(path) == expected
    assert expected in FORMATS
    _, report = read_trace(path)
    assert report.format == expected


def test_explicit_format_overrides_detection(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "odd.jsonl",
        jsonl(
            [
                {"timestamp": 0, "input_length": 5, "output_length": 1, "chat_id": 1},
            ]
        ),
    )
    _, report = read_trace(path, fmt="mooncake")
    assert report.format == "mooncake"


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        ("x.csv", "a,b,c\n1,2,3\n", 1),
        ("x.jsonl", "\n" + jsonl([{"foo": 1, "bar": 2}]), 2),
    ],
)
def test_unknown_format_names_file_and_line(
    tmp_path: Path, name: str, text: str, line: int
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError, match="unknown") as info:
        read_trace(path)
    assert (info.value.path, info.value.line) == (str(path), line)


def test_unknown_format_name_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n")
    with pytest.raises(TraceError, match="unknown trace format 'parquet'"):
        read_trace(path, fmt="parquet")


def test_explicit_format_with_missing_columns_names_the_column(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:17:03.9799600,4808,10\n")
    with pytest.raises(TraceError) as info:
        read_trace(path, fmt="burstgpt")
    assert (info.value.line, info.value.field) == (1, "Timestamp")


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_empty_files_raise(tmp_path: Path, text: str) -> None:
    for name in ("e.csv", "e.jsonl"):
        with pytest.raises(TraceError, match="empty"):
            read_trace(write(tmp_path, name, text))


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "absent.csv")


# ----------------------------------------------------------------- bad rows: file, line, field

AZ_OK = "2023-11-16 18:17:03.9799600,4808,10\n"
MC = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}


def mooncake_rows(*changes: dict[str, object]) -> str:
    rows = []
    for index, change in enumerate(changes):
        row = {**MC, "timestamp": index * 10, **change}
        rows.append({k: v for k, v in row.items() if v is not ...})
    return jsonl(rows)


BAD_CASES = [
    # (id, file name, text, 1-based line, field)
    (
        "azure-non-numeric",
        "a.csv",
        AZURE_HEADER + AZ_OK + "2023-11-16 18:17:04.0000000,abc,10\n",
        3,
        "ContextTokens",
    ),
    (
        "azure-zero-output",
        "a.csv",
        AZURE_HEADER + AZ_OK + "2023-11-16 18:17:04.0000000,5,0\n",
        3,
        "GeneratedTokens",
    ),
    (
        "azure-negative-input",
        "a.csv",
        AZURE_HEADER + "2023-11-16 18:17:04.0000000,-5,3\n",
        2,
        "ContextTokens",
    ),
    (
        "azure-fractional-length",
        "a.csv",
        AZURE_HEADER + "2023-11-16 18:17:04.0000000,5.5,3\n",
        2,
        "ContextTokens",
    ),
    ("azure-bad-timestamp", "a.csv", AZURE_HEADER + AZ_OK + "yesterday,5,3\n", 3, "TIMESTAMP"),
    (
        "azure-impossible-date",
        "a.csv",
        AZURE_HEADER + "2023-02-30 18:17:04.0000000,5,3\n",
        2,
        "TIMESTAMP",
    ),
    (
        "azure-non-monotonic",
        "a.csv",
        AZURE_HEADER
        + AZ_OK
        + "2023-11-16 18:17:05.0000000,5,3\n"
        + "2023-11-16 18:17:03.0000000,5,3\n",
        4,
        "TIMESTAMP",
    ),
    (
        "azure-missing-column",
        "a.csv",
        AZURE_HEADER + AZ_OK + "2023-11-16 18:17:05.0000000,5\n",
        3,
        None,
    ),
    (
        "mooncake-malformed-json",
        "m.jsonl",
        mooncake_rows({}) + '{"timestamp": 5, "input_length": \n',
        2,
        None,
    ),
    ("mooncake-not-an-object", "m.jsonl", mooncake_rows({}) + "[1, 2]\n", 2, None),
    (
        "mooncake-missing-field",
        "m.jsonl",
        mooncake_rows({}, {"output_length": ...}),
        2,
        "output_length",
    ),
    (
        "mooncake-string-length",
        "m.jsonl",
        mooncake_rows({}, {"input_length": "many"}),
        2,
        "input_length",
    ),
    (
        "mooncake-bool-length",
        "m.jsonl",
        mooncake_rows({}, {"output_length": True}),
        2,
        "output_length",
    ),
    ("mooncake-non-monotonic", "m.jsonl", mooncake_rows({}, {}, {"timestamp": 5}), 3, "timestamp"),
    ("mooncake-bad-hash-ids", "m.jsonl", mooncake_rows({}, {"hash_ids": "0,1"}), 2, "hash_ids"),
    (
        "mooncake-nan-timestamp",
        "m.jsonl",
        mooncake_rows({}) + '{"timestamp": NaN, "input_length": 5, "output_length": 1}\n',
        2,
        "timestamp",
    ),
    (
        "burstgpt-non-numeric",
        "b.csv",
        BURST_V1_HEADER + "5,ChatGPT,lots,18,490,Conversation log\n",
        2,
        "Request tokens",
    ),
    (
        "burstgpt-negative-response",
        "b.csv",
        BURST_V1_HEADER + "5,ChatGPT,10,-1,9,Conversation log\n",
        2,
        "Response tokens",
    ),
    (
        "burstgpt-zero-request",
        "b.csv",
        BURST_V1_HEADER + "5,ChatGPT,0,4,4,Conversation log\n",
        2,
        "Request tokens",
    ),
    (
        "burstgpt-non-monotonic",
        "b.csv",
        BURST_V1_HEADER + "5,ChatGPT,10,4,14,API log\n4,ChatGPT,10,4,14,API log\n",
        3,
        "Timestamp",
    ),
    (
        "bailian-zero-input",
        "q.jsonl",
        jsonl([{**BAILIAN_ROWS[0], "input_length": 0}]),
        1,
        "input_length",
    ),
    (
        "custom-missing-output",
        "c.jsonl",
        jsonl([{"prompt": "a b", "output_tokens": 1}, {"prompt": "a b"}]),
        2,
        "output_tokens",
    ),
    (
        "custom-non-string-prompt",
        "c.jsonl",
        jsonl([{"prompt": "a b", "output_tokens": 1}, {"prompt": 5, "output_tokens": 1}]),
        2,
        "prompt",
    ),
    (
        "canonical-unknown-key",
        "t.jsonl",
        jsonl(
            [
                {"arrival_s": 0, "input_tokens": 5, "output_tokens": 1},
                {"arrival_s": 1, "input_tokens": 5, "output_tokens": 1, "prompt_len": 3},
            ]
        ),
        2,
        "prompt_len",
    ),
    (
        "canonical-negative-arrival",
        "t.jsonl",
        jsonl([{"arrival_s": -1, "input_tokens": 5, "output_tokens": 1}]),
        1,
        "arrival_s",
    ),
    (
        "canonical-zero-output",
        "t.jsonl",
        jsonl(
            [
                {"format": "vllm-autotune-trace", "version": 1},
                {"arrival_s": 0, "input_tokens": 5, "output_tokens": 0},
            ]
        ),
        2,
        "output_tokens",
    ),
    (
        "canonical-session-not-string",
        "t.jsonl",
        jsonl([{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "session_id": 3}]),
        1,
        "session_id",
    ),
    (
        "canonical-bad-version",
        "t.jsonl",
        jsonl(
            [
                {"format": "vllm-autotune-trace", "version": 2},
                {"arrival_s": 0, "input_tokens": 5, "output_tokens": 1},
            ]
        ),
        1,
        "version",
    ),
    (
        "canonical-bad-block-size",
        "t.jsonl",
        jsonl(
            [
                {"format": "vllm-autotune-trace", "version": 1, "block_size": 0},
                {"arrival_s": 0, "input_tokens": 5, "output_tokens": 1},
            ]
        ),
        1,
        "block_size",
    ),
]


@pytest.mark.parametrize(
    ("name", "text", "line", "field"),
    [case[1:] for case in BAD_CASES],
    ids=[case[0] for case in BAD_CASES],
)
def test_bad_input_names_file_line_and_field(
    tmp_path: Path, name: str, text: str, line: int, field: str | None
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    error = info.value
    assert (error.path, error.line, error.field) == (str(path), line, field)
    assert str(error).startswith(f"{path}:{line}")
    if field:
        assert f"[{field}]" in str(error)


def test_skip_bad_rows_counts_every_skipped_row(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "a.csv",
        AZURE_HEADER
        + "2023-11-16 18:17:03.0000000,100,10\n"
        + "2023-11-16 18:17:04.0000000,abc,10\n"
        + "2023-11-16 18:17:05.0000000,200,20\n"
        + "2023-11-16 18:17:01.0000000,300,30\n"  # goes backwards
        + "2023-11-16 18:17:06.0000000,400\n"  # a column short
        + "2023-11-16 18:17:07.0000000,500,0\n"  # zero output
        + "2023-11-16 18:17:08.0000000,600,60\n",
    )
    trace, report = read_trace(path, skip_bad_rows=True)
    assert [r.input_tokens for r in trace.requests] == [100, 200, 600]
    assert [r.arrival_s for r in trace.requests] == pytest.approx([0.0, 2.0, 5.0])
    assert (report.rows_read, report.requests, report.rows_skipped) == (7, 3, 4)
    assert report.rows_read == report.requests + report.rows_skipped + report.rows_dropped
    assert report.skip_reasons[0].startswith("line 3 [ContextTokens]")
    assert report.skip_reasons[1].startswith("line 5 [TIMESTAMP]")
    assert report.skip_reasons[2].startswith("line 6:")
    assert report.skip_reasons[3].startswith("line 7 [GeneratedTokens]")
    assert "4 malformed rows skipped" in report.summary()


def test_skip_bad_rows_keeps_only_the_first_few_reasons(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "output_tokens": 1}] + [{"prompt": "a"}] * 20
    _, report = read_trace(write(tmp_path, "c.jsonl", jsonl(rows)), skip_bad_rows=True)
    assert report.rows_skipped == 20
    assert 0 < len(report.skip_reasons) < 20


def test_skip_bad_rows_separates_skips_from_rule_drops(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "b.csv",
        BURST_V1_HEADER
        + "1,ChatGPT,10,5,15,API log\n"
        + "2,ChatGPT,10,0,10,API log\n"
        + "3,ChatGPT,ten,5,15,API log\n"
        + "4,ChatGPT,10,5,15,API log\n",
    )
    trace, report = read_trace(path, skip_bad_rows=True)
    assert (report.rows_read, report.requests, report.rows_skipped, report.rows_dropped) == (
        4,
        2,
        1,
        1,
    )
    assert len(trace) == 2


def test_a_file_with_no_usable_row_raises_even_when_skipping(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE_HEADER + "2023-11-16 18:17:03.0000000,x,1\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path, skip_bad_rows=True)
    burst = write(tmp_path, "b.csv", BURST_V1_HEADER + "1,ChatGPT,10,0,10,API log\n")
    with pytest.raises(TraceError, match="1 dropped"):
        read_trace(burst)


# ----------------------------------------------------------------- canonical round trip


def test_canonical_round_trip_is_exact(tmp_path: Path) -> None:
    trace = Trace(
        requests=(
            TraceRequest(0.0, 100, 10, (1, 2), "s1"),
            TraceRequest(0.1 + 0.2, 37, 1),
            TraceRequest(1 / 3, 5000, 250, (1, 2, 9), None),
            TraceRequest(12345.678901234567, 7, 7, (), "s2"),
        ),
        block_size=64,
        source="hand-made",
    )
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {
        "format": "vllm-autotune-trace",
        "version": 1,
        "block_size": 64,
        "source": "hand-made",
    }
    again, report = read_trace(path)
    assert report.format == "canonical"
    assert again.requests == trace.requests
    assert again.block_size == 64
    assert report.rows_read == 4
    assert any("hand-made" in note for note in report.notes)


def test_imported_trace_round_trips_through_canonical(tmp_path: Path) -> None:
    trace, _ = read_trace(MOONCAKE_SLICE)
    path = tmp_path / "m.jsonl"
    write_trace(trace, path)
    again, _ = read_trace(path)
    assert again.requests == trace.requests
    assert again.block_size == trace.block_size


# ----------------------------------------------------------------- vLLM custom export


def test_export_vllm_custom_prompts_have_exact_lengths_and_shared_prefixes(
    tmp_path: Path,
) -> None:
    trace = Trace(
        requests=(
            TraceRequest(0.0, 20, 3, (7, 8)),
            TraceRequest(1.0, 13, 4, (7, 9)),
            TraceRequest(3.0, 6, 5, (7, 8)),  # shorter than its blocks
            TraceRequest(4.0, 20, 6),
            TraceRequest(6.0, 20, 7),
        ),
        block_size=8,
    )
    path = tmp_path / "custom.jsonl"
    args = export_vllm_custom(trace, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5
    assert all(set(row) == {"prompt", "output_tokens", "input_tokens"} for row in rows)
    prompts = [row["prompt"] for row in rows]
    for row, request in zip(rows, trace.requests, strict=True):
        assert len(row["prompt"]) == len(row["prompt"].encode()) == request.input_tokens
        assert row["prompt"].isascii() and not any(c.isspace() for c in row["prompt"])
        assert row["output_tokens"] == request.output_tokens
    assert prompts[0][:8] == prompts[1][:8]  # block 7 shared
    assert prompts[2] == prompts[0][:6]  # block 7, cut at 6 tokens
    assert prompts[0][8:16] != prompts[1][8:16]  # blocks 8 and 9 differ
    assert prompts[0][16:] != prompts[1][13:] and prompts[3] != prompts[4]  # fresh tails
    # Deterministic: the same trace exports the same file.
    again = tmp_path / "again.jsonl"
    export_vllm_custom(trace, again)
    assert again.read_text() == path.read_text()
    # The matching vllm bench serve arguments carry the rate, as arrivals are not exported.
    assert args[args.index("--dataset-name") + 1] == "custom"
    assert args[args.index("--dataset-path") + 1] == str(path)
    assert args[args.index("--num-prompts") + 1] == "5"
    assert float(args[args.index("--request-rate") + 1]) == pytest.approx(4 / 6)
    assert "--skip-chat-template" in args
    assert "--disable-shuffle" in args and "--ignore-eos" in args
    assert args[args.index("--custom-output-len") + 1] == "-1"
    # Read back as vllm-custom: exact lengths, no timing.
    back, report = read_trace(path)
    assert report.format == "vllm-custom"
    assert [(r.input_tokens, r.output_tokens) for r in back.requests] == [
        (r.input_tokens, r.output_tokens) for r in trace.requests
    ]


def test_prompt_text_is_fresh_per_request_index() -> None:
    request = TraceRequest(0.0, 64, 1)
    assert prompt_text(request, 0, 16) == prompt_text(request, 0, 16)
    assert prompt_text(request, 0, 16) != prompt_text(request, 1, 16)
    assert len(prompt_text(request, 5, 16)) == 64


def test_export_vllm_custom_seed_changes_prompts_and_reaches_vllm_bench(tmp_path: Path) -> None:
    trace = Trace(requests=(TraceRequest(0.0, 24, 1, (3,)), TraceRequest(1.0, 24, 1, (3,))))
    args0 = export_vllm_custom(trace, tmp_path / "s0.jsonl")
    args7 = export_vllm_custom(trace, tmp_path / "s7.jsonl", seed=7)
    rows0 = [json.loads(line) for line in (tmp_path / "s0.jsonl").read_text().splitlines()]
    rows7 = [json.loads(line) for line in (tmp_path / "s7.jsonl").read_text().splitlines()]
    assert args0[args0.index("--seed") + 1] == "0" and args7[args7.index("--seed") + 1] == "7"
    assert [r["prompt"] for r in rows0] != [r["prompt"] for r in rows7]
    assert [len(r["prompt"]) for r in rows7] == [24, 24]
    assert rows7[0]["prompt"][:16] == rows7[1]["prompt"][:16]  # the shared block still shared
    assert prompt_text(trace.requests[0], 0, 16) == prompt_text(trace.requests[0], 0, 16, 0)


def test_export_of_a_trace_without_duration_asks_for_infinite_rate(tmp_path: Path) -> None:
    trace = Trace(requests=(TraceRequest(0.0, 4, 1), TraceRequest(0.0, 4, 1)))
    args = export_vllm_custom(trace, tmp_path / "c.jsonl")
    assert args[args.index("--request-rate") + 1] == "inf"
    assert "--burstiness" not in args
