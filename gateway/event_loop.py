"""The event loop `sluice serve` runs on (the `event_loop` setting).

uvloop by default: its loop, transports and timers are C, where asyncio's own loop steps every
callback, future and socket read in Python. Relaying 64-chunk streams, the gateway's CPU a run
(its fixed part) was 0.88-0.89x asyncio's and a whole stream 0.92-0.96x (bench/relay_fit.py,
two runs; docs/performance/history.md). Its subprocesses take no `process_group`, so a local
worker's process group is made in the child (gateway/backends/local_worker.py). `asyncio` is
the standard library's loop, for a platform uvloop does not build on or to rule the loop out
when chasing a fault.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.config import ConfigError

EVENT_LOOPS = ("uvloop", "asyncio")


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes the loop `name` (one of EVENT_LOOPS), for `asyncio.Runner`; ConfigError
    when it is uvloop and uvloop is not installed."""
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(
            'event_loop is "uvloop" but uvloop is not installed: install it, or set '
            'event_loop = "asyncio"'
        ) from exc
    return uvloop.new_event_loop
