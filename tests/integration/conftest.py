"""Processes shared by integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.scripted_upstream import UpstreamState, make_app
from tests.support.processes import scripted_upstream_process


@pytest.fixture(scope="session")
def scripted_upstream() -> Iterator[str]:
    """The scripted OpenAI-compatible upstream as its own process; its base URL (`…/v1`)."""
    with scripted_upstream_process() as url:
        yield url


@pytest.fixture
async def upstream(aiohttp_server):
    """An in-process scripted upstream: its state (scripts, records) and its base URL."""
    state = UpstreamState()
    server = await aiohttp_server(make_app(state))
    return state, f"http://127.0.0.1:{server.port}/v1"
