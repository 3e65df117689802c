"""Which event loop an async test runs on (tests/conftest.py's `pytest_asyncio_loop_factories`):
uvloop, the one `sluice serve` runs on by default; a module that sets `EVENT_LOOP` runs on that
one; a test marked ON_EITHER_LOOP on both."""

from __future__ import annotations

import pytest

# a test whose outcome hangs on the loop's transports or timers (how a write buffer is
# reported, how early a timer fires) runs on both loops `sluice serve` can run on
ON_EITHER_LOOP = pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
# a worker's tests' `EVENT_LOOP`: `sluice worker` runs on asyncio's loop (workers/cli.py)
WORKERS_LOOP = "asyncio"
