"""Which backend serves a chat request for its tenant, and what its quota reserves.

The checks a request passes before anything is claimed or reserved (model known, the tenant
allowed it, the max_tokens cap, a parameter the backend cannot honour, a backend ready, or one
restarting that the request may wait for), and the quota reservation itself; refusals are the
APIErrors the client gets.
"""

from __future__ import annotations

from collections.abc import Awaitable

from aiohttp import web

from adapters.base import Adapter
from adapters.fallback import FallbackAdapter
from adapters.requests import ChatRequest
from gateway.app_keys import (
    CATALOG,
    DEFERRED,
    HEALTH,
    METRICS,
    MODEL_LABEL,
    PRICES,
    QUOTAS,
    SETTINGS,
)
from gateway.http.errors import APIError, invalid_request, model_not_found, overloaded
from gateway.runs.aliases import alias_run
from policies.quotas import Admission, QuotaExceeded, QuotaLimits, QuotaRequest, nanos
from policies.quotas import estimate_prompt_tokens as estimate
from policies.tenants import Tenant, TenantLimits
from wire.share import Share

# A request that must not wait in this gateway (for a restarting worker, or in flow control's
# queue) says so: `x-sluice-no-wait: true` is refused at once, 503 `overloaded` with
# `retry-after`, where it would have waited `queued` (design §11).
NO_WAIT_HEADER = "x-sluice-no-wait"


def quota_limits(limits: TenantLimits) -> QuotaLimits:
    return QuotaLimits(
        rpm=limits.rpm,
        tpm=limits.tpm,
        max_concurrent=limits.max_concurrent,
        budget_tokens=limits.budget_tokens,
        budget_period=limits.budget_period,
        budget_cost=limits.budget_cost,
    )


def backend_for(request: web.Request, tenant: Tenant, chat: ChatRequest, body: dict) -> Adapter:
    """The adapter that serves this request, after the tenant's and the backend's checks.
    `body` is the request as sent (to name the field a cap refers to)."""
    app = request.app
    adapter = app[CATALOG].lookup(chat.model)
    if adapter is None:
        request[MODEL_LABEL] = "unknown"
        raise model_not_found(chat.model)
    request[MODEL_LABEL] = chat.model
    if not tenant.allows_model(chat.model):
        app[METRICS].quota_rejections.labels("model").inc()
        raise APIError(
            403,
            f"Your key has no access to model '{chat.model}'.",
            param="model",
            code="model_not_allowed",
        )
    named = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    cap_max_tokens(tenant, chat, named or "max_tokens")
    chat.share = share_for(tenant, chat.service_tier)
    if isinstance(adapter, FallbackAdapter):  # a model alias: each target is checked in turn
        return alias_run(request, tenant, chat, adapter, waits=not no_wait(request))
    param = adapter.unsupported_param(chat)
    if param is not None:
        raise invalid_request(
            param,
            f"'{param}' is not supported by model '{chat.model}'.",
            code="unsupported_parameter",
        )
    waits = not no_wait(request)
    health = app[HEALTH]
    if not health.ready(adapter) and not (waits and health.restarting(adapter)):
        raise overloaded(f"No backend for model '{chat.model}' is ready; retry shortly.")
    return adapter


def no_wait(request: web.Request) -> bool:
    """Whether the request asked not to wait (`x-sluice-no-wait: true`; `false` or absent: it
    may); any other value is a 400 naming the header."""
    raw = request.headers.get(NO_WAIT_HEADER, "").strip().lower()
    if raw not in ("", "true", "false"):
        raise invalid_request(
            NO_WAIT_HEADER, f"{NO_WAIT_HEADER} must be 'true' or 'false'.", code="invalid_value"
        )
    return raw == "true"


def share_for(tenant: Tenant, asked: str | None) -> Share:
    """The tenant's share for a request that asked for `service_tier` `asked` (None or `auto`:
    the tenant's default tier); a tier the tenant may not use is a 400 naming the field."""
    sharing = tenant.sharing
    tier = sharing.default_tier if asked in (None, "auto") else asked
    if tier not in sharing.tiers:
        allowed = ", ".join(f"'{t}'" for t in ("auto", *sharing.tiers))
        raise invalid_request(
            "service_tier",
            f"Your key may not use service_tier '{tier}'; it may use {allowed}.",
            code="service_tier_not_allowed",
        )
    return Share(tenant.digest, sharing.weight, tier)


def cap_max_tokens(tenant: Tenant, chat: ChatRequest, param: str = "max_tokens") -> None:
    """The tenant's cap is the default when the request names none, and a limit when it does;
    `param` is the field the request used (`max_tokens` or `max_completion_tokens`)."""
    cap = tenant.limits.max_tokens
    if cap is None:
        return
    if chat.max_tokens is None:
        chat.max_tokens = cap
    elif chat.max_tokens > cap:
        raise invalid_request(
            param,
            f"{param} is {chat.max_tokens}, above your key's limit of {cap}.",
            code="max_tokens_exceeded",
        )


def prompt_estimate(chat: ChatRequest) -> int:
    if isinstance(chat.prompt, list):  # a legacy completion's token ids: counted exactly
        return len(chat.prompt)
    if chat.prompt is not None:  # a legacy completion's raw text
        return estimate([("user", chat.prompt)])
    return estimate([(m.role, m.content or "") for m in chat.messages])


async def reserve(
    app: web.Application, tenant: Tenant, chat: ChatRequest, run_id: str
) -> tuple[Admission | None, dict[str, str]]:
    """Reserve the run against the tenant's limits: the admission (None: the tenant has none)
    and the rate-limit headers for the answer; a 429 says which limit refused it."""
    request = quota_request(app, tenant, chat, run_id)
    if request is None:
        return None, {}
    try:
        admission = await app[QUOTAS].admit(request)
    except QuotaExceeded as exc:
        raise refused(app, exc) from None
    return admission, admission.headers


def quota_request(
    app: web.Application, tenant: Tenant, chat: ChatRequest, run_id: str
) -> QuotaRequest | None:
    """What the run reserves against its tenant's limits; None when the tenant has none."""
    limits = quota_limits(tenant.limits)
    if limits == QuotaLimits():
        return None
    max_tokens = chat.max_tokens or app[SETTINGS].default_max_tokens
    prompt = prompt_estimate(chat)
    tokens = prompt + max_tokens * chat.n
    # NOTE: a model alias has no price of its own (its target's is known once one serves): it
    # reserves no cost, and its run is charged what it cost when it ends
    price = app[PRICES].get(chat.model) if limits.budget_cost is not None else None
    cost = price.cost_nanos(prompt, max_tokens * chat.n) if price is not None else 0
    return QuotaRequest(tenant.name, run_id, tokens, limits, cost)


def release(
    app: web.Application,
    chat: ChatRequest,
    admission: Admission,
    prompt_tokens: int | None,
    generated_tokens: int,
    model: str,
) -> Awaitable[None]:
    """Give the run's reservation back, charged what it used: its tokens (the prompt's estimate
    where the upstream reported none) and what they cost at the serving model's price, as its
    usage record bills them; deferred while Redis is away."""
    price = app[PRICES].get(model)
    cost = 0 if price is None else nanos(price.cost(prompt_tokens or 0, generated_tokens))
    prompt = prompt_tokens if prompt_tokens is not None else prompt_estimate(chat)
    used = prompt + generated_tokens
    return app[DEFERRED].run("quota release", lambda: app[QUOTAS].release(admission, used, cost))


def refused(app: web.Application, exc: QuotaExceeded) -> APIError:
    """The 429 for a refused admission, counted by the limit that refused it."""
    app[METRICS].quota_rejections.labels(exc.limit).inc()
    kind = "insufficient_quota" if exc.code == "insufficient_quota" else exc.limit
    return APIError(429, exc.message, type=kind, code=exc.code, headers=exc.headers)
