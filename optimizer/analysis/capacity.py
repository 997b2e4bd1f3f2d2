"""The capacity answer in a user's terms: baseline vs best, servers and GPUs for a peak, cost.

Reads a study through :class:`~optimizer.trial_view.TrialView` and answers:

- how much of this traffic one server carries within the SLOs with vLLM's defaults and with
  the best configuration found, and their ratio;
- for a peak request rate (``peak_rps``), the servers and GPUs each needs
  (``ceil(peak / capacity)`` servers x GPUs per server);
- with a GPU-hour price, the cost per million output tokens at capacity;
- when the SLOs were met at no scale tried, why, in numbers (the SLO floors the trace and the
  measured server set) and what would meet them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna

from optimizer.analysis.trial_cost import study_cost
from optimizer.trial_view import CapacityView, TrialView, feasible_front, quality_verdicts

__all__ = ["CapacityAnswer", "TrialCapacity", "capacity_answer", "explain_unmet"]


@dataclass(frozen=True)
class TrialCapacity:
    """One configuration's capacity, with its uncertainty.

    Attributes:
        number: Trial number.
        rps: Requests/s within the SLOs.
        output_tps: Output tokens/s within the SLOs.
        scale: The rate scale of the trace that carried (the estimate).
        bracket: ``x[lo, hi]``, the scales measured on either side.
        answer: The capacity in words: estimate, its range, the bracket in req/s
            (:meth:`CapacityView.rps_text`).
        bracket_width: ``hi / lo - 1`` (NaN when open).
        repeat_spread: Largest spread among a repeated step's margins.
        gpus_per_server: GPUs one server takes (0 on the CPU build).
        broke_first: The SLO that broke first above the capacity (or at the lowest scale).
        steps: Steps measured.
        kv_cache_tokens: Tokens the engine's KV cache holds, from its startup log (the memory
            account beside the capacity: what FP8 KV cache or FP8 weights buy; None when the
            log did not say).
    """

    number: int
    rps: float
    output_tps: float
    scale: float
    bracket: str
    answer: str
    bracket_width: float
    repeat_spread: float
    gpus_per_server: int
    broke_first: str | None
    steps: int
    kv_cache_tokens: int | None = None

    @classmethod
    def of(cls, view: TrialView, cap: CapacityView, cpu_build: bool) -> TrialCapacity:
        """From a stored trial."""
        broke = cap.broke_first
        if broke is None and cap.rps <= 0:
            low = cap.lowest_step()
            margins = (low or {}).get("margins") or {}
            bad = {k: v for k, v in margins.items() if v is None or v > 0}
            broke = max(bad, key=lambda k: bad[k] if bad[k] is not None else math.inf, default=None)
        return cls(
            number=view.number,
            rps=cap.rps,
            output_tps=cap.output_tps,
            scale=cap.estimate_scale,
            bracket=cap.bracket_text(),
            answer=cap.rps_text(),
            bracket_width=cap.bracket_width,
            repeat_spread=cap.repeat_spread,
            gpus_per_server=view.gpus(cpu_build=cpu_build),
            broke_first=broke,
            steps=len(cap.steps),
            kv_cache_tokens=_kv_tokens(view),
        )


@dataclass(frozen=True)
class CapacityAnswer:
    """What the study says about capacity.

    Attributes:
        baseline: vLLM's defaults (None before the baseline finished).
        best: The configuration with the highest capacity (None when none measured).
        trials: Every measured capacity trial, by number.
        gain: ``best.rps / baseline.rps`` (None without a baseline capacity).
        peak_rps: The peak to provision for, when given.
        servers: ``{"baseline": n, "best": n}`` servers needed for ``peak_rps``.
        gpus: The same in GPUs (servers x GPUs per server; None on the CPU build).
        gpu_hour_price: Price of a GPU-hour, when given.
        cost_per_m_output_tokens: ``{"baseline": $, "best": $}`` at capacity.
        unmet: Explanations when the SLOs were met at no scale (by the baseline or by all).
        cpu_build: Servers have no GPUs.
    """

    baseline: TrialCapacity | None
    best: TrialCapacity | None
    trials: tuple[TrialCapacity, ...]
    gain: float | None
    peak_rps: float | None = None
    servers: Mapping[str, int] = field(default_factory=dict)
    gpus: Mapping[str, int] = field(default_factory=dict)
    gpu_hour_price: float | None = None
    cost_per_m_output_tokens: Mapping[str, float] = field(default_factory=dict)
    unmet: tuple[str, ...] = ()
    cpu_build: bool = False

    def lines(self) -> list[str]:
        """The answer as sentences for a console, report or export header."""
        out: list[str] = []
        b, w = self.baseline, self.best
        if b is not None:
            out.append(f"baseline (vLLM defaults, trial {b.number}): {_cap(b)}")
        if w is not None and (b is None or w.number != b.number):
            out.append(f"best (trial {w.number}): {_cap(w)}")
        elif w is not None:
            out.append("best: the baseline itself (no tuned configuration carried more)")
        if self.gain is not None:
            out.append(f"capacity gain over the baseline: x{self.gain:.2f}")
        kv = self.kv_line()
        if kv:
            out.append(kv)
        elif b is not None and b.rps <= 0 and w is not None and w.rps > 0:
            out.append("the baseline met the SLOs at no scale tried; the best does")
        if self.peak_rps is not None and self.servers:
            unit = "servers" if self.cpu_build else "GPUs"
            need = self.servers if self.cpu_build else self.gpus
            parts = [f"{k} {v:,} {unit}" for k, v in need.items()]
            out.append(f"for a peak of {self.peak_rps:g} req/s: " + ", ".join(parts))
        if self.cost_per_m_output_tokens:
            parts = [f"{k} {v:,.3f}" for k, v in self.cost_per_m_output_tokens.items()]
            out.append(
                f"cost per million output tokens at capacity (GPU-hour {self.gpu_hour_price:g}): "
                + ", ".join(parts)
            )
        out += list(self.unmet)
        return out

    def kv_line(self) -> str:
        """The memory account beside the capacity: KV cache tokens of the baseline and the best
        (and their ratio), as their engines logged at startup; "" when neither said."""
        b, w = self.baseline, self.best
        parts = []
        if b is not None and b.kv_cache_tokens:
            parts.append(f"baseline {b.kv_cache_tokens:,} tokens")
        if w is not None and w.kv_cache_tokens and (b is None or w.number != b.number):
            text = f"best {w.kv_cache_tokens:,} tokens"
            if b is not None and b.kv_cache_tokens:
                text += f" (x{w.kv_cache_tokens / b.kv_cache_tokens:.2f})"
            parts.append(text)
        return "KV cache: " + ", ".join(parts) if parts else ""

    def export_line(self, number: int) -> str:
        """One line for an export header: trial ``number``'s capacity beside the baseline's."""
        mine = next((c for c in self.trials if c.number == number), None)
        if mine is None:
            return ""
        text = f"{mine.answer} ({mine.output_tps:,.4g} output tok/s) of the trace's mix"
        text += f" within the SLOs during the study (trace rate {mine.bracket})"
        b = self.baseline
        if b is not None and b.number != number:
            text += f"; baseline {b.rps:,.3g} req/s"
            if b.rps > 0:
                text += f" (x{mine.rps / b.rps:.2f})"
        if mine.kv_cache_tokens:
            text += f"; KV cache {mine.kv_cache_tokens:,} tokens"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (``show --json``, MLflow, report)."""

        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list | tuple):
                return [clean(x) for x in v]
            return v

        return clean(asdict(self))  # type: ignore[no-any-return]

    def metrics(self) -> dict[str, float]:
        """Parent-run metrics: baseline and best capacity, the gain, servers/GPUs, costs."""
        out: dict[str, float] = {}
        if self.baseline is not None:
            out["baseline_capacity_rps"] = self.baseline.rps
            out["baseline_capacity_output_tps"] = self.baseline.output_tps
        if self.best is not None:
            out["best_capacity_rps"] = self.best.rps
            out["best_capacity_output_tps"] = self.best.output_tps
        if self.gain is not None:
            out["capacity_gain"] = self.gain
        for k, c in (("baseline", self.baseline), ("best", self.best)):
            if c is not None and c.kv_cache_tokens:
                out[f"{k}_kv_cache_tokens"] = float(c.kv_cache_tokens)
        for k, n in self.servers.items():
            out[f"{k}_servers_for_peak"] = float(n)
        for k, n in self.gpus.items():
            out[f"{k}_gpus_for_peak"] = float(n)
        for k, cost in self.cost_per_m_output_tokens.items():
            out[f"{k}_cost_per_m_output_tokens"] = cost
        return out


def _kv_tokens(view: TrialView) -> int | None:
    raw = view.memory.get("kv_cache_tokens")
    return int(raw) if isinstance(raw, int | float) and raw > 0 else None


def _cap(c: TrialCapacity) -> str:
    if c.rps <= 0:
        broke = f" ({c.broke_first} missed)" if c.broke_first else ""
        return f"met the SLOs at no rate scale tried{broke}"
    width = "" if math.isnan(c.bracket_width) else f", ±{c.bracket_width:.0%} bracket"
    spread = f", repeat spread {c.repeat_spread:.0%}" if c.repeat_spread > 0 else ""
    return (
        f"{c.answer}, {c.output_tps:,.4g} output tok/s within the SLOs "
        f"(trace rate {c.bracket}{width}{spread}; {c.steps} steps)"
    )


def explain_unmet(view: TrialView, cap: CapacityView) -> list[str]:
    """Why a configuration met the SLOs at no scale tried, with numbers, and what would.

    Uses what was measured at the lowest scale: the trace's largest same-instant burst over the
    fastest prefill the server showed bounds TTFT from below, and the lightest decode step
    seen bounds TPOT from below. A floor above the threshold means no scheduling can meet the
    SLO on this server; a floor below it means the misses come from load (queueing, prefills
    sharing decode steps), which the engine's batch limits or a lower rate can change.
    """
    from objectives import parse_slo

    low = cap.lowest_step()
    if low is None:
        return []
    margins = low.get("margins") or {}
    missed = [k for k, v in margins.items() if v is None or v > 0]
    f = cap.floors
    out = []
    scale = float(low["scale"])
    for text in missed:
        slo = parse_slo(text)
        margin = margins.get(text)
        seen = (
            f" (measured {slo.threshold * (1 + margin):,.0f} ms)"
            if margin is not None and slo.metric.endswith("_ms")
            else ""
        )
        head = f"trial {view.number}: {slo} missed even at x{scale:g} of the trace's rate{seen}"
        ttft_floor = f.get("ttft_floor_ms", math.nan)
        tpot_floor = f.get("tpot_floor_ms", math.nan)
        if "ttft" in slo.metric and not math.isnan(ttft_floor):
            burst = (
                f"the trace's largest burst (arrivals within 50 ms) is "
                f"{f.get('burst_requests', 0):.0f} "
                f"requests with {f.get('burst_prompt_tokens', 0):,.0f} prompt tokens, and this "
                f"server prefilled at most {f['prefill_tokens_per_s']:,.0f} tokens/s, so the "
                f"last of them waits at least {ttft_floor:,.0f} ms"
            )
            if ttft_floor > slo.threshold:
                out.append(
                    f"{head}: {burst}. No scheduling meets it on this server. To meet it: a TTFT "
                    f"SLO of at least {ttft_floor:,.0f} ms, more GPUs per server "
                    "(tensor-parallel-size), or spreading the trace's coarse timestamps "
                    "(trace.shaping.spread_ticks)."
                )
            else:
                out.append(
                    f"{head}: {burst}, within the SLO: the misses come from queueing under this "
                    "load, not from the burst itself. To meet it: a lower min_scale to find "
                    "where it holds, or batch limits that prefill sooner "
                    "(max-num-batched-tokens, max-num-seqs)."
                )
        elif "tpot" in slo.metric and not math.isnan(tpot_floor):
            if tpot_floor > slo.threshold:
                out.append(
                    f"{head}: the lightest decode step this server showed took "
                    f"{tpot_floor:,.1f} ms per token. No batch limit meets it on this server. To "
                    f"meet it: a TPOT SLO of at least {tpot_floor:,.1f} ms, or a faster server "
                    "(more GPUs per server, a smaller or quantized model)."
                )
            else:
                out.append(
                    f"{head}, while its lightest decode step took {tpot_floor:,.1f} ms per "
                    "token: the misses come from prefills sharing decode steps, not from the "
                    "decode speed. To meet it: a smaller prefill chunk per step "
                    "(max-num-batched-tokens), which the tuned configurations can show."
                )
        else:
            out.append(f"{head}.")
    return out


def capacity_answer(
    study: optuna.Study,
    *,
    peak_rps: float | None = None,
    gpu_hour_price: float | None = None,
    cpu_build: bool = False,
) -> CapacityAnswer | None:
    """The study's capacity answer; None for a study without capacity trials."""
    views = [TrialView(t) for t in study.get_trials(deepcopy=False)]
    # Raced-out trials too: their line says the upper bound they were raced out below.
    measured = [
        (v, v.capacity)
        for v in views
        if (v.measured or v.status == "raced_out") and v.capacity is not None
    ]
    if not measured:
        return None
    caps = tuple(TrialCapacity.of(v, c, cpu_build) for v, c in measured if c is not None)
    baseline = next((c for (v, _), c in zip(measured, caps, strict=True) if v.is_baseline), None)
    best = max(caps, key=lambda c: (c.rps, -c.number))
    gain = best.rps / baseline.rps if baseline is not None and baseline.rps > 0 else None
    servers: dict[str, int] = {}
    gpus: dict[str, int] = {}
    chosen = {"baseline": baseline, "best": best}
    if peak_rps is not None:
        for k, c in chosen.items():
            if c is not None and c.rps > 0:
                servers[k] = math.ceil(peak_rps / c.rps)
                if not cpu_build:
                    gpus[k] = servers[k] * max(1, c.gpus_per_server)
    costs: dict[str, float] = {}
    if gpu_hour_price is not None and not cpu_build:
        for k, c in chosen.items():
            if c is not None and c.output_tps > 0:
                per_hour = gpu_hour_price * max(1, c.gpus_per_server)
                costs[k] = per_hour / (c.output_tps * 3600.0) * 1e6
    unmet: list[str] = []
    nobody = all(c.rps <= 0 for c in caps)
    for v, view in measured:
        # Explained: the baseline when it carried nothing; every trial when none did.
        if view is not None and view.rps <= 0 and not view.raced_out and (v.is_baseline or nobody):
            unmet += explain_unmet(v, view)
    return CapacityAnswer(
        baseline=baseline,
        best=best,
        trials=caps,
        gain=gain,
        peak_rps=peak_rps,
        servers=servers,
        gpus=gpus,
        gpu_hour_price=gpu_hour_price,
        cost_per_m_output_tokens=costs,
        unmet=tuple(unmet),
        cpu_build=cpu_build,
    )


def answer_for_plan(
    study: optuna.Study,
    plan: Mapping[str, Any],
    *,
    peak_rps: float | None = None,
    gpu_hour_price: float | None = None,
) -> CapacityAnswer | None:
    """:func:`capacity_answer` with the job's ``capacity.peak_rps`` / ``gpu_hour_price`` and
    hardware from a study's ``plan.json`` (explicit arguments win)."""
    section = ((plan.get("job") or {}).get("capacity") or {}) if plan else {}
    cpu_build = str(plan.get("hardware", "")).startswith("CPU") if plan else False
    return capacity_answer(
        study,
        peak_rps=peak_rps if peak_rps is not None else section.get("peak_rps"),
        gpu_hour_price=(
            gpu_hour_price if gpu_hour_price is not None else section.get("gpu_hour_price")
        ),
        cpu_build=cpu_build,
    )


def study_json(
    study: optuna.Study, plan: Mapping[str, Any], answer: CapacityAnswer | None
) -> dict[str, Any]:
    """A study as one JSON document (``show --json``): every trial and the front."""
    trials = []
    front = {t.number for t in feasible_front(study)}
    quality = quality_verdicts(study)
    for t in study.get_trials(deepcopy=False):
        v = TrialView(t)
        cap = v.capacity_doc
        trials.append(
            {
                "number": v.number,
                "status": v.status,
                "baseline": v.is_baseline,
                "engine_args": v.engine_args,
                "values": list(t.values) if t.values and v.measured else None,
                "summary": {k: (None if math.isnan(x) else x) for k, x in v.summary.items()},
                "partial": v.partial,
                "stopped_by": v.stopped_by or None,
                "slos": v.slo_verdicts(),
                "message": v.message,
                "capacity": cap if isinstance(cap, Mapping) else None,
                "memory": v.memory or None,
                "startup_s": v.startup_s,
                "startup": v.startup_doc or None,
                "replay_s": v.replay_s,
                "pareto": v.number in front,
                "quality": quality.get(v.number),
            }
        )
    return {
        "study": study.study_name,
        "objectives": [
            f"{'min' if d == optuna.study.StudyDirection.MINIMIZE else 'max'}:{n}"
            for n, d in zip(study.metric_names or [], study.directions, strict=False)
        ],
        "slos": list(plan.get("slos", [])) if plan else [],
        "front": sorted(front),
        "trials": trials,
        "capacity": answer.to_dict() if answer is not None else None,
        "trial_cost": study_cost(study.get_trials(deepcopy=False)).to_dict(),
    }
