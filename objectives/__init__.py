"""Pure scoring: metrics from request records, objectives and SLO constraints.

Nothing here does I/O or imports ray, mlflow, vllm or torch.
"""
