"""The stability check of a study folder, above the study (it prepares the study's plan and
picks the trial as ``export`` does); its parts below the job file are :mod:`optimizer.stability`.

- :mod:`.workflow`: the chosen configuration and the baseline under the same plan, each on a
  server of its own, into ``stability.json``;
- :mod:`.rejudge`: a stored check judged again with the verdict rules installed now;
- :mod:`.command`: ``vllm-autotune stability``.
"""
