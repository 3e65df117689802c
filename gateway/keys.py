"""Every `web.AppKey` of the gateway app, in one place."""

from __future__ import annotations

import weakref

from aiohttp import web

from adapters.catalog import Catalog
from gateway.metrics import GatewayMetrics
from gateway.runs.manager import RunManager
from gateway.settings import Settings
from policies.auth import KeyAuthenticator, Principal

SETTINGS = web.AppKey("settings", Settings)
CATALOG = web.AppKey("catalog", Catalog)
METRICS = web.AppKey("metrics", GatewayMetrics)
AUTH = web.AppKey("auth", KeyAuthenticator)
OPEN_STREAMS = web.AppKey("open_streams", weakref.WeakSet)
RUNS = web.AppKey("runs", RunManager)

# Per-request values, set by the middlewares and the chat handler.
REQUEST_ID = web.RequestKey("request_id", str)
STARTED = web.RequestKey("started", float)
PRINCIPAL = web.RequestKey("principal", Principal)
MODEL_LABEL = web.RequestKey("model_label", str)
