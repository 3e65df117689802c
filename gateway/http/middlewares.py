"""Request context, error translation and authentication, applied to every route."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from adapters.fallback_route import ROUTE_HEADER
from gateway.anthropic.errors import anthropic_response, is_anthropic
from gateway.app_keys import (
    AUTH,
    METRICS,
    MODEL_LABEL,
    PRINCIPAL,
    QUOTAS,
    RATE_HEADERS,
    REQUEST_ID,
    ROUTE,
    STARTED,
    TENANT,
)
from gateway.http.errors import APIError, internal_error, invalid_api_key, overloaded
from gateway.http.follow_access import token_principal
from gateway.runs.admission import quota_limits
from gateway.state.run_store import StoreUnavailable

log = structlog.get_logger("sluice.gateway")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})


def _http_error(exc: web.HTTPException) -> APIError:
    if exc.status == 413:
        return APIError(413, "The request body is too large.", code="request_too_large")
    if exc.status == 404:
        return APIError(404, f"Unknown path: {exc.reason}.", code="not_found")
    if exc.status == 405:
        return APIError(405, "Method not allowed for this path.", code="method_not_allowed")
    return APIError(exc.status, exc.reason, code=f"http_{exc.status}")


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request an id and start time; turn every failure into an OpenAI error body."""
    request[REQUEST_ID] = "req_" + uuid.uuid4().hex
    request[STARTED] = time.monotonic()
    try:
        response = await handler(request)
    except APIError as exc:
        response = _answer(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _answer(request, _http_error(exc))
    except StoreUnavailable as exc:
        log.warning("state store unavailable", path=request.path, error=str(exc))
        error = overloaded("The gateway's state store is unreachable; retry shortly.")
        response = _answer(request, error)
    except asyncio.CancelledError:
        _count(request, 499)
        raise
    except Exception:
        log.exception("unhandled error", request_id=request[REQUEST_ID], path=request.path)
        response = _answer(request, internal_error())
    _count(request, response.status)
    return response


def _answer(request: web.Request, error: APIError) -> web.Response:
    """The error's answer: Anthropic's shape on its routes (design §4), else OpenAI's."""
    if is_anthropic(request.path):
        return anthropic_response(error)
    return error.to_response()


def _credential(request: web.Request) -> str | None:
    """The bearer credential; on Anthropic's routes its `x-api-key` header serves as one."""
    header = request.headers.get("Authorization")
    if header is None and is_anthropic(request.path):
        key = request.headers.get("x-api-key")
        if key:
            return f"Bearer {key}"
    return header


def _count(request: web.Request, status: int) -> None:
    if request.path in PUBLIC_PATHS:
        return
    principal = request.get(PRINCIPAL)
    request.app[METRICS].requests.labels(
        request.get(MODEL_LABEL, ""), principal.tenant if principal else "", str(status)
    ).inc()


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every `/v1/` route needs a valid bearer credential of a known tenant (Anthropic's routes
    take it as `x-api-key` too); a run's GET routes also take that run's follow token
    (gateway/http/follow_access.py)."""
    if request.path.startswith("/v1/"):
        auth = request.app[AUTH]
        principal = token_principal(request) or auth.authenticate(_credential(request))
        if principal is None:
            raise invalid_api_key()
        try:
            tenant = auth.tenant(principal.tenant)
        except KeyError:  # removed by a reload since the credential was checked
            raise invalid_api_key() from None
        request[PRINCIPAL] = principal
        request[TENANT] = tenant
    return await handler(request)


async def add_route_header(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a request for a model alias says which target served it and why
    the ones before were passed over (`x-sluice-route`, docs/routing.md). NOTE: a stream's
    headers go out with its first events or after one ping interval, so they tell what was
    known then: a target still `trying` may yet be passed over, which only the response's
    `model` then shows."""
    route = request.get(ROUTE)
    if route is not None:
        response.headers[ROUTE_HEADER] = route.header()


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: stamp every response, streams included, with its request id and,
    for a tenant with rpm or tpm, its rate-limit headers (an admitted chat request already
    has them from its admission; other answers read them without consuming anything)."""
    request_id = request.get(REQUEST_ID)
    if request_id:
        response.headers["x-request-id"] = request_id
        if is_anthropic(request.path):  # the name Anthropic's clients read (`_request_id`)
            response.headers["request-id"] = request_id
    rate = request.get(RATE_HEADERS)
    tenant = request.get(TENANT)
    if rate is None and tenant is not None:
        limits = quota_limits(tenant.limits)
        if limits.rpm or limits.tpm:
            with contextlib.suppress(StoreUnavailable):  # the answer goes out without them
                rate = await request.app[QUOTAS].headers(tenant.name, limits)
    if rate:
        for name, value in rate.items():
            response.headers.setdefault(name, value)
