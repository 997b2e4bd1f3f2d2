"""An eval set with references: the accuracy a candidate keeps against the baseline's.

A local JSONL file, one object per line with ``prompt`` and ``answer`` (strings)::

    {"prompt": "Q: 2+2=? A:", "answer": "4"}

Each prompt is answered greedily (one at a time, in file order); an answer counts as correct
where the completion, stripped of surrounding whitespace, starts with the reference answer
(stripped). The gate compares the candidate's accuracy with the baseline's on the same set: the
ratio must be at least ``min_accuracy_ratio`` (0.95 by default: InferenceBench's gate). Where
the baseline gets nothing right the ratio says nothing, and the verdict says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from optimizer.errors import ConfigError

__all__ = ["EvalItem", "accuracy", "load_eval_set"]


@dataclass(frozen=True)
class EvalItem:
    prompt: str
    answer: str


def load_eval_set(path: str | Path) -> list[EvalItem]:
    """The items of a JSONL eval set.

    Raises:
        ConfigError: The file is missing or empty, or a line is not an object with string
            ``prompt`` and ``answer`` (the message names the file and line).
    """
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read the eval set: {exc}") from exc
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(doc, dict) or not all(
            isinstance(doc.get(k), str) and doc.get(k) for k in ("prompt", "answer")
        ):
            raise ConfigError(
                f"{file}:{number}: each line needs non-empty strings 'prompt' and 'answer'"
            )
        items.append(EvalItem(doc["prompt"], doc["answer"]))
    if not items:
        raise ConfigError(f"{file}: the eval set has no items")
    return items


def _correct(completion: str, answer: str) -> bool:
    return completion.strip().startswith(answer.strip())


def accuracy(
    url: str, model: str, items: Sequence[EvalItem], *, max_tokens: int, timeout_s: float
) -> float:
    """The share of ``items`` the server at ``url`` answers correctly (greedy, one at a time)."""
    right = 0
    with httpx.Client(timeout=timeout_s) as client:
        for item in items:
            resp = client.post(
                f"{url}/v1/completions",
                json={
                    "model": model,
                    "prompt": item.prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                },
            )
            resp.raise_for_status()
            right += _correct(str(resp.json()["choices"][0]["text"]), item.answer)
    return right / len(items)
