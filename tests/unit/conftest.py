"""The tiny model loaded once for the unit tests that run the engine or a worker app on it."""

from __future__ import annotations

import pytest

from workers.model_loader import load_model
from workers.service import LoadedModel


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """(model, tokenizer) of the tiny checkpoint, float32 on the CPU."""
    return load_model(tiny_model_dir, "cpu", "float32")


@pytest.fixture(scope="session")
def loaded(tiny) -> LoadedModel:
    """The tiny model as a worker service holds it."""
    model, tokenizer = tiny
    return LoadedModel(model, tokenizer, "tiny")
