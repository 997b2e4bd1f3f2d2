"""Declarative search spaces over vLLM engine flags (YAML presets and their schema)."""

from search_spaces.constraints import CPU_BLOCK_MULTIPLE, ConstraintContext, check_constraints
from search_spaces.schema import (
    CategoricalParam,
    FloatParam,
    IntParam,
    Param,
    Scalar,
    SearchSpace,
    SearchSpaceError,
    list_presets,
    load_space,
    normalize_flag,
)

__all__ = [
    "CPU_BLOCK_MULTIPLE",
    "CategoricalParam",
    "ConstraintContext",
    "FloatParam",
    "IntParam",
    "Param",
    "Scalar",
    "SearchSpace",
    "SearchSpaceError",
    "check_constraints",
    "list_presets",
    "load_space",
    "normalize_flag",
]
