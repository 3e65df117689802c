"""Admitting a chat request for its tenant: model access, the max_tokens cap and the quota, and
settling what the run used once it is over (quota refund, one usage record)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from adapters.requests import ChatRequest
from gateway import replays
from gateway.app_keys import DEFERRED, LEDGER, METRICS, QUOTAS, RATE_HEADERS, SETTINGS
from gateway.errors import APIError, invalid_request
from gateway.ledger import UsageRecord
from gateway.runs.driver import RunDriver
from gateway.runs.status import PUBLIC_STATUS, RunStatus
from policies.auth import Principal
from policies.quotas import Admission, QuotaExceeded, QuotaLimits, QuotaRequest
from policies.quotas import estimate_prompt_tokens as estimate
from policies.tenants import Tenant, TenantLimits


def quota_limits(limits: TenantLimits) -> QuotaLimits:
    return QuotaLimits(
        rpm=limits.rpm,
        tpm=limits.tpm,
        max_concurrent=limits.max_concurrent,
        budget_tokens=limits.budget_tokens,
        budget_period=limits.budget_period,
    )


def check_model(request: web.Request, tenant: Tenant, model: str) -> None:
    if not tenant.allows_model(model):
        request.app[METRICS].quota_rejections.labels("model").inc()
        raise APIError(
            403,
            f"Your key has no access to model '{model}'.",
            param="model",
            code="model_not_allowed",
        )


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
    return estimate([(m.role, m.content or "") for m in chat.messages])


async def admit(
    request: web.Request, tenant: Tenant, chat: ChatRequest, run_id: str
) -> Admission | None:
    """Reserve the run against the tenant's limits (None: the tenant has none); a 429 says
    which limit refused it."""
    limits = quota_limits(tenant.limits)
    if limits == QuotaLimits():
        return None
    max_tokens = chat.max_tokens or request.app[SETTINGS].default_max_tokens
    tokens = prompt_estimate(chat) + max_tokens * chat.n
    try:
        admission = await request.app[QUOTAS].admit(
            QuotaRequest(tenant.name, run_id, tokens, limits)
        )
    except QuotaExceeded as exc:
        request.app[METRICS].quota_rejections.labels(exc.limit).inc()
        request[RATE_HEADERS] = {}  # the 429 carries its own
        kind = "insufficient_quota" if exc.code == "insufficient_quota" else exc.limit
        raise APIError(429, exc.message, type=kind, code=exc.code, headers=exc.headers) from None
    request[RATE_HEADERS] = admission.headers
    return admission


def settlement(
    app: web.Application,
    principal: Principal,
    admission: Admission | None,
    prompt_guess: int,
    idempotency_key: str | None = None,
) -> Callable[[RunDriver], Awaitable[None]]:
    """What runs once the run is over: refund the unused reservation, write its usage record,
    keep its ending with its Idempotency-Key."""

    async def settle(driver: RunDriver) -> None:
        # NOTE: the quota refund and the key's ending outlast a Redis outage (retried when it
        # is back); the usage record falls back to this host's file (gateway/ledger.py).
        deferred = app[DEFERRED]
        terminal = driver.terminal
        if idempotency_key is not None and terminal is not None:
            await deferred.run(
                "idempotency ending",
                lambda: replays.remember(
                    app, driver.tenant, idempotency_key, driver.run_id, terminal
                ),
            )
        acct = driver.acct
        prompt = acct.usage.prompt_tokens if acct.usage else prompt_guess
        if admission is not None:
            used = prompt + acct.generated_tokens
            await deferred.run("quota release", lambda: app[QUOTAS].release(admission, used))
        status = terminal.status if terminal else RunStatus.FAILED
        await app[LEDGER].append(
            UsageRecord(
                run_id=driver.run_id,
                tenant=driver.tenant,
                principal=principal_label(principal),
                model=driver.chat.model,
                status=PUBLIC_STATUS[status],
                finish_reason=terminal.finish_reason if terminal else None,
                cancel_source=driver.cancel_source,
                prompt_tokens=prompt if acct.usage else 0,
                generated_tokens=acct.generated_tokens,
                sent_tokens=acct.sent_tokens,
                tail_tokens=acct.tail_tokens,
                ttft_s=acct.ttft_s,
                e2e_s=acct.e2e_s,
                ended_at=time.time(),
            )
        )

    return settle


def principal_label(principal: Principal) -> str:
    """A key id (`key_…`) or a JWT subject (`jwt:<sub>`): who to bill inside the tenant."""
    if principal.key_id == "jwt":
        return f"jwt:{principal.subject or '?'}"
    return principal.key_id
