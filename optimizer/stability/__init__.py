"""Stability check of a configuration before it ships (issue 18).

- :mod:`.plan`: the phases (sustained load at a fraction of capacity, a burst, recovery, long
  inputs) and the one load they make (pure);
- :mod:`.sampler`: the server's state over time (``/metrics`` gauges, process-group RSS, GPU
  memory);
- :mod:`.verdicts`: verdicts with numbers (memory slope with its interval, errors and
  preemptions per phase, drift, spikes, recovery time, long inputs) and the comparison with the
  baseline (pure);
- :mod:`.run`: the plan on one server; :mod:`.workflow`: the check of a study folder
  (``stability.json``) and what ``export`` and MLflow read of it; :mod:`.plots`: the check's
  time series as PNGs, from its stored files; :mod:`.command`: ``vllm-autotune stability``.
"""
