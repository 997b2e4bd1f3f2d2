"""vllm-autotune: find the vLLM engine configuration that serves your real traffic best.

The ``optimizer`` package is the service: engine process control, workload replay, the study,
tracking, export and the command line. Pure scoring lives in :mod:`objectives`, declarative search
spaces in :mod:`search_spaces`.
"""

__version__ = "0.1.0"
