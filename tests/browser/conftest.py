"""A real `sluice serve` on the tiny model for the browser tests, reached through a TCP proxy
that can cut a stream mid-way (tests/support/tcp_proxy.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.serve import Served, serving
from tests.support.tcp_proxy import TcpProxy

BROWSER_KEY = "sk-sluice-browser"
DISCONNECT_GRACE = 5.0  # seconds: a cut stream's run waits this long for its resume


@pytest.fixture(scope="session")
def served(tiny_model_dir) -> Iterator[Served]:
    flags = ("--disconnect-grace", str(DISCONNECT_GRACE))
    with serving(tiny_model_dir, *flags, key=BROWSER_KEY) as gateway:
        yield gateway


@pytest.fixture
def proxy(served) -> Iterator[TcpProxy]:
    proxy = TcpProxy(served.port)
    yield proxy
    proxy.close()
