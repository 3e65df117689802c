"""Which event loop an async test runs on (tests/conftest.py's `pytest_asyncio_loop_factories`):
uvloop, the one `sluice serve` runs on by default, unless a test asks for more."""

from __future__ import annotations

import pytest

# a test whose outcome hangs on the loop's transports or timers (how a write buffer is
# reported, how early a timer fires) runs on both loops `sluice serve` can run on
ON_EITHER_LOOP = pytest.mark.asyncio(loop_factories=["uvloop", "asyncio"])
