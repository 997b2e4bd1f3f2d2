"""Deterministic prompts: exact length, range, determinism, sharing exactly where the trace says."""

from __future__ import annotations

import time

import pytest

from optimizer.types import TraceRequest
from optimizer.workload.prompts import TokenRange, build_prompt_ids

VOCAB = TokenRange(256, 32_000)
BLOCK = 16


def ids(
    request: TraceRequest, index: int, *, seed: int = 7, vocab: TokenRange = VOCAB
) -> list[int]:
    return build_prompt_ids(request, index, block_size=BLOCK, seed=seed, vocab=vocab)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 2048])
def test_exact_length_and_plain_ints(n: int) -> None:
    prompt = ids(TraceRequest(0.0, n, 1, prefix_blocks=(1, 2)), 0)
    assert len(prompt) == n
    assert all(type(t) is int for t in prompt)


def test_range_respected() -> None:
    vocab = TokenRange(300, 310)
    prompt = ids(TraceRequest(0.0, 5000, 1, prefix_blocks=(3, 4, 5)), 2, vocab=vocab)
    assert min(prompt) >= 300 and max(prompt) < 310
    assert set(prompt) == set(range(300, 310))  # the whole range is used


def test_token_range_validation() -> None:
    with pytest.raises(ValueError):
        TokenRange(10, 10)
    with pytest.raises(ValueError):
        TokenRange(-1, 10)
    assert TokenRange(256, 1000).size == 744


def test_deterministic() -> None:
    request = TraceRequest(0.0, 300, 1, prefix_blocks=(11, 12))
    assert ids(request, 4) == ids(request, 4)


def test_seed_changes_everything() -> None:
    request = TraceRequest(0.0, 64, 1, prefix_blocks=(11, 12))
    a, b = ids(request, 0, seed=1), ids(request, 0, seed=2)
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 5


def test_fresh_per_request_without_prefix() -> None:
    prompts = [ids(TraceRequest(0.0, 64, 1), i) for i in range(200)]
    assert len({tuple(p) for p in prompts}) == 200
    # Not even the first token block repeats, so vLLM's prefix cache gets no false hits.
    assert len({tuple(p[:BLOCK]) for p in prompts}) == 200


def test_prefix_shared_exactly_where_blocks_are_shared() -> None:
    a = ids(TraceRequest(0.0, 5 * BLOCK, 1, prefix_blocks=(1, 2, 3)), 0)
    b = ids(TraceRequest(0.0, 6 * BLOCK, 1, prefix_blocks=(1, 2, 9)), 1)
    assert a[: 2 * BLOCK] == b[: 2 * BLOCK]
    # The third block differs (different ids), and so does every token after the prefix.
    assert a[2 * BLOCK] != b[2 * BLOCK]
    assert sum(x == y for x, y in zip(a[2 * BLOCK :], b[2 * BLOCK :], strict=False)) < 5


def test_same_blocks_different_request_only_suffix_differs() -> None:
    request = TraceRequest(0.0, 3 * BLOCK + 5, 1, prefix_blocks=(42, 43, 44))
    a, b = ids(request, 0), ids(request, 1)
    assert a[: 3 * BLOCK] == b[: 3 * BLOCK]
    assert a[3 * BLOCK :] != b[3 * BLOCK :]


def test_identical_prompt_when_trace_says_fully_shared() -> None:
    request = TraceRequest(0.0, 2 * BLOCK, 1, prefix_blocks=(5, 6))
    assert ids(request, 0) == ids(request, 99)


def test_partial_last_block_is_a_prefix_of_the_full_block() -> None:
    short = ids(TraceRequest(0.0, BLOCK + 3, 1, prefix_blocks=(7, 8)), 0)
    full = ids(TraceRequest(0.0, 2 * BLOCK, 1, prefix_blocks=(7, 8)), 1)
    assert short == full[: BLOCK + 3]


def test_block_tokens_do_not_depend_on_position_in_request() -> None:
    # Block 8 at position 1 in one request and position 0 in another: same tokens (the
    # content of a block is its id; whether the cache can reuse it is vLLM's business).
    a = ids(TraceRequest(0.0, 2 * BLOCK, 1, prefix_blocks=(7, 8)), 0)
    b = ids(TraceRequest(0.0, BLOCK, 1, prefix_blocks=(8,)), 1)
    assert a[BLOCK:] == b


def test_fresh_tokens_differ_from_block_tokens_of_same_number() -> None:
    # Request index 3 without prefix vs block id 3: separate hash domains.
    fresh = ids(TraceRequest(0.0, BLOCK, 1), 3)
    block = ids(TraceRequest(0.0, BLOCK, 1, prefix_blocks=(3,)), 0)
    assert fresh != block


def test_large_and_negative_block_ids() -> None:
    request = TraceRequest(0.0, 2 * BLOCK, 1, prefix_blocks=(2**70, -5))
    prompt = ids(request, 0)
    assert len(prompt) == 2 * BLOCK and min(prompt) >= VOCAB.low


def test_fast_enough() -> None:
    request = TraceRequest(0.0, 2048, 1, prefix_blocks=tuple(range(4)))
    start = time.perf_counter()
    for i in range(2000):
        build_prompt_ids(request, i, block_size=512, seed=0, vocab=VOCAB)
    # 10k prompts of 2k tokens must take well under a few seconds; allow slow CI.
    assert time.perf_counter() - start < 2.0


def test_warm_blocks_keep_their_seed_only_as_the_prompts_leading_run() -> None:
    """Blocks 1 and 2 are warm: their tokens follow warm_seed whatever the replay's seed; block
    3 is not, and block 1 after it cannot hit a cache (the blocks before it differ): both follow
    the replay's seed, as does every token after the prefix."""
    request = TraceRequest(0.0, 5 * BLOCK, 1, prefix_blocks=(1, 2, 3, 1))

    def warm(seed: int, blocks: frozenset[int] = frozenset({1, 2})) -> list[int]:
        return build_prompt_ids(
            request, 0, block_size=BLOCK, seed=seed, vocab=VOCAB, warm_blocks=blocks, warm_seed=99
        )

    a, b = warm(1), warm(2)
    assert a[: 2 * BLOCK] == b[: 2 * BLOCK]  # the warm run
    assert a[: 2 * BLOCK] == ids(request, 0, seed=99)[: 2 * BLOCK]  # built from warm_seed
    for k in (2, 3, 4):  # block 3, block 1 after it, the fresh tail
        part = slice(k * BLOCK, (k + 1) * BLOCK)
        assert a[part] != b[part] and a[part] == ids(request, 0, seed=1)[part]
    assert warm(1, frozenset({2})) == ids(request, 0, seed=1)  # the run must start the prompt
