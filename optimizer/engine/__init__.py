"""The engine room: one vLLM server as a subprocess the tuner fully controls, and what it needs.

This package imports nothing, so the guard (``python -m optimizer.engine.guard``) still starts
on the standard library alone; import the module you need.

- :mod:`.process`: :class:`EngineProcess` (start, health, stop with its whole process group,
  orphans reaped), the server's command line;
- :mod:`.guard`: the watchdog a server runs under (``python -m optimizer.engine.guard``); it
  kills the server's group when its owner dies;
- :mod:`.logs`: the server's log and /metrics read (failure classes, memory account, effective
  config);
- :mod:`.flags`: the installed vLLM's flags, validation of engine arguments against them;
- :mod:`.models`: servable weight-less model folders (``--load-format dummy``) and model facts;
- :mod:`.defaults`: the one rule for a local server's defaults (dummy weights, the CPU build's
  KV cache variable, the prompt token range), shared by the CLI and study preparation.
"""
