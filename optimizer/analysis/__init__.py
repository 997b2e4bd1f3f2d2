"""Analysis of a finished or running study (reads Optuna through TrialView, writes nothing but
the files it is asked for). MLflow is not here: :mod:`optimizer.tracking` logs what these make.

- :mod:`.front`: the feasible front beside the baseline as documents (JSON, CSV), the class of
  every trial (pareto, dominated, slo_missed, failed, ...), parameter importances;
- :mod:`.hypervolume`: the hypervolume after each trial, normalized by the baseline;
- :mod:`.diagnosis`: a serving engineer's reading of one trial (TTFT- or TPOT-bound, KV cache
  against the concurrency, preemptions, prefix-cache hits, SLOs missed);
- :mod:`.documents`: report.md (baseline vs the front, winners' changes, capacity, diagnosis);
- :mod:`.plots`: the front's 2-D projections and a trial's latency CDFs;
- :mod:`.capacity`: capacity at SLO in a user's terms (baseline vs best, servers and GPUs for a
  peak, cost per million tokens, why SLOs nobody meets are unmet).
"""
