"""Incremental parser of an OpenAI-compatible streamed ``/v1/completions`` response.

The response body is a Server-Sent Events stream: ``data: <json>`` lines separated by blank
lines, ``:`` comment lines, and a final ``data: [DONE]``. Network reads split lines anywhere
(even inside a multi-byte character), so :class:`SSEParser` buffers bytes and only decodes
whole lines. Each event is turned into typed events the replayer can time: generated text,
token usage, the end marker, and errors. A server that fails after it has sent the 200 status
line can only report the failure inside the stream; vLLM writes it as
``data: {"error": {"message": ..., "type": ..., "code": ...}}`` (older releases nest an
object with ``"object": "error"``, or send that object bare), and a choice may finish with
``finish_reason: "error"``. All of these become an :class:`ErrorEvent`, so the request is
recorded as failed instead of as a short success.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DoneEvent",
    "ErrorEvent",
    "SSEParser",
    "StreamEvent",
    "TextEvent",
    "UsageEvent",
]

_SNIPPET_CHARS = 200


@dataclass(frozen=True, slots=True)
class TextEvent:
    """A chunk carrying ``choices``.

    Attributes:
        text: Concatenated ``text`` of the chunk's choices (may be empty).
        finish_reason: The first non-null ``finish_reason`` among the choices, if any.
    """

    text: str
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """Token usage reported by the server (final chunk with ``include_usage``).

    Attributes:
        prompt_tokens: Prompt tokens the server counted, if reported.
        completion_tokens: Generated tokens the server counted, if reported.
    """

    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True, slots=True)
class DoneEvent:
    """The ``data: [DONE]`` end marker."""


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """A failure reported inside the stream, or an event that could not be understood.

    Attributes:
        message: Short description, suitable for ``RequestRecord.error``.
    """

    message: str


StreamEvent = TextEvent | UsageEvent | DoneEvent | ErrorEvent
"""Any event :class:`SSEParser` yields."""

_DONE = DoneEvent()


def _snippet(text: str) -> str:
    return text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "..."


def _error_message(error: Any) -> str:
    if isinstance(error, Mapping):
        message = error.get("message") or error.get("detail") or json.dumps(error)
        code = error.get("code")
        kind = error.get("type")
        prefix = " ".join(str(p) for p in (code, kind) if p is not None)
        return _snippet(f"{prefix}: {message}" if prefix else str(message))
    return _snippet(str(error))


def _interpret(data: str, event_name: str | None) -> list[StreamEvent]:
    """Turn the data of one SSE event into typed events."""
    if data.strip() == "[DONE]":
        return [_DONE]
    try:
        payload = json.loads(data)
    except ValueError:
        return [ErrorEvent(f"malformed stream event: {_snippet(data)!r}")]
    if event_name == "error":
        return [ErrorEvent("stream error: " + _error_message(payload))]
    if not isinstance(payload, dict):
        return [ErrorEvent(f"unexpected stream event: {_snippet(data)!r}")]
    if "error" in payload and payload["error"] is not None:
        return [ErrorEvent("stream error: " + _error_message(payload["error"]))]
    if payload.get("object") == "error":
        return [ErrorEvent("stream error: " + _error_message(payload))]

    events: list[StreamEvent] = []
    choices = payload.get("choices")
    if choices:
        texts: list[str] = []
        finish_reason: str | None = None
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            text = choice.get("text")
            if text:
                texts.append(str(text))
            if finish_reason is None and choice.get("finish_reason") is not None:
                finish_reason = str(choice["finish_reason"])
        events.append(TextEvent("".join(texts), finish_reason))
        if finish_reason in ("error", "abort"):
            events.append(ErrorEvent(f"stream error: finish_reason={finish_reason}"))
    usage = payload.get("usage")
    if isinstance(usage, dict):
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        events.append(
            UsageEvent(
                prompt_tokens=prompt if isinstance(prompt, int) else None,
                completion_tokens=completion if isinstance(completion, int) else None,
            )
        )
    return events


class SSEParser:
    """Feed raw response bytes in any split; get complete events back.

    Lines end with ``\\n`` or ``\\r\\n``. An event is dispatched at the blank line that ends
    it (per the SSE specification); :meth:`close` dispatches a last event the server did not
    terminate. Comment lines (starting with ``:``) and unknown fields are ignored.
    """

    __slots__ = ("_buffer", "_data", "_event_name")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event_name: str | None = None

    def feed(self, chunk: bytes) -> list[StreamEvent]:
        """Parse one network read.

        Args:
            chunk: Bytes as received; may end in the middle of a line.

        Returns:
            The events completed by this chunk, in stream order (possibly none).
        """
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\n" not in buffer:
            self._buffer = buffer
            return []
        *lines, self._buffer = buffer.split(b"\n")
        events: list[StreamEvent] = []
        for raw in lines:
            self._line(raw, events)
        return events

    def close(self) -> list[StreamEvent]:
        """Finish the stream: parse a trailing unterminated line and event.

        Returns:
            The events that were still pending (possibly none).
        """
        events: list[StreamEvent] = []
        if self._buffer:
            raw, self._buffer = self._buffer, b""
            self._line(raw, events)
        self._dispatch(events)
        return events

    def _line(self, raw: bytes, events: list[StreamEvent]) -> None:
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw:
            self._dispatch(events)
            return
        if raw.startswith(b":"):
            return
        line = raw.decode("utf-8", errors="replace")
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event_name = value

    def _dispatch(self, events: list[StreamEvent]) -> None:
        if self._data:
            events.extend(_interpret("\n".join(self._data), self._event_name))
        self._data = []
        self._event_name = None
