"""Fixtures shared across the suite."""

import os
import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint (built in about a second, never downloaded)."""
    from testkit.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session", autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Usage ledgers and other state of gateways under test stay out of the user's home."""
    path = tmp_path_factory.mktemp("state")
    os.environ["XDG_STATE_HOME"] = str(path)
    return path


@pytest.fixture(params=["memory", "redis"])
async def store_settings(request):
    """Gateway settings that pick the shared state: in-process, or a real Redis under a key
    prefix of its own, removed afterwards."""
    if request.param == "memory":
        yield {}
        return
    prefix = f"sluice-test-{uuid.uuid4().hex[:12]}:"
    yield {"redis_url": REDIS_URL, "redis_prefix": prefix}
    client = Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
