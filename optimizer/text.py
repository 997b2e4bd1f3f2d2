"""Text a user gives that reaches a rendered file or a command line: one rule for what it holds.

A model path, a study name, an engine argument or a served-model name ends up in exports
(YAML documents, shell scripts, their comment headers), in the vLLM server's command line and
in logs. Such text is data, never structure: :func:`text_problem` refuses control characters
(C0 and C1 controls, DEL, format characters such as bidirectional overrides, and the Unicode
line and paragraph separators, which YAML also reads as line breaks) and bounds the length;
:func:`tree_problem` applies it to every key and string of a nested document. Text that is
rendered as a comment anyway goes through :func:`escape_controls`, so no comment line can end
early. Messages never quote the text itself (it may be long or hostile), only where the
problem is.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_TEXT", "escape_controls", "is_control", "text_problem", "tree_problem"]

#: Longest free string (a path, an argument value) accepted from a user.
MAX_TEXT = 4096

# Unicode categories read as control: controls (Cc, C0/C1 and DEL), format characters (Cf:
# bidi overrides, zero-width characters), line and paragraph separators (Zl, Zp).
_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def is_control(ch: str) -> bool:
    """``ch`` is a control, format or line/paragraph separator character."""
    return unicodedata.category(ch) in _CONTROL_CATEGORIES


def text_problem(value: str, max_len: int = MAX_TEXT) -> str | None:
    """What is wrong with ``value`` as plain text, or None when it is fine.

    The answer names the character's code point and position, never the text.
    """
    if len(value) > max_len:
        return f"longer than {max_len} characters; shorten it"
    for i, ch in enumerate(value):
        if is_control(ch):
            return (
                f"holds a control character (U+{ord(ch):04X}) at position {i + 1}; "
                "names and paths are plain text: remove it"
            )
    return None


def tree_problem(
    doc: Any, where: str, *, max_len: int = MAX_TEXT, skip: Iterable[str] = ()
) -> str | None:
    """The first key or string of a nested document that :func:`text_problem` refuses, as
    ``where.path.to.key: problem``; None when every one is plain.

    Args:
        doc: Mappings, lists and scalars (only strings are checked).
        where: The document's own key path (the message's prefix; empty: none).
        max_len: Longest string.
        skip: Keys whose values are free prose and not checked (e.g. ``description``).
    """
    skipped = set(skip)
    stack: list[tuple[Any, str]] = [(doc, where)]

    def at(path: str, key: str) -> str:
        return f"{path}.{key}" if path else key

    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node, max_len)
            if problem is not None:
                return f"{path}: {problem}" if path else problem
        elif isinstance(node, dict):
            for key, value in node.items():
                key_text = str(key)
                problem = text_problem(key_text, 200)
                if problem is not None:
                    return f"{path or '(top level)'}: a key {problem}"
                if key_text not in skipped:
                    stack.append((value, at(path, key_text)))
        elif isinstance(node, list | tuple):
            stack.extend((value, at(path, str(i))) for i, value in enumerate(node))
    return None


def escape_controls(text: str) -> str:
    """``text`` with every control character written as its escape (``\\n``, ``\\x85``,
    ``\\u2028``): one line, for a comment or a log line."""
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if is_control(ch) else ch for ch in text
    )
