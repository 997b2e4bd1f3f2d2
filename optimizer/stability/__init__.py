"""Stability of a configuration before it ships (issue 18): the check's parts that need no job
file and no study. This package lies below :mod:`optimizer.config` (the job file builds its
options); the check of a study folder and the command sit above the study, in
:mod:`optimizer.stability_check`.

- :mod:`.plan`: the phases (sustained load at a fraction of capacity, a burst, recovery, long
  inputs), their rate scales and the one load they make (pure);
- :mod:`.options`: what a user chose, a record the job file and the command build (pure);
- :mod:`.verdicts`: verdicts with numbers (memory slope with its interval, errors and
  preemptions per phase, drift, spikes, recovery time, long inputs) and the comparison with the
  baseline (pure);
- :mod:`.sampler`: the server's state over time (``/metrics`` gauges, process-group RSS, GPU
  memory);
- :mod:`.run`: the plan on one server;
- :mod:`.stored`: the ``stability.json`` document, and what ``export`` and MLflow read of it;
- :mod:`.plots`: the check's time series as PNGs, from its stored files.
"""
