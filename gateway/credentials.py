"""Who may call: the tenants file (or the `--api-key` shortcut) behind the authenticator, and
its reloads on SIGHUP or when the file changes."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
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
    if not len(auth):
        raise ValueError(
            "no credentials configured: pass --api-key or --tenants (the CLI generates a key)"
        )
    return auth


async def watch_tenants_file(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: reload the tenants file when it changes or on SIGHUP."""
    settings = app[SETTINGS]
    if not settings.tenants:
        yield
        return
    path = settings.tenants

    def apply(config: TenantsConfig) -> None:  # reload_now logs the outcome
        app[AUTH].reload(with_api_keys(config, settings.api_key))
        app[METRICS].know_tenants(app[AUTH].config.tenants.values())

    loop = asyncio.get_running_loop()
    task = asyncio.create_task(watch_tenants(path, apply), name="tenants watch")
    try:
        loop.add_signal_handler(signal.SIGHUP, reload_now, path, apply)
        on_hup = True
    except (NotImplementedError, RuntimeError, ValueError):
        # NOTE: no SIGHUP where the loop cannot take signal handlers (not Unix, or not the main
        # thread, as when embedded); the file watcher still picks changes up.
        log.info("no SIGHUP reload here; the tenants file is watched for changes", path=path)
        on_hup = False
    try:
        yield
    finally:
        await stop_tasks([task])
        if on_hup:
            loop.remove_signal_handler(signal.SIGHUP)
