"""One real `sluice serve` (gateway + its own worker on the tiny model) for e2e tests."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.support.serve import Served, serving

E2E_KEY = "sk-sluice-e2e"
DISCONNECT_GRACE = 1.0


@pytest.fixture(scope="session")
def served(tiny_model_dir) -> Served:
    flags = ("--max-body-bytes", str(256 * 1024), "--disconnect-grace", str(DISCONNECT_GRACE))
    with serving(tiny_model_dir, *flags, key=E2E_KEY) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(served) -> OpenAI:
    """The official client, pointed at the shared serve."""
    return OpenAI(base_url=served.base_url, api_key=E2E_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    (only,) = client.models.list().data
    return only.id
