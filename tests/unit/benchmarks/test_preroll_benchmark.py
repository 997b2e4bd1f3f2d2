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


def test_the_preroll_comparison_runs_cold_the_stretch_and_the_warm_set_kept_and_per_step() -> None:
    from benchmarks.preroll_benchmark import _runs
    from optimizer.workload.shaping import ShapeSpec, shape

    window = (270.0, 300.0)
    trace, _ = shape(conversations(), ShapeSpec(window_s=window, max_model_len=2048))
    runs = _runs("preroll", trace, window)
    assert [(caching, bool(warm)) for caching, _, warm in runs] == [
        (True, False),
        (True, True),
        (True, True),
        (True, True),
    ]
    stretch, warm_set = runs[1][2], runs[2][2]
    assert warm_set == trace.preroll and len(stretch) > len(warm_set) > 0
    assert runs[3][2] == warm_set and "every step" in runs[3][1]  # the same set, sent per step
    assert [label for _, label, _ in _runs("caching", trace, window)].count("none") == 2


def test_the_offline_comparison_sends_less_for_the_same_reuse() -> None:
    from benchmarks.preroll_offline import rows

    cold, stretch, warm = rows(conversations(), 270.0, 300.0)
    assert cold["requests_sent"] == 0 and cold["window_reuse"] < warm["window_reuse"]
    assert warm["tokens_sent"] < stretch["tokens_sent"]
    assert warm["requests_sent"] < stretch["requests_sent"]
    assert warm["window_reuse"] >= stretch["window_reuse"]


def test_the_per_step_row_builds_its_step_runners_without_keeping_the_warm_set() -> None:
    import optimizer.capacity.trial as capacity_trial
    from benchmarks.preroll_benchmark import _warm_set_every_step

    saved = capacity_trial.StepRunner
    with _warm_set_every_step():
        assert capacity_trial.StepRunner.keywords == {"keep_warm_set": False}  # type: ignore[attr-defined]
    assert capacity_trial.StepRunner is saved
