"""FAKE stability runs: a server that is never started, whose requests are served with a made-up
latency and whose memory grows at a made-up rate, judged by the real verdicts and written with
the real ``write_outcome`` (so a run folder looks like one a real run leaves). Import them; do
not copy them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from optimizer.stability.plan import PlanLoad, StabilityPlan
from optimizer.stability.run import RunOutcome, Target, write_outcome
from optimizer.stability.verdicts import Sample, evaluate, phase_stats, windows
from optimizer.types import EngineConfig, RequestRecord

__all__ = ["FakeServer", "fake_outcome", "fake_run_on_new_server"]


class FakeServer:
    """How a fake server behaves: TTFT and time per output token (ms), RSS growth (MiB per
    minute from 1000 MiB), KV-cache usage, and GPU memory (None: no GPU)."""

    def __init__(
        self,
        *,
        ttft_ms: float = 40.0,
        tpot_ms: float = 8.0,
        rss_growth_mib_per_min: float = 0.0,
        kv_usage: float = 0.2,
        gpu_mib: float | None = None,
    ) -> None:
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.rss_growth_mib_per_min = rss_growth_mib_per_min
        self.kv_usage = kv_usage
        self.gpu_mib = gpu_mib

    def records(self, load: PlanLoad) -> tuple[RequestRecord, ...]:
        out = []
        for i, r in enumerate(load.trace.requests):
            first = r.arrival_s + self.ttft_ms / 1000
            chunks = tuple(first + k * self.tpot_ms / 1000 for k in range(r.output_tokens))
            out.append(
                RequestRecord(
                    index=i,
                    scheduled_s=r.arrival_s,
                    sent_s=r.arrival_s,
                    first_token_s=first,
                    chunk_times_s=chunks,
                    end_s=chunks[-1] if chunks else first,
                    input_tokens=r.input_tokens,
                    output_tokens=r.output_tokens,
                )
            )
        return tuple(out)

    def samples(self, plan: StabilityPlan) -> list[Sample]:
        n = int(plan.duration_s) + 4
        return [
            Sample(
                t_s=float(t),
                rss_mib=1000.0 + self.rss_growth_mib_per_min * t / 60,
                gpu_mib=self.gpu_mib,
                kv_usage=self.kv_usage,
                running=2.0,
                waiting=0.0,
                preemptions=0.0,
            )
            for t in range(-2, n)
        ]


def fake_outcome(
    server: FakeServer,
    load: PlanLoad,
    plan: StabilityPlan,
    target: Target,
    *,
    label: str,
    engine_args: Mapping[str, Any] | None = None,
) -> RunOutcome:
    """The outcome a run on ``server`` would have, judged by the real verdicts."""
    records = server.records(load)
    samples = server.samples(plan)
    slos = list(target.slos)
    return RunOutcome(
        label=label,
        engine_args=dict(engine_args or {}),
        verdicts=evaluate(records, load.long_input, samples, plan, slos, target.thresholds),
        windows=windows(records, plan, slos),
        phases=phase_stats(samples, plan),
        samples=samples,
        records=records,
        p99_send_lag_ms=1.0,
        startup_s=0.5,
    )


def fake_run_on_new_server(servers: Mapping[str, FakeServer]) -> Callable[..., RunOutcome]:
    """A stand-in for :func:`optimizer.stability.run.run_on_new_server`: the server of each
    label (``chosen``, ``baseline``) is a :class:`FakeServer`; its files are written where a
    real run writes them."""

    def run(
        config: EngineConfig,
        load: PlanLoad,
        plan: StabilityPlan,
        target: Target,
        *,
        label: str,
        workdir: Path,
        **_: Any,
    ) -> RunOutcome:
        outcome = fake_outcome(
            servers[label], load, plan, target, label=label, engine_args=config.args
        )
        write_outcome(outcome, workdir)
        return outcome

    return run
