"""A window's pre-roll: the requests before it warm the prefix cache, as production's would be.

A synthetic conversation trace: each session's turn k sends a shared system-prompt block and
the session's first k + 1 blocks (the earlier turns and their answers), one turn every 30 s. A 30-second window from its middle
holds later turns of sessions that began before it: cold, the window sees little of its own
prefix reuse; after the pre-roll, exactly what it sees inside the whole trace.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest

from optimizer.errors import ConfigError
from optimizer.types import Trace, TraceRequest
from optimizer.workload.prompts import TokenRange, build_prompt_ids
from optimizer.workload.replay import replay
from optimizer.workload.shaping import (
    ShapeSpec,
    covering_preroll_s,
    preroll,
    preroll_left_out,
    preroll_trace,
    shape,
    warm_set,
)
from optimizer.workload.stats import inspect_trace, prefix_reuse_ratio

BLOCK = 16
VOCAB = TokenRange(300, 5000)


def conversations(sessions: int = 12, turns: int = 6) -> Trace:
    """Session s starts at 7 * s s; turn k at + 30 * k s sends block 9999 (the system prompt)
    and blocks s*100 .. s*100 + k."""
    requests = []
    for s in range(sessions):
        for k in range(turns):
            blocks = (9999, *(s * 100 + j for j in range(k + 1)))
            requests.append(
                TraceRequest(7.0 * s + 30.0 * k, (k + 2) * BLOCK + 5, 4, blocks, f"s{s}")
            )
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(tuple(requests), block_size=BLOCK, source="conversations")


def reuse_with_full_history(trace: Trace, start_s: float, end_s: float) -> float:
    """The reuse the window's requests see inside the whole trace (every earlier turn cached)."""
    before = [r for r in trace.requests if r.arrival_s < start_s]
    window = Trace(
        tuple(r for r in trace.requests if start_s <= r.arrival_s < end_s), block_size=BLOCK
    )
    return prefix_reuse_ratio(window, before)


def test_the_window_sees_its_prefix_reuse_only_with_the_preroll() -> None:
    trace = conversations()
    shaped, reports = shape(trace, ShapeSpec(window_s=(60.0, 90.0)))
    assert [r.step for r in reports] == ["window", "preroll"]
    report = reports[1]
    cold = report.before["prefix_reuse_ratio"]
    warm = report.after["prefix_reuse_ratio_warm"]
    assert report.before["prefix_reuse_ratio_warm"] == cold  # no pre-roll yet
    assert report.after["prefix_reuse_ratio"] == cold  # the window itself is unchanged
    assert cold < 0.3 < 0.6 < warm  # 29 % (the shared system block) and 68 %
    # The default stretch covers every prefix the window refers to: the window sees what it
    # sees inside the whole trace.
    assert warm == pytest.approx(reuse_with_full_history(trace, 60.0, 90.0))
    assert report.changed_requests == len(shaped.preroll) == report.after["preroll_requests"]
    assert "prefix chains the window reuses from earlier requests" in report.detail
    assert f"{cold:.1%} cold, {warm:.1%} after the pre-roll" in report.detail
    assert "prefix_reuse_ratio_warm: " in report.summary()
    # Pre-roll arrivals are relative to the window's start; the window's own are untouched.
    assert all(-30.0 <= r.arrival_s < 0 for r in shaped.preroll)
    assert (
        shaped.requests == shape(trace, ShapeSpec(window_s=(60.0, 90.0), preroll_s=0))[0].requests
    )
    stats = inspect_trace(shaped)
    assert stats["prefix_reuse_ratio_warm"] == pytest.approx(warm)


def test_the_covering_stretch_goes_back_to_the_last_use_of_each_prefix() -> None:
    trace = conversations()
    # Each session in the window continues its last turn before it. The oldest of those:
    # session 0's turn 1 at 30 s (its turn 2, at 60 s, is in the window): 30 s before it.
    assert covering_preroll_s(trace, 60.0, 90.0) == pytest.approx(30.0)
    shorter, report = preroll(trace, 60.0, 90.0, preroll_s=15.0)
    assert all(-15.0 <= r.arrival_s < 0 for r in shorter.preroll)
    assert "(given)" in report.detail
    cold = report.before["prefix_reuse_ratio"]
    assert (
        cold < report.after["prefix_reuse_ratio_warm"] < reuse_with_full_history(trace, 60.0, 90.0)
    )
    # A window whose prefixes all start inside it needs no pre-roll.
    alone = Trace(
        tuple(
            replace(r, prefix_blocks=r.prefix_blocks[1:]) for r in conversations(turns=1).requests
        ),
        block_size=BLOCK,
    )
    assert covering_preroll_s(alone, 20.0, 50.0) == 0.0


def test_preroll_settings_are_checked() -> None:
    trace = conversations()
    assert shape(trace, ShapeSpec(window_s=(60.0, 90.0), preroll_s=0))[0].preroll == ()
    # A window from 0 s has nothing before it: no step.
    assert [r.step for r in shape(trace, ShapeSpec(window_s=(0.0, 30.0)))[1]] == ["window"]
    with pytest.raises(ConfigError, match=r"trace\.shaping\.preroll_s .*window_s"):
        shape(trace, ShapeSpec(preroll_s=10.0))
    with pytest.raises(ConfigError, match=r"trace\.shaping\.preroll_s must be >= 0"):
        shape(trace, ShapeSpec(window_s=(60.0, 90.0), preroll_s=-1.0))


def test_length_steps_shape_the_preroll_alike_and_time_steps_leave_it() -> None:
    spec = ShapeSpec(window_s=(60.0, 90.0), length_scale=0.5, compress=2.0, max_model_len=40)
    shaped, _ = shape(conversations(), spec)
    unshaped, _ = shape(conversations(), ShapeSpec(window_s=(60.0, 90.0)))
    assert len(shaped.preroll) == len(unshaped.preroll)
    for new, old in zip(shaped.preroll, unshaped.preroll, strict=True):
        assert new.arrival_s == old.arrival_s
        assert new.input_tokens == min(round(old.input_tokens * 0.5), 40 - 2)
        assert new.prefix_blocks == old.prefix_blocks[: -(-new.input_tokens // BLOCK)]


def test_the_warm_up_trace_sends_prefix_blocks_only_and_each_chain_once() -> None:
    trace = Trace(
        (TraceRequest(0.0, 10, 5),),
        block_size=BLOCK,
        preroll=(
            TraceRequest(-9.0, 2 * BLOCK + 7, 50, (1, 2, 3)),  # extended below: left out
            TraceRequest(-8.0, 40, 50, ()),  # no prefix blocks: nothing to warm
            TraceRequest(-7.0, 4 * BLOCK, 50, (1, 2, 3, 4)),
            TraceRequest(-6.0, BLOCK + 3, 50, (9, 8)),
            TraceRequest(-5.0, 5 * BLOCK, 50, (1, 2, 3, 4)),  # same chain: the longer prompt
        ),
    )
    warm = preroll_trace(trace)
    assert warm.preroll == ()
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in warm.requests] == [
        (0.0, 4 * BLOCK, 1),  # longest first
        (0.0, BLOCK + 3, 1),
    ]
    assert [r.prefix_blocks for r in warm.requests] == [(1, 2, 3, 4), (9, 8)]


class Recorder:
    """httpx.MockTransport handler: answers every request with its tokens, keeps the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, object]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        n = int(body["max_tokens"])  # type: ignore[call-overload]
        chunks = [
            'data: {"choices":[{"index":0,"text":" t","finish_reason":null}]}\n\n' for _ in range(n)
        ]
        usage = f'data: {{"choices":[],"usage":{{"prompt_tokens":1,"completion_tokens":{n}}}}}\n\n'
        content = "".join(chunks) + usage + "data: [DONE]\n\n"
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=_stream(content.encode())
        )


async def _stream(content: bytes) -> AsyncIterator[bytes]:
    yield content


def test_a_replay_sends_the_preroll_first_with_its_own_seed_and_measures_none_of_it() -> None:
    shaped, _ = shape(conversations(), ShapeSpec(window_s=(60.0, 75.0)))
    assert shaped.preroll and len(shaped) == 7
    window = replace(
        shaped, requests=tuple(replace(r, arrival_s=r.arrival_s / 100) for r in shaped.requests)
    )
    server = Recorder()

    async def go() -> object:
        return await replay(
            window,
            "http://test",
            "m",
            vocab=VOCAB,
            seed=42,
            transport=httpx.MockTransport(server.handle),
        )

    result = asyncio.run(go())
    warm = preroll_trace(window)
    n = len(warm)
    assert result.preroll_requests == n and result.preroll_failed == 0  # type: ignore[attr-defined]
    assert len(result.records) == len(window)  # type: ignore[attr-defined]
    assert [b["max_tokens"] for b in server.bodies[:n]] == [1] * n
    assert [b["max_tokens"] for b in server.bodies[n:]] == [4] * len(window)
    # The pre-roll's prompts are the prefix tokens the window's requests send (same seed):
    # each session's last turn before the window is the start of its next turn's prompt.
    prompts = [
        build_prompt_ids(r, i, block_size=BLOCK, seed=42, vocab=VOCAB)
        for i, r in enumerate(window.requests)
    ]
    warmed = [b["prompt"] for b in server.bodies[:n]]
    continued = [p for p in warmed if any(ids[: len(p)] == p for ids in prompts)]  # type: ignore[arg-type]
    in_window = {r.session_id for r in window.requests}
    assert len(continued) == sum(r.session_id in in_window for r in warm.requests) >= 5


def test_the_job_file_key_is_checked_and_reaches_the_shaping() -> None:
    from pydantic import ValidationError

    from optimizer.config import ShapingSection

    with pytest.raises(ValidationError, match="preroll_s"):
        ShapingSection(window_s=(60.0, 90.0), preroll_s=-5.0)
    section = ShapingSection(window_s=(60.0, 90.0))
    assert section.preroll_s is None  # the default: cover the window's prefix references
    shaped, _ = shape(conversations(), ShapeSpec(**section.model_dump()))
    assert shaped.preroll
    off = ShapingSection(window_s=(60.0, 90.0), preroll_s=0)
    assert shape(conversations(), ShapeSpec(**off.model_dump()))[0].preroll == ()


def test_the_default_preroll_is_what_the_window_hits_not_the_stretch_before_it() -> None:
    # Issue 34: 612 s of a conversation trace (2,108 requests, 25 M tokens) stood before a 104-
    # request window. Here: 40 sessions that never reach the window fill the stretch that the
    # window's oldest reference reaches back over.
    base = conversations()
    idle = [
        TraceRequest(31.0 + 0.5 * i, 3 * BLOCK, 4, (5000 + i, 6000 + i, 7000 + i), f"idle{i}")
        for i in range(40)
    ]
    trace = Trace(
        tuple(sorted((*base.requests, *idle), key=lambda r: r.arrival_s)), block_size=BLOCK
    )
    shaped, report = preroll(trace, 60.0, 90.0)
    stretch, _ = preroll(trace, 60.0, 90.0, preroll_s=covering_preroll_s(trace, 60.0, 90.0))
    assert len(stretch.preroll) > 40 > len(shaped.preroll)  # 9 chains, not 49 requests
    assert not any(r.session_id.startswith("idle") for r in shaped.preroll)  # type: ignore[union-attr]
    # ... and it warms exactly as much as the whole history does.
    warm = report.after["prefix_reuse_ratio_warm"]
    assert warm == pytest.approx(reuse_with_full_history(trace, 60.0, 90.0))
    # One request per distinct chain: no chain is the start of another kept one.
    chains = [r.prefix_blocks for r in shaped.preroll]
    assert len(set(chains)) == len(chains)
    assert not any(a != b and b[: len(a)] == a for a in chains for b in chains)
    # Prefill only: one output token, at most the tokens a window request shares.
    assert all(r.output_tokens == 1 for r in shaped.preroll)
    assert sum(r.input_tokens for r in shaped.preroll) < sum(
        r.input_tokens for r in stretch.preroll
    )
    assert "9 prefix chains the window reuses" in report.detail and "49 requests" in report.detail


def test_a_preroll_larger_than_the_kv_cache_keeps_what_the_window_reuses_most() -> None:
    window = (
        TraceRequest(0.0, 4 * BLOCK, 2, (1, 2, 3, 4)),
        TraceRequest(1.0, 4 * BLOCK, 2, (1, 2, 3, 4)),
        TraceRequest(2.0, 2 * BLOCK, 2, (7, 8)),
        TraceRequest(3.0, 3 * BLOCK, 2, (9, 10, 11)),
    )
    before = (
        TraceRequest(0.0, 4 * BLOCK, 2, (1, 2, 3, 4)),
        TraceRequest(1.0, 2 * BLOCK, 2, (7, 8)),
        TraceRequest(2.0, 3 * BLOCK, 2, (9, 10, 11)),
    )
    trace = Trace(
        (*before, *(replace(r, arrival_s=r.arrival_s + 10) for r in window)), block_size=BLOCK
    )
    chains = warm_set(trace, 10.0, None)
    # Chain (1,2,3,4) is reused twice (128 tokens), (9,10,11) 48, (7,8) 32.
    assert [c.prefix_blocks for c in chains] == [(1, 2, 3, 4), (9, 10, 11), (7, 8)]
    shaped = Trace(window, block_size=BLOCK, preroll=chains)
    assert preroll_left_out(shaped, None) == (0, 0)
    assert preroll_left_out(shaped, 10**6) == (0, 0)
    # Room for 100 tokens: the 64-token chain and the 32-token one fit, the 48-token one not.
    sent = preroll_trace(shaped, max_tokens=100)
    assert [r.prefix_blocks for r in sent.requests] == [(1, 2, 3, 4), (7, 8)]
    assert preroll_left_out(shaped, 100) == (1, 3 * BLOCK)


def test_the_covering_stretch_holds_its_oldest_request_despite_float_rounding() -> None:
    # 545.892 - (545.892 - 245.374) is 245.37400000000002 in floats: a stretch of exactly
    # start - arrival used to leave out the very request it was measured to (seen on the
    # Mooncake trace: 2,719 requests instead of 2,720).
    blocks = (1, 2)
    trace = Trace(
        (
            TraceRequest(245.374, 2 * BLOCK, 4, blocks, "a"),
            TraceRequest(545.892, 3 * BLOCK, 4, (*blocks, 3), "a"),
        ),
        block_size=BLOCK,
    )
    covered = covering_preroll_s(trace, 545.892, 560.0)
    assert covered == pytest.approx(300.518)
    stretch, _ = preroll(trace, 545.892, 560.0, preroll_s=covered)
    assert len(stretch.preroll) == 1


def test_the_warm_blocks_are_the_preroll_s_and_a_multi_process_replay_keeps_them() -> None:
    """warm_blocks: every block of the pre-roll's requests that holds a prompt token. A replay
    over several processes sends the pre-roll first and its parts without it, so their options
    carry the whole trace's warm blocks (else the parts' prompts would not hit it)."""
    from optimizer.workload.replay import ReplayOptions, _process_options, warm_blocks

    shaped, _ = shape(conversations(), ShapeSpec(window_s=(60.0, 75.0)))
    sent = preroll_trace(shaped).requests
    blocks = warm_blocks(shaped)
    assert blocks == {b for r in sent for b in r.prefix_blocks}  # every block holds tokens here
    assert 9999 in blocks  # the system prompt, shared by every conversation
    window_only = {b for r in shaped.requests for b in r.prefix_blocks} - blocks
    assert window_only  # the blocks the window creates itself are not warm
    options = _process_options(
        shaped, {"options": ReplayOptions(warm_seed=5), "warmup_requests": 1}
    )
    assert options.warm_blocks == blocks and options.warm_seed == 5
    assert options.warmup_requests == 1  # the keyword overrides still apply
    assert _process_options(shaped, {}).warm_blocks is None  # no warm seed: nothing to keep
