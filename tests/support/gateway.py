"""Helpers that build gateways for tests from the real app factory."""

from __future__ import annotations

from dataclasses import replace

import orjson
from openai._streaming import SSEDecoder

from gateway.app import create_app
from gateway.app_keys import AUTH as AUTH_KEY
from gateway.settings import Settings
from policies.tenants import single_tenant

API_KEY = "sk-sluice-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def gateway_app(adapters=None, **settings):
    settings.setdefault("api_key", [API_KEY])
    return create_app(Settings(**settings), adapters=adapters)


def add_tenant(app, name: str, key: str) -> None:
    """Give the app one more tenant (no limits) whose key is `key`."""
    auth = app[AUTH_KEY]
    config = auth.config
    extra = single_tenant([key], name).tenants[name]
    auth.reload(replace(config, tenants={**config.tenants, name: extra}))


def chat_body(model: str = "scripted", **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(extra)
    return body


def sse_events(raw: bytes) -> list:
    """Decode a raw SSE body with the openai SDK's decoder."""
    return list(SSEDecoder().iter_bytes(iter([raw])))


def stream_payloads(raw: bytes) -> list[dict | str]:
    """The JSON payload of each event, and the final "[DONE]" as a string."""
    return [e.data if e.data == "[DONE]" else orjson.loads(e.data) for e in sse_events(raw)]


def stream_text(payloads: list, index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or ""
        for p in payloads
        if isinstance(p, dict) and "choices" in p
        for c in p["choices"]
        if c["index"] == index
    )
