"""The comparison: a candidate server against the baseline's own greedy continuations.

The baseline (vLLM's defaults on the same weights) answers each prompt greedily; each prompt
plus its continuation is then sent back with ``prompt_logprobs`` and ``max_tokens: 1``, so every
continuation token is scored teacher-forced: the logprob the server gives the baseline's token
at that position, and its rank (1: the server's own top choice). One early divergence therefore
does not fail the rest, as it would when comparing free-running text. Prompts go one at a time,
in a fixed order, so batch composition never enters the comparison.

- **Floor**: the baseline scored twice (two passes on one server); its disagreement is what the
  measurement itself shows with nothing changed.
- **Drift**: the candidate's mean absolute logprob difference over the continuation tokens, and
  its top-1 agreement (share of positions where its top choice is the baseline's top choice,
  both teacher-forced: a greedy answer's own token need not be the prefill's top choice where
  two tokens nearly tie, as on random weights of a large vocabulary).
- **Greedy**: the candidate's own greedy continuation against the baseline's (the share of
  tokens before the first divergence): where speculation changes decoding, not the prefill
  that prompt logprobs see.
- **Flat logits**: vLLM's dummy weights give every token about ``-ln(vocab)``: nothing can
  show, so the check is skipped and says so, never a pass.

Thresholds (:class:`QualitySettings`): top-1 agreement at least 0.95 (InferenceBench's gate keeps
a candidate at 0.95x the baseline's accuracy) and a mean drift over the floor of at most 0.1
nats (the chosen token's probability moves by about 10 % on average). On seeded weights of the
``small`` shape, the FP8 KV cache moved the prompt logprobs by 0.023 on average, inside both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import httpx

__all__ = [
    "Comparison",
    "QualitySettings",
    "Reference",
    "Verdict",
    "build_reference",
    "compare",
    "greedy",
    "judge",
    "score",
]

Status = Literal["pass", "fail", "skipped", "unchanged"]


@dataclass(frozen=True)
class QualitySettings:
    """How the gate measures and judges.

    Attributes:
        prompts: Prompts compared (each sent alone, in order).
        prompt_tokens: Tokens of each prompt (at most).
        continuation_tokens: Tokens of the baseline's greedy continuation scored.
        min_top1_agreement: Least share of positions where the candidate's top choice is the
            baseline's (both teacher-forced on the baseline's answer).
        max_logprob_drift: Most mean absolute logprob difference (nats) over the floor's.
        min_greedy_match: Least share of the candidate's own greedy tokens before its first
            divergence from the baseline's (judged only where speculation is a lever).
        timeout_s: Per request.
        eval_set: A JSONL eval set with references (:mod:`.evalset`); None: none.
        eval_max_tokens: Tokens of each eval answer.
        min_accuracy_ratio: Least candidate accuracy over the baseline's on the eval set.
    """

    prompts: int = 8
    prompt_tokens: int = 128
    continuation_tokens: int = 64
    min_top1_agreement: float = 0.95
    max_logprob_drift: float = 0.1
    min_greedy_match: float = 0.9
    timeout_s: float = 120.0
    eval_set: str | None = None
    eval_max_tokens: int = 16
    min_accuracy_ratio: float = 0.95


@dataclass(frozen=True)
class Comparison:
    """One server's scores against the reference, over every continuation token."""

    tokens: int
    top1_agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    greedy_match: float | None = None
    accuracy: float | None = None  # on the eval set, where one is given


@dataclass
class Reference:
    """The baseline's answers and scores: what candidates are compared with."""

    model: str
    prompts: list[list[int]]
    continuations: list[list[int]]
    logprobs: list[list[float]]
    top1: list[list[int]]
    floor: Comparison
    flat: bool
    accuracy: float | None = None  # the baseline's on the eval set, where one is given
    seconds: float = 0.0
    baseline_args: dict[str, Any] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Reference:
        return cls(**{**doc, "floor": Comparison(**doc["floor"])})


@dataclass(frozen=True)
class Verdict:
    """The gate's answer for one configuration."""

    status: Status
    reason: str
    levers: dict[str, str] = field(default_factory=dict)
    comparison: Comparison | None = None
    floor: Comparison | None = None
    seconds: float = 0.0

    @property
    def refused(self) -> bool:
        return self.status == "fail"

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line for a table, a log or an export header."""
        if self.comparison is None:
            return f"quality {self.status}: {self.reason}"
        c = self.comparison
        floor = self.floor.mean_abs_logprob_diff if self.floor else 0.0
        return (
            f"quality {self.status}: top-1 agreement {c.top1_agreement:.3f}, logprob drift "
            f"{c.mean_abs_logprob_diff:.4f} (max {c.max_abs_logprob_diff:.3f}, floor "
            f"{floor:.4f}) over {c.tokens} tokens; {self.reason}"
        )


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = client.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()
    return dict(resp.json())


def greedy(client: httpx.Client, url: str, model: str, prompt: Sequence[int], n: int) -> list[int]:
    """The server's greedy continuation of ``prompt``: ``n`` token ids."""
    doc = _post(
        client,
        url,
        {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    )
    tokens = doc["choices"][0]["logprobs"]["tokens"]
    return [int(str(t).split(":", 1)[1]) for t in tokens]


def score(
    client: httpx.Client,
    url: str,
    model: str,
    prompt: Sequence[int],
    continuation: Sequence[int],
) -> tuple[list[float], list[int]]:
    """Teacher-forced: the logprob the server gives each continuation token, and its own top
    choice at that position."""
    doc = _post(
        client,
        url,
        {
            "model": model,
            "prompt": [*prompt, *continuation],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 1,
        },
    )
    entries = doc["choices"][0]["prompt_logprobs"]
    tail = entries[len(prompt) :]
    if len(tail) != len(continuation):
        raise ValueError(
            f"the server scored {len(tail)} continuation tokens, {len(continuation)} were sent"
        )
    logprobs, top1 = [], []
    for token, entry in zip(continuation, tail, strict=True):
        mine = entry[str(token)]  # the sent token is always among a position's entries
        logprobs.append(float(mine["logprob"]))
        best = next((k for k, v in entry.items() if int(v.get("rank") or 0) == 1), str(token))
        top1.append(int(best))
    return logprobs, top1


def _prefix_share(a: Sequence[int], b: Sequence[int]) -> float:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n / max(1, len(b))


def compare(
    reference_logprobs: Sequence[Sequence[float]],
    reference_top1: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    top1: Sequence[Sequence[int]],
    greedy_shares: Sequence[float] | None = None,
) -> Comparison:
    """Scores against the reference's, over every continuation token of every prompt: the
    share of positions where both servers' top choice is the same token, and the drift of the
    baseline's tokens' logprobs."""
    diffs = [
        abs(a - b)
        for ref, got in zip(reference_logprobs, logprobs, strict=True)
        for a, b in zip(ref, got, strict=True)
    ]
    same = [
        a == b
        for ref, got in zip(reference_top1, top1, strict=True)
        for a, b in zip(ref, got, strict=True)
    ]
    n = len(diffs)
    return Comparison(
        tokens=n,
        top1_agreement=sum(same) / n if n else math.nan,
        mean_abs_logprob_diff=sum(diffs) / n if n else math.nan,
        max_abs_logprob_diff=max(diffs, default=math.nan),
        greedy_match=(sum(greedy_shares) / len(greedy_shares)) if greedy_shares else None,
    )


def is_flat(logprobs: Sequence[Sequence[float]], vocab_size: int | None) -> bool:
    """True where every scored logprob sits at the uniform ``-ln(vocab)`` (dummy weights)."""
    values = [v for row in logprobs for v in row]
    if not values:
        return True
    spread = max(values) - min(values)
    if vocab_size:
        uniform = -math.log(vocab_size)
        return spread < 0.01 and all(abs(v - uniform) < 0.01 for v in values)
    return spread < 0.01


def build_reference(
    url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    settings: QualitySettings,
    *,
    vocab_size: int | None = None,
) -> Reference:
    """The baseline's greedy continuations, scored twice (the floor)."""
    with httpx.Client(timeout=settings.timeout_s) as client:
        conts = [greedy(client, url, model, p, settings.continuation_tokens) for p in prompts]
        first = [score(client, url, model, p, c) for p, c in zip(prompts, conts, strict=True)]
        second = [score(client, url, model, p, c) for p, c in zip(prompts, conts, strict=True)]
    logprobs, top1 = [lp for lp, _ in first], [t for _, t in first]
    floor = compare(logprobs, top1, [lp for lp, _ in second], [t for _, t in second])
    return Reference(
        model=model,
        prompts=[list(p) for p in prompts],
        continuations=conts,
        logprobs=logprobs,
        top1=top1,
        floor=floor,
        flat=is_flat(logprobs, vocab_size),
        accuracy=_accuracy(url, model, settings),
    )


def _accuracy(url: str, model: str, settings: QualitySettings) -> float | None:
    if settings.eval_set is None:
        return None
    from optimizer.quality.evalset import accuracy, load_eval_set

    items = load_eval_set(settings.eval_set)
    return accuracy(
        url, model, items, max_tokens=settings.eval_max_tokens, timeout_s=settings.timeout_s
    )


def measure(url: str, model: str, reference: Reference, settings: QualitySettings) -> Comparison:
    """The candidate at ``url`` scored on the reference's prompts and continuations."""
    with httpx.Client(timeout=settings.timeout_s) as client:
        scored = [
            score(client, url, model, p, c)
            for p, c in zip(reference.prompts, reference.continuations, strict=True)
        ]
        shares = [
            _prefix_share(greedy(client, url, model, p, len(c)), c)
            for p, c in zip(reference.prompts, reference.continuations, strict=True)
        ]
    got = compare(
        reference.logprobs, reference.top1, [s[0] for s in scored], [s[1] for s in scored], shares
    )
    return replace(got, accuracy=_accuracy(url, model, settings))


def judge(
    comparison: Comparison,
    reference: Reference,
    levers: dict[str, str],
    settings: QualitySettings,
) -> Verdict:
    """Pass or fail against the thresholds, the drift taken over the floor."""
    floor = reference.floor
    drift = comparison.mean_abs_logprob_diff - floor.mean_abs_logprob_diff
    problems = []
    if comparison.top1_agreement < settings.min_top1_agreement:
        problems.append(
            f"top-1 agreement {comparison.top1_agreement:.3f} < {settings.min_top1_agreement}"
        )
    if drift > settings.max_logprob_drift:
        problems.append(
            f"logprob drift {drift:.4f} over the floor > {settings.max_logprob_drift} nats"
        )
    speculative = any(k.startswith(("speculative", "num-speculative")) for k in levers)
    if (
        speculative
        and comparison.greedy_match is not None
        and comparison.greedy_match < settings.min_greedy_match
    ):
        problems.append(
            f"greedy continuations match {comparison.greedy_match:.3f} of the baseline's "
            f"before diverging < {settings.min_greedy_match}"
        )
    notes = []
    if comparison.accuracy is not None and reference.accuracy is not None:
        if reference.accuracy <= 0:
            notes.append("the baseline answered none of the eval set: its ratio says nothing")
        else:
            ratio = comparison.accuracy / reference.accuracy
            line = (
                f"eval accuracy {comparison.accuracy:.3f} against the baseline's "
                f"{reference.accuracy:.3f} (x{ratio:.3f})"
            )
            (problems if ratio < settings.min_accuracy_ratio else notes).append(
                line
                + (
                    f" < x{settings.min_accuracy_ratio}"
                    if ratio < settings.min_accuracy_ratio
                    else ""
                )
            )
    if problems:
        return Verdict("fail", "; ".join(problems + notes), levers, comparison, floor)
    return Verdict("pass", "; ".join(["within the thresholds", *notes]), levers, comparison, floor)
