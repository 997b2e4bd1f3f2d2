"""The streamed-completions parser: events, splits anywhere, usage, [DONE], errors in a 200."""

from __future__ import annotations

import json

import pytest

from optimizer.workload.sse import (
    DoneEvent,
    ErrorEvent,
    SSEParser,
    StreamEvent,
    TextEvent,
    UsageEvent,
)


def chunk(text: str, finish: str | None = None) -> str:
    payload = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": None,
    }
    return "data: " + json.dumps(payload) + "\n\n"


USAGE = (
    'data: {"id":"cmpl-1","object":"text_completion","choices":[],'
    '"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n'
)
DONE = "data: [DONE]\n\n"
STREAM = chunk(" a") + chunk(" bé") + chunk(" c", "length") + USAGE + DONE
EXPECTED: list[StreamEvent] = [
    TextEvent(" a"),
    TextEvent(" bé"),
    TextEvent(" c", "length"),
    UsageEvent(prompt_tokens=5, completion_tokens=3),
    DoneEvent(),
]


def parse_all(pieces: list[bytes]) -> list[StreamEvent]:
    parser = SSEParser()
    events: list[StreamEvent] = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    events.extend(parser.close())
    return events


def test_whole_stream() -> None:
    assert parse_all([STREAM.encode()]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_split_anywhere_even_inside_utf8(size: int) -> None:
    raw = STREAM.encode()
    assert parse_all([raw[i : i + size] for i in range(0, len(raw), size)]) == EXPECTED


def test_events_come_out_as_soon_as_complete() -> None:
    parser = SSEParser()
    first = chunk(" a").encode()
    assert parser.feed(first[:-1]) == []  # the blank line that ends the event is missing
    assert parser.feed(first[-1:]) == [TextEvent(" a")]


def test_crlf_and_comments() -> None:
    raw = (": keep-alive\r\n\r\n" + STREAM.replace("\n", "\r\n")).encode()
    assert parse_all([raw[i : i + 5] for i in range(0, len(raw), 5)]) == EXPECTED


def test_data_without_space_and_multiline_data() -> None:
    raw = b'data:{"choices":[{"text":"x"}]}\n\ndata: {"choices":\ndata: [{"text":"y"}]}\n\n'
    assert parse_all([raw]) == [TextEvent("x"), TextEvent("y")]


def test_unterminated_last_event_flushed_on_close() -> None:
    assert parse_all([b"data: [DONE]"]) == [DoneEvent()]


def test_empty_text_choice_is_still_a_text_event() -> None:
    assert parse_all([chunk("").encode()]) == [TextEvent("")]


def test_usage_on_a_choice_chunk_gives_both() -> None:
    raw = b'data: {"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    assert parse_all([raw]) == [TextEvent("x"), UsageEvent(1, 1)]


def test_vllm_error_event_inside_200_stream() -> None:
    # Current vLLM: ErrorResponse(error=ErrorInfo(...)).model_dump()
    raw = (
        chunk(" a") + 'data: {"error": {"message": "engine dead", "type": "InternalServerError",'
        ' "param": null, "code": 500}}\n\n' + DONE
    ).encode()
    events = parse_all([raw])
    assert events[0] == TextEvent(" a")
    assert isinstance(events[1], ErrorEvent)
    assert "engine dead" in events[1].message and "500" in events[1].message
    assert events[2] == DoneEvent()


def test_older_vllm_error_shapes() -> None:
    nested = b'data: {"error": {"object": "error", "message": "bad", "type": "X", "code": 400}}\n\n'
    bare = b'data: {"object": "error", "message": "worse", "type": "Y", "code": 500}\n\n'
    for raw, text in ((nested, "bad"), (bare, "worse")):
        (event,) = parse_all([raw])
        assert isinstance(event, ErrorEvent) and text in event.message


def test_finish_reason_error_is_an_error() -> None:
    events = parse_all([chunk("", "error").encode()])
    assert events[0] == TextEvent("", "error")
    assert isinstance(events[1], ErrorEvent)


def test_event_error_field_and_malformed_json() -> None:
    (named,) = parse_all([b'event: error\ndata: {"message": "nope"}\n\n'])
    assert isinstance(named, ErrorEvent) and "nope" in named.message
    (bad,) = parse_all([b"data: {not json\n\n"])
    assert isinstance(bad, ErrorEvent) and "malformed" in bad.message


def test_null_error_field_is_not_an_error() -> None:
    assert parse_all([b'data: {"choices":[{"text":"x"}],"error":null}\n\n']) == [TextEvent("x")]
