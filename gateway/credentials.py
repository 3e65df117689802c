"""Who may call: the tenants file (or the `--api-key` shortcut) behind the authenticator, and
its reloads on SIGHUP or when the file changes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

import structlog
from aiohttp import web

from gateway.app_keys import AUTH, METRICS, SETTINGS
from gateway.settings import Settings
from gateway.tasks import stop_tasks
from policies.auth import Authenticator
from policies.tenants import TenantsConfig, load_tenants, single_tenant
from policies.tenants_watch import reload_now, watch_tenants

log = structlog.get_logger("sluice.tenants")
DEFAULT_TENANT = "default"


def with_api_keys(config: TenantsConfig, api_keys: list[str]) -> TenantsConfig:
    """`--api-key` keys join tenant `default` (created without limits when the file has none)."""
    if not api_keys:
        return config
    extra = single_tenant(api_keys, DEFAULT_TENANT).tenants[DEFAULT_TENANT]
    tenants = dict(config.tenants)
    base = tenants.get(DEFAULT_TENANT)
    tenants[DEFAULT_TENANT] = replace(base, keys=base.keys + extra.keys) if base else extra
    return replace(config, tenants=tenants)


def tenants_config(settings: Settings) -> TenantsConfig:
    config = load_tenants(settings.tenants) if settings.tenants else TenantsConfig(tenants={})
    return with_api_keys(config, settings.api_key)


def build_authenticator(settings: Settings) -> Authenticator:
    auth = Authenticator(tenants_config(settings))
    # NOTE: an admin key, or tenants kept in Redis, can bring the first tenant keys later
    later = settings.admin_key or settings.tenants_store == "redis"
    if not len(auth) and not later:
        raise ValueError(
            "no credentials configured: pass --api-key or --tenants (the CLI generates a key)"
        )
    return auth


def apply_tenants(app: web.Application, config: TenantsConfig) -> None:
    """Swap a new tenants config in (the `--api-key` keys added); raises, keeping the old one,
    when its JWT keys cannot load."""
    app[AUTH].reload(with_api_keys(config, app[SETTINGS].api_key))
    app[METRICS].know_tenants(app[AUTH].config.tenants.values())


async def watch_tenants_file(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: reload the tenants file when it changes or on SIGHUP (with
    `--tenants-store redis` tenants follow Redis instead: gateway/admin/tenant_sync.py)."""
    settings = app[SETTINGS]
    if not settings.tenants or settings.tenants_store == "redis":
        yield
        return
    path = settings.tenants
    apply = functools.partial(apply_tenants, app)  # reload_now logs the outcome

    task = asyncio.create_task(watch_tenants(path, apply), name="tenants watch")
    try:
        with on_sighup(functools.partial(reload_now, path, apply)):
            yield
    finally:
        await stop_tasks([task])


@contextlib.contextmanager
def on_sighup(callback: Callable[[], object]) -> Iterator[None]:
    """Call `callback` on SIGHUP while in the block. NOTE: no SIGHUP where the loop cannot take
    signal handlers (not Unix, or not the main thread, as when embedded): what the handler
    would hurry (a file watcher, a Redis poll) still picks changes up, so it is only logged."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, callback)
    except (NotImplementedError, RuntimeError, ValueError):
        log.info("no SIGHUP handler here; changes are still picked up by polling")
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
