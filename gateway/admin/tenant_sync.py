"""Redis mode: every replica follows the tenants' version in Redis and reloads on a change.

NOTE: polling a version key, not pub/sub. A pub/sub message sent while a replica's
subscription is down (a Redis restart, a network blip) is lost for good, and the replica would
serve stale tenants until the next change; a polled version has no such gap: the first read
after an outage sees the change. A GET every half second per replica costs Redis nothing and
bounds propagation well under the 2 s the admin API promises.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import structlog

from gateway.admin.tenant_doc import BadField
from gateway.admin.tenant_store_redis import RedisTenantStore
from gateway.state.redis_client import REDIS_ERRORS
from gateway.state.run_store import StoreUnavailable
from policies.tenants import TenantsConfig

log = structlog.get_logger("sluice.tenants")
POLL_INTERVAL = 0.5


async def first_load(
    store: RedisTenantStore, path: str | None, apply: Callable[[TenantsConfig], None]
) -> int | None:
    """At start: push the --tenants file to a Redis that holds no tenants yet (from then on the
    file is ignored), then apply Redis's tenants. The version applied; None when Redis is away
    (the file's tenants serve until it is back and `follow_versions` loads them)."""
    text = None
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            text = await asyncio.to_thread(Path(path).read_text, encoding="utf-8")
    try:
        if text is not None:
            pushed = await store.push(text, only_if_empty=True)
            said = "pushed to redis; tenants now live there" if pushed else "ignored: in redis"
            log.info(f"tenants file {said}", path=path)
        version = await store.version()  # NOTE: read before the text: a later edit reloads
        config = await store.config()
    except (StoreUnavailable, *REDIS_ERRORS) as exc:
        log.warning("tenants not loaded from redis yet; serving the file's", error=str(exc))
        return None
    if config is not None:
        apply(config)
    return version


async def follow_versions(
    store: RedisTenantStore,
    apply: Callable[[TenantsConfig], None],
    wake: asyncio.Event,
    last: int | None,
    ignored_file: str | None = None,
    interval: float = POLL_INTERVAL,
) -> None:
    """Reload whenever the version moves from `last` (or `wake` is set: SIGHUP); runs until
    cancelled. A change to `ignored_file` (the --tenants file, pushed once) is logged, never
    applied."""
    file_stamp = _stamp(ignored_file)
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval)
        forced = wake.is_set()
        wake.clear()
        version = await _version(store)
        if version is not None and (version != last or forced):
            last = version
            await _reload(store, apply)
        if ignored_file is not None and (stamp := _stamp(ignored_file)) != file_stamp:
            file_stamp = stamp
            log.warning(
                "tenants file changed but tenants live in Redis: the change is ignored; "
                "`sluice tenants push` stores it there",
                path=ignored_file,
            )


async def _version(store: RedisTenantStore) -> int | None:
    try:
        return await store.version()
    except (StoreUnavailable, *REDIS_ERRORS) as exc:
        log.warning("tenants version unreadable; keeping the current tenants", error=str(exc))
        return None


async def _reload(store: RedisTenantStore, apply: Callable[[TenantsConfig], None]) -> None:
    try:
        config = await store.config()
        if config is not None:
            apply(config)
    except (StoreUnavailable, BadField, ValueError, *REDIS_ERRORS) as exc:
        log.error("tenants reload from redis failed; keeping the current tenants", error=str(exc))
        return
    log.info("tenants reloaded", source=store.doc_key, tenants=len(config.tenants))


def _stamp(path: str | None) -> tuple[int, int, int] | None:
    if path is None or not Path(path).exists():
        return None
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino
