"""Fixtures shared across the suite."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint (built in about a second, never downloaded)."""
    from workers.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session", autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Usage ledgers and other state of gateways under test stay out of the user's home."""
    import os

    path = tmp_path_factory.mktemp("state")
    os.environ["XDG_STATE_HOME"] = str(path)
    return path
