"""Where a server's start goes: its startup split into phases, timed as the log is written.

A vLLM server's start is a fixed sequence (the same for the GPU build and the CPU build; a
phase a configuration does not have, such as torch.compile under ``--enforce-eager``, is simply
absent): the API server's imports, the engine-core process, the device and worker set-up, the
model and its weights, torch.compile, memory profiling, the KV cache, CUDA-graph capture, the
rest of the engine's warm-up, the API server's routes, and the first ``/health`` answer.

:class:`StartupClock` is fed the log's lines as they appear (``EngineProcess`` tails the log
while it waits for ``/health``) with the seconds since launch, and notes when each milestone
line first showed. A phase lasts from the previous milestone seen to its own, so the phases
always add up to the launch-to-healthy time, and a phase whose line never showed hands its time
to the next one seen. vLLM's own figures for the same work (``Loading weights took``,
``torch.compile took``, ``Graph capturing finished in``, ``init engine ... took``) are kept
beside them as ``reported``: they time the work alone; the phases time it as the user waits.

Stdlib only; nothing here reads a file or the clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["PHASES", "StartupClock", "phase_label", "phase_table_rows", "phases_from_log"]


@dataclass(frozen=True, slots=True)
class _Milestone:
    phase: str  # the phase this line ends
    pattern: re.Pattern[str]


#: The phases, in the order a start goes through them, each with the line that ends it.
_MILESTONES: tuple[_Milestone, ...] = (
    # The API server logs its arguments once its imports are done.
    _Milestone("imports", re.compile(r"non-default args:|vLLM API server version")),
    _Milestone("engine_start", re.compile(r"Initializing a V1 LLM engine")),
    _Milestone("device_init", re.compile(r"Starting to load model")),
    _Milestone(
        "weights",
        re.compile(r"Model loading took|Loading weights took|Initializing model took"),
    ),
    _Milestone("torch_compile", re.compile(r"torch\.compile (?:takes|took) [\d.]+ s in total")),
    _Milestone(
        "memory_profiling",
        re.compile(r"Available KV cache memory|Memory profiling takes|GiB for KV cache"),
    ),
    _Milestone("kv_cache", re.compile(r"KV cache size: [\d,]+ tokens")),
    _Milestone("cuda_graphs", re.compile(r"Graph capturing finished in")),
    _Milestone("engine_warmup", re.compile(r"init engine \(profile, create kv cache")),
    _Milestone(
        "api_ready",
        re.compile(r"Starting vLLM (?:API )?server|Application startup complete"),
    ),
)

#: Every phase name, in order; ``health`` is the last milestone line to the first ``/health`` 200.
#: ``preload_wait`` (first) is the wait for a preloaded interpreter's imports
#: (:mod:`optimizer.engine.preload`); it is 0 when they were done while other work ran.
PHASES: tuple[str, ...] = ("preload_wait", *(m.phase for m in _MILESTONES), "health")

_REPORTED: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "weights",
        re.compile(
            r"(?:Model loading took [\d.]+ GiB(?: memory)? and|Loading weights "
            r"took) ([\d.]+) s"
        ),
    ),
    ("torch_compile", re.compile(r"torch\.compile (?:takes|took) ([\d.]+) s in total")),
    ("cuda_graphs", re.compile(r"Graph capturing finished in ([\d.]+) sec")),
    (
        "engine_init",
        re.compile(
            r"init engine \(profile, create kv cache, warmup model\) took "
            r"([\d.]+)"
        ),
    ),
    ("compile_cache_hit", re.compile(r"Directly load (?:the compiled graph|AOT compilation)()")),
)


@dataclass
class StartupClock:
    """Milestones of one start, fed line by line with the seconds since launch."""

    marks: dict[str, float] = field(default_factory=dict)
    reported: dict[str, float] = field(default_factory=dict)
    healthy_s: float | None = None

    def feed(self, lines: Iterable[str], at_s: float) -> None:
        """Lines that appeared in the log by ``at_s`` seconds after launch."""
        for line in lines:
            for m in _MILESTONES:
                if m.phase not in self.marks and m.pattern.search(line):
                    self.marks[m.phase] = at_s
            for name, pattern in _REPORTED:
                hit = pattern.search(line)
                if hit is None:
                    continue
                if name == "compile_cache_hit":
                    self.reported[name] = self.reported.get(name, 0.0) + 1.0
                elif name == "torch_compile":
                    # Logged per compiled model part: add them up.
                    self.reported[name] = self.reported.get(name, 0.0) + float(hit.group(1))
                else:
                    self.reported.setdefault(name, float(hit.group(1)))

    def mark(self, phase: str, at_s: float) -> None:
        """A milestone the tuner itself saw (``preload_wait``: the arguments were handed over)."""
        self.marks.setdefault(phase, at_s)

    def healthy(self, at_s: float) -> None:
        """``/health`` answered 200 at ``at_s``."""
        self.healthy_s = at_s

    def phases(self) -> dict[str, float]:
        """Seconds per phase seen, in order; they add up to launch-to-healthy once healthy."""
        out: dict[str, float] = {}
        last = 0.0
        for phase in PHASES:
            at = self.healthy_s if phase == "health" else self.marks.get(phase)
            if at is None:
                continue
            out[phase] = round(max(0.0, at - last), 3)
            last = max(last, at)
        return out

    def as_doc(self) -> dict[str, dict[str, float]]:
        """What a trial's result stores: ``{"phases": ..., "reported": ...}``."""
        return {"phases": self.phases(), "reported": dict(self.reported)}


def phases_from_log(
    timed_lines: Iterable[tuple[float, str]], healthy_s: float | None
) -> dict[str, dict[str, float]]:
    """The startup document of lines already timed (seconds since launch, text)."""
    clock = StartupClock()
    for at, line in timed_lines:
        clock.feed((line,), at)
    if healthy_s is not None:
        clock.healthy(healthy_s)
    return clock.as_doc()


_LABELS = {
    "preload_wait": "wait for the preloaded interpreter",
    "imports": "API server imports",
    "engine_start": "engine-core process start",
    "device_init": "device and worker set-up",
    "weights": "model init and weight load",
    "torch_compile": "torch.compile",
    "memory_profiling": "memory profiling",
    "kv_cache": "KV-cache allocation",
    "cuda_graphs": "CUDA-graph capture",
    "engine_warmup": "engine warm-up",
    "api_ready": "API server ready",
    "health": "first /health answer",
}


def phase_label(phase: str) -> str:
    """A phase's name for people (``torch_compile`` -> ``torch.compile``)."""
    return _LABELS.get(phase, phase)


def phase_table_rows(doc: Mapping[str, Mapping[str, float]]) -> list[tuple[str, str, str]]:
    """(phase label, seconds, vLLM's own figure) rows for a console or report table."""
    phases = doc.get("phases") or {}
    reported = doc.get("reported") or {}
    rows = []
    for phase, seconds in phases.items():
        own = reported.get(phase)
        rows.append(
            (_LABELS.get(phase, phase), f"{seconds:.1f}", "" if own is None else f"{own:.1f}")
        )
    if phases:
        rows.append(("total (launch to healthy)", f"{sum(phases.values()):.1f}", ""))
    return rows
