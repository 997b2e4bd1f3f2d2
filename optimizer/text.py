"""Text a user gives that reaches a rendered file or a command line: one rule for what it holds.

A model path, a study name, an engine argument or a served-model name ends up in exports
(YAML documents, shell scripts, their comment headers), in the vLLM server's command line and
in logs. Such text is data, never structure: :func:`text_problem` refuses control characters
(C0 and C1 controls, DEL, format characters such as bidirectional overrides, and the Unicode
line and paragraph separators, which YAML also reads as line breaks) and lone surrogates
(``"\ud800"`` in JSON: half of a UTF-16 pair, no character at all, which no UTF-8 answer,
file or log line can hold), and bounds the length; :func:`tree_problem` applies it to every
key and string of a nested document (lone surrogates in free prose too). Text that is
rendered as a comment anyway goes through :func:`escape_controls`, so no comment line can end
early. Messages never quote the text itself (it may be long or hostile), only where the
problem is.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any

__all__ = [
    "MAX_TEXT",
    "escape_controls",
    "is_control",
    "surrogate_problem",
    "text_problem",
    "tree_problem",
]

#: Longest free string (a path, an argument value) accepted from a user.
MAX_TEXT = 4096

# Unicode categories read as control: controls (Cc, C0/C1 and DEL), format characters (Cf:
# bidi overrides, zero-width characters), line and paragraph separators (Zl, Zp); and lone
# surrogates (Cs: U+D800 to U+DFFF, never a character of valid text).
_CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_SURROGATE = re.compile("[\ud800-\udfff]")


def is_control(ch: str) -> bool:
    """``ch`` is a control, format or line/paragraph separator character, or a lone
    surrogate."""
    return unicodedata.category(ch) in _CONTROL_CATEGORIES


def _surrogate_at(value: str, i: int) -> str:
    return (
        f"holds a lone surrogate (U+{ord(value[i]):04X}) at position {i + 1}, half of a "
        "UTF-16 pair and not a character: remove it"
    )


def surrogate_problem(value: str) -> str | None:
    """What is wrong with ``value`` as text of any kind (free prose included): a lone
    surrogate, by code point and position; None when there is none."""
    if value.isascii():
        return None
    found = _SURROGATE.search(value)
    return _surrogate_at(value, found.start()) if found is not None else None


def text_problem(value: str, max_len: int = MAX_TEXT) -> str | None:
    """What is wrong with ``value`` as plain text, or None when it is fine.

    The answer names the character's code point and position, never the text.
    """
    if len(value) > max_len:
        return f"longer than {max_len} characters; shorten it"
    for i, ch in enumerate(value):
        if is_control(ch):
            if unicodedata.category(ch) == "Cs":
                return _surrogate_at(value, i)
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
        skip: Keys whose values are free prose, checked only for lone surrogates (e.g.
            ``description``: it may hold line breaks, never what is not text at all).
    """
    skipped = set(skip)
    # (node, its key path, free prose: only lone surrogates refused)
    stack: list[tuple[Any, str, bool]] = [(doc, where, False)]

    def at(path: str, key: str) -> str:
        return f"{path}.{key}" if path else key

    while stack:
        node, path, prose = stack.pop()
        if isinstance(node, str):
            problem = surrogate_problem(node) if prose else text_problem(node, max_len)
            if problem is not None:
                return f"{path}: {problem}" if path else problem
        elif isinstance(node, dict):
            for key, value in node.items():
                key_text = str(key)
                problem = surrogate_problem(key_text) if prose else text_problem(key_text, 200)
                if problem is not None:
                    return f"{path or '(top level)'}: a key {problem}"
                shown = escape_controls(key_text[:200]) if prose else key_text  # prose: any
                stack.append((value, at(path, shown), prose or key_text in skipped))
        elif isinstance(node, list | tuple):
            stack.extend((value, at(path, str(i)), prose) for i, value in enumerate(node))
    return None


def escape_controls(text: str) -> str:
    """``text`` with every control character written as its escape (``\\n``, ``\\x85``,
    ``\\u2028``): one line, for a comment or a log line."""
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if is_control(ch) else ch for ch in text
    )
