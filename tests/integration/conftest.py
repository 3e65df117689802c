"""Processes shared by integration tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from gateway.backends.local_worker import free_port
from testkit.scripted_upstream import UpstreamState, make_app
from tests.support.processes import stop, wait_ready


@pytest.fixture(scope="session")
def scripted_upstream() -> Iterator[str]:
    """The scripted OpenAI-compatible upstream as its own process; its base URL (`…/v1`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "testkit.scripted_upstream", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(proc, f"http://127.0.0.1:{port}/v1/models")
    yield f"http://127.0.0.1:{port}/v1"
    stop(proc)


@pytest.fixture
async def upstream(aiohttp_server):
    """An in-process scripted upstream: its state (scripts, records) and its base URL."""
    state = UpstreamState()
    server = await aiohttp_server(make_app(state))
    return state, f"http://127.0.0.1:{server.port}/v1"
