"""Capacity at SLO: how much of a trace one configuration serves while every SLO holds.

- :mod:`optimizer.capacity.search`: the pure rate search (bracket, bisect, repeat near-threshold
  steps) over a ``measure(scale)`` callable;
- :mod:`optimizer.capacity.measure`: steps on one running server (the trace rescaled, fresh
  prompts, no request in flight and the prefix cache reset between steps; a windowed trace's
  warm set sent once and kept instead).
"""

from optimizer.capacity.search import CapacityResult, CapacitySettings, StepOutcome, search_capacity

__all__ = ["CapacityResult", "CapacitySettings", "StepOutcome", "search_capacity"]
