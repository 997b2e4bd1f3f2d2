"""Declarative search spaces over vLLM engine flags (YAML presets and their schema)."""
