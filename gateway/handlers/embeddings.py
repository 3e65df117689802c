"""`POST /v1/embeddings`: OpenAI's Embeddings API, answered by the model's own backend, or by
a model alias's targets in turn (gateway/embeddings/routing.py).

An embedding is no run (nothing streams, nothing to resume or cancel but the call): the route
checks the caller as a chat completion is checked (auth by the middleware, the tenant's model
allow-list), reserves the inputs' estimated tokens against the tenant's quotas with the same
admission as a run (rpm, tpm, concurrency, budget; released with the tokens the backend
counted), asks the backend's `embed`, and writes one usage record to the ledger however the
call ends once it was admitted: `completed` with its input tokens, `failed` (a backend's
refusal or failure) or `cancelled` (`disconnect`: the client went away) with 0 tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
from aiohttp import web

from adapters.base import BackendFailed, BackendRejected, BackendUnavailable
from gateway.app_keys import DRAIN, LEDGER, METRICS, PRICES, PRINCIPAL, QUOTAS, TENANT
from gateway.embeddings.render import embeddings_object
from gateway.embeddings.request import EmbeddingsRequest, parse_embeddings_request
from gateway.embeddings.routing import EmbedPlan, embed_plan
from gateway.handlers.chat import read_json
from gateway.http.errors import APIError, overloaded, upstream_failed
from gateway.prices import cost_of
from gateway.runs.admission import quota_limits, refused
from gateway.state.ledger import UsageRecord
from policies.quotas import Admission, QuotaExceeded, QuotaLimits, QuotaRequest, nanos
from policies.quotas import estimate_prompt_tokens as estimate
from policies.tenants import Tenant
from wire.embed_body import Embeddings


async def create_embeddings(request: web.Request) -> web.Response:
    """The inputs' vectors in OpenAI's `list` of `embedding` objects."""
    request.app[DRAIN].refuse_new_runs()  # shutting down: retry on another replica
    asked = parse_embeddings_request(await read_json(request))
    tenant = request[TENANT]
    plan = embed_plan(request, tenant, asked.model, asked.inputs[0])
    call_id = f"emb-{uuid.uuid4().hex}"
    admission = await _reserve(request.app, tenant, asked, call_id)
    ledger = _Ledger(request, call_id, asked.model)
    used, model = 0, asked.model
    try:
        model, answer = await _embeddings(plan, asked, call_id)
        used = answer.prompt_tokens
    except asyncio.CancelledError:
        await asyncio.shield(ledger.write("cancelled", 0, "disconnect"))
        raise
    except APIError:
        await asyncio.shield(ledger.write("failed", 0))
        raise
    finally:
        if admission is not None:
            cost = nanos(cost_of(request.app[PRICES], model, used, 0) or 0)
            await asyncio.shield(request.app[QUOTAS].release(admission, used, cost))
    ledger.model = model
    await ledger.write("completed", used)
    body = embeddings_object(answer, model, asked.encoding_format)
    headers = admission.headers if admission is not None else None
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


class _Ledger:
    """The call's one usage record, as a run's is written (0 generated tokens)."""

    def __init__(self, request: web.Request, call_id: str, model: str) -> None:
        self.request, self.call_id, self.model = request, call_id, model
        self.started = time.monotonic()

    async def write(self, status: str, tokens: int, cancel_source: str | None = None) -> None:
        app, tenant = self.request.app, self.request[TENANT].name
        cost = cost_of(app[PRICES], self.model, tokens, 0)
        if cost:
            app[METRICS].tenant_cost.labels(tenant).inc(cost)
        record = UsageRecord(
            run_id=self.call_id,
            tenant=tenant,
            principal=self.request[PRINCIPAL].label,
            model=self.model,
            status=status,
            finish_reason=None,
            cancel_source=cancel_source,
            prompt_tokens=tokens,
            generated_tokens=0,
            sent_tokens=0,
            tail_tokens=0,
            ttft_s=None,
            e2e_s=time.monotonic() - self.started,
            ended_at=time.time(),
            cost=cost,
        )
        await app[LEDGER].append(record)


async def _reserve(
    app: web.Application, tenant: Tenant, asked: EmbeddingsRequest, call_id: str
) -> Admission | None:
    """The call's reservation: its inputs' estimated tokens (None: the tenant has no limits)."""
    limits = quota_limits(tenant.limits)
    if limits == QuotaLimits():
        return None
    texts = [("user", text) for text in asked.inputs if isinstance(text, str)]
    ids = sum(len(i) for i in asked.inputs if not isinstance(i, str))  # counted, not estimated
    tokens = (estimate(texts) if texts else 0) + ids
    try:
        return await app[QUOTAS].admit(QuotaRequest(tenant.name, call_id, tokens, limits))
    except QuotaExceeded as exc:
        raise refused(app, exc) from None


async def _embeddings(
    plan: EmbedPlan, asked: EmbeddingsRequest, call_id: str
) -> tuple[str, Embeddings]:
    """The model that served and its answer; its errors as the client's (never the backend's
    own text)."""
    try:
        return await plan.embed(asked.inputs, asked.dimensions, call_id)
    except BackendRejected as exc:
        raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None
    except BackendUnavailable as exc:
        raise overloaded("The model backend is busy; retry shortly.", exc.retry_after) from None
    except BackendFailed:
        raise upstream_failed() from None
