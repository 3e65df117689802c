"""Every `web.AppKey` of the worker app, in one place (typed state, no globals)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry

from workers.config import WorkerConfig
from workers.metrics import WorkerMetrics
from workers.service import WorkerService

CONFIG = web.AppKey("config", WorkerConfig)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", WorkerMetrics)
SERVICE = web.AppKey("service", WorkerService)
TRACER = web.AppKey("tracer", object)  # only with --otlp-endpoint: workers/tracing.py
