"""Analysis of a finished or running study (reads Optuna through TrialView, writes nothing).

- :mod:`optimizer.analysis.capacity`: capacity at SLO in a user's terms (baseline vs best,
  servers and GPUs for a peak, cost per million tokens, why SLOs nobody meets are unmet).
"""
