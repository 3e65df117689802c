"""Every use of redis-py's private names, in one place, and the check at start that they exist.

- `redis.asyncio.Connection._writer`: the connection's `asyncio.StreamWriter`. The gateway's
  connection class (`redis_client._HiredisPackedConnection`) writes commands packed by hiredis
  to it and bounds the drain with `asyncio.timeout` in the caller's task, where redis-py's
  `send_packed_command` spends a task per write on `asyncio.wait_for` (Python 3.11).

pyproject caps redis below the next major version; `check()` runs when the gateway opens its
Redis client with hiredis present (the only case that uses the name).
"""

from __future__ import annotations

import asyncio

import redis
from redis.asyncio.connection import Connection

PRIVATE = ("_writer",)  # on a `redis.asyncio.Connection`, set in its __init__


class UnsupportedRedis(SystemExit):
    """The installed redis-py lacks a name used here. A SystemExit: uncaught, the process prints
    the message and exits 1 before serving."""


def stream_writer(connection: Connection) -> asyncio.StreamWriter:
    """The connection's writer; only called while it is connected (else None)."""
    return connection._writer  # type: ignore[return-value]


def missing(connection: object | None = None) -> list[str]:
    """The private names this redis-py lacks (looked for on a connection that never connects)."""
    probe = Connection() if connection is None else connection
    return [name for name in PRIVATE if not hasattr(probe, name)]


def check() -> None:
    """Fail at start, with the reason, where the installed redis-py would break at run time."""
    absent = missing()
    if absent:
        raise UnsupportedRedis(
            f"sluicegate cannot run on redis-py {redis.__version__}: its asyncio Connection has"
            f" no {', '.join(absent)}. Install the tested range (pip install -e .);"
            " gateway/state/redis_internals.py says what it is used for."
        )
