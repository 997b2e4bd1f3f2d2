"""Workloads: trace formats and importers, synthetic traces, shaping, and the replayer.

Never imports ray, mlflow, vllm or torch.
"""
