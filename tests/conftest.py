"""Shared fixtures: a tiny model folder and, for integration tests, the installed vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `tiny` model folder made by make-model (no weights: served with --load-format dummy)."""
    from optimizer.engine.models import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def vllm_install():  # type: ignore[no-untyped-def]
    """The vLLM build of this interpreter; integration tests skip without one, except in CI."""
    from optimizer.engine.flags import installed_vllm
    from optimizer.errors import ConfigError

    try:
        return installed_vllm()
    except ConfigError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the integration tier with vLLM installed: {exc}")
        pytest.skip(str(exc))
