"""Reload the tenants file while serving: on a change seen by polling, or on SIGHUP.

Polling (not inotify) because it works the same on every platform and on mounted config maps,
and a stat every couple of seconds costs nothing. A file that fails to load never replaces the
running config: an operator's typo must not lock every tenant out.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import structlog

from policies.tenants import TenantsConfig, TenantsFileError, load_tenants

log = structlog.get_logger("sluice.tenants")

OnChange = Callable[[TenantsConfig], None]


def reload_now(path: str | Path, on_change: OnChange) -> bool:
    """Load the file and hand it to `on_change`; on any problem log it and keep the old config."""
    try:
        config = load_tenants(path)
        on_change(config)  # may refuse too, e.g. when the JWT secret's env var is unset
    except (TenantsFileError, OSError) as exc:
        # NOTE: TenantsFileError messages never carry a key, a hash's value or a secret.
        log.error(
            "tenants reload failed; keeping the previous config", path=str(path), error=str(exc)
        )
        return False
    keys = sum(len(t.keys) for t in config.tenants.values())
    log.info(
        "tenants reloaded",
        path=str(path),
        tenants=len(config.tenants),
        keys=keys,
        shared_system_prompts=len(config.shared_system_prompts),
    )
    return True


async def watch_tenants(path: str | Path, on_change: OnChange, interval: float = 2.0) -> None:
    """Poll the file's identity (mtime, size, inode) and reload whenever it changes; runs until
    cancelled. The caller loads the file once before starting this."""
    last = _stamp(path)
    while True:
        await asyncio.sleep(interval)
        stamp = _stamp(path)
        if stamp == last:
            continue
        last = stamp
        if stamp is None:
            log.warning("tenants file is missing; keeping the previous config", path=str(path))
            continue
        reload_now(path, on_change)


def _stamp(path: str | Path) -> tuple[int, int, int] | None:
    # NOTE: the inode catches an atomic replace (what `sluice keys` and editors do) even when the
    # new file has the same size and lands within the filesystem's mtime granularity.
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino
