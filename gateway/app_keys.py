"""Every `web.AppKey` of the gateway app, in one place."""

from __future__ import annotations

import weakref

from aiohttp import web

from adapters.catalog import Catalog
from adapters.fallback_route import Route
from adapters.retry_budget import RetryBudget
from gateway.admin.service import Admin
from gateway.backends.health import BackendHealth
from gateway.http.drain import Drain
from gateway.http.follow_tokens import FollowTokens
from gateway.metrics import GatewayMetrics
from gateway.runs.flow_control import Flows
from gateway.runs.manager import RunManager
from gateway.settings import Settings
from gateway.state.ledger import UsageLedger
from gateway.state.redis_client import SharedRedis
from gateway.state.redis_open import RedisOpener
from gateway.state.store_health import DeferredWrites
from gateway.tracing import RunTracer
from policies.auth import Authenticator, Principal
from policies.idempotency import IdempotencyStore
from policies.quotas import QuotaStore
from policies.tenants import Tenant

SETTINGS = web.AppKey("settings", Settings)
CATALOG = web.AppKey("catalog", Catalog)
HEALTH = web.AppKey("health", BackendHealth)
METRICS = web.AppKey("metrics", GatewayMetrics)
AUTH = web.AppKey("auth", Authenticator)
OPEN_STREAMS = web.AppKey("open_streams", weakref.WeakSet)
RUNS = web.AppKey("runs", RunManager)
QUOTAS = web.AppKey("quotas", QuotaStore)
IDEMPOTENCY = web.AppKey("idempotency", IdempotencyStore)
LEDGER = web.AppKey("ledger", UsageLedger)
REDIS = web.AppKey("redis", SharedRedis)  # only with --redis-url
OPENER = web.AppKey("opener", RedisOpener)  # only with --redis-url
DEFERRED = web.AppKey("deferred", DeferredWrites)
DRAIN = web.AppKey("drain", Drain)  # graceful shutdown: handlers read `draining`
FOLLOW_TOKENS = web.AppKey("follow_tokens", FollowTokens)
FLOWS = web.AppKey("flows", Flows)  # each backend's flow control (design §12)
RETRY_BUDGET = web.AppKey("retry_budget", RetryBudget)  # the one shared by every pool (§6)
TRACER = web.AppKey("tracer", RunTracer)  # only with --otlp-endpoint (gateway/tracing/)
ADMIN = web.AppKey("admin", Admin)  # the admin API (gateway/admin/)
PRICES = web.AppKey("prices", dict)  # model → gateway.prices.Price, the config's [prices]

# Per-request values, set by the middlewares and the chat handler.
REQUEST_ID = web.RequestKey("request_id", str)
STARTED = web.RequestKey("started", float)
PRINCIPAL = web.RequestKey("principal", Principal)
TENANT = web.RequestKey("tenant", Tenant)
MODEL_LABEL = web.RequestKey("model_label", str)
RATE_HEADERS = web.RequestKey("rate_headers", dict)  # x-ratelimit-* for this response
FOLLOW_TOKEN = web.RequestKey("follow_token", str)  # the ?token= that authenticated it
ROUTE = web.RequestKey("route", Route)  # a model alias's route (its x-sluice-route header)
