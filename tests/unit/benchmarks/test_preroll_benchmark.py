"""The pre-roll benchmark's conversation trace: turn k + 1 extends turn k's prompt."""

from __future__ import annotations

from benchmarks.preroll_benchmark import BLOCK, conversations


def test_each_turn_extends_the_previous_turn_s_prompt() -> None:
    trace = conversations(seed=3)
    assert trace == conversations(seed=3)  # seeded
    last: dict[str, tuple[int, ...]] = {}
    for r in trace.requests:
        assert r.input_tokens + r.output_tokens <= 1900
        assert len(r.prefix_blocks) == -(-r.input_tokens // BLOCK)
        previous = last.get(r.session_id or "")
        if previous is not None:
            full = previous[:-1]  # the previous prompt's last block may be partial
            assert r.prefix_blocks[: len(full)] == full
        last[r.session_id or ""] = r.prefix_blocks
    assert len(last) > 50
