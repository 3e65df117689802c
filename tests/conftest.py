"""Fixtures shared across the suite."""

import contextlib
import os
import uuid
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis

from gateway.event_loop import EVENT_LOOPS, loop_factory
from tests.support.tiers import mark_tiers

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# every prefix store_settings handed out, swept once more when the session ends
_STORE_PREFIXES: list[str] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test's tier marks: redis, process, browser (tests/support/tiers.py)."""
    mark_tiers(items)


# the event loops `sluice serve` can run on, by their setting's names, made as serve makes them
LOOPS = {name: loop_factory(name) for name in EVENT_LOOPS}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict:
    """Async tests run on uvloop, the loop `sluice serve` runs on by default, or on their
    module's `EVENT_LOOP`; one marked `asyncio(loop_factories=[…])` on each loop it names
    (tests/support/loops.py)."""
    marker = item.get_closest_marker("asyncio")
    if marker is not None and "loop_factories" in marker.kwargs:
        return LOOPS
    name = getattr(item.module, "EVENT_LOOP", "uvloop")
    return {name: LOOPS[name]}


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
    _STORE_PREFIXES.append(prefix)
    yield {"redis_url": REDIS_URL, "redis_prefix": prefix}
    client = Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture(scope="session", autouse=True)
def store_prefixes_swept():
    """A test's app closes after `store_settings` has cleaned up (fixtures end in reverse order),
    and its usage ledger writes its last record then: the session's end removes what remains
    under the prefixes it handed out."""
    yield
    client = redis.Redis.from_url(REDIS_URL)
    with contextlib.suppress(redis.ConnectionError):
        for prefix in _STORE_PREFIXES:
            keys = list(client.scan_iter(match=f"{prefix}*"))
            if keys:
                client.delete(*keys)
    client.close()
