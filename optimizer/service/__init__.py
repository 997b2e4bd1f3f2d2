"""The tuner as a service: teams submit job files over HTTP, the service runs their studies.

One room per job (import the module you need; this package imports nothing):

- :mod:`.submissions`: a submission (job file, time window, uploaded trace) parsed from a body;
- :mod:`.security`: the policy (flag and environment allow-lists, bounded parsing, path roots,
  the one redaction rule) and :mod:`.auth`: team tokens;
- :mod:`.settings`: the service's settings and token loading;
- :mod:`.store`: the job store (SQL), the source of truth for every job's state, and each
  job's study name in its Optuna storage (team and job id);
- :mod:`.scheduler`: first in, first out, a number of studies at once;
- :mod:`.study_host`: a study's driver, hosted in a detached Ray actor;
- :mod:`.validations`: re-validated exports as jobs of their own, queued per team;
- :mod:`.facade`: everything the API does, without HTTP (submit, show, cancel, export);
- :mod:`.admission`: what the facade accepts of a submission before it is queued (roots,
  models, the keys the service decides, the plan check);
- :mod:`.check_workers`: the processes that parse and check submissions off the replica;
- :mod:`.bodies`: slow request bodies timed and bounded, a submission refused before its body
  while its team's check slots are full;
- :mod:`.api`: the HTTP API and its Ray Serve deployment;
- :mod:`.client`: the commands (``serve``, ``token``) and a thin HTTP client (``submit``, ...).
"""
