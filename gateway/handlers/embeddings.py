"""`POST /v1/embeddings`: OpenAI's Embeddings API, answered by the model's own backend.

An embedding is no run (nothing streams, nothing to resume or cancel but the call): the route
checks the caller as a chat completion is checked (auth by the middleware, the tenant's model
allow-list), reserves the inputs' estimated tokens against the tenant's quotas with the same
admission as a run (rpm, tpm, concurrency, budget; released with the tokens the backend
counted), asks the backend's `embed`, and writes one usage record to the ledger.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from adapters.base import BackendFailed, BackendRejected, BackendUnavailable
from gateway.app_keys import CATALOG, DRAIN, HEALTH, LEDGER, MODEL_LABEL, PRINCIPAL, QUOTAS, TENANT
from gateway.embeddings.render import embeddings_object
from gateway.embeddings.request import EmbeddingsRequest, parse_embeddings_request
from gateway.handlers.chat import read_json
from gateway.http.errors import (
    APIError,
    invalid_request,
    model_not_found,
    overloaded,
    upstream_failed,
)
from gateway.runs.admission import quota_limits, refused
from gateway.state.ledger import UsageRecord
from policies.quotas import Admission, QuotaExceeded, QuotaLimits, QuotaRequest
from policies.quotas import estimate_prompt_tokens as estimate
from policies.tenants import Tenant
from wire.embed_body import Embeddings


async def create_embeddings(request: web.Request) -> web.Response:
    """The inputs' vectors in OpenAI's `list` of `embedding` objects."""
    request.app[DRAIN].refuse_new_runs()  # shutting down: retry on another replica
    asked = parse_embeddings_request(await read_json(request))
    tenant = request[TENANT]
    embed = _embedder(request, tenant, asked.model)
    call_id = f"emb-{uuid.uuid4().hex}"
    admission = await _reserve(request.app, tenant, asked, call_id)
    started, used = time.monotonic(), 0
    try:
        answer = await _embeddings(embed, asked, call_id)
        used = answer.prompt_tokens
    finally:
        if admission is not None:
            await request.app[QUOTAS].release(admission, used)
    record = UsageRecord(
        run_id=call_id,
        tenant=tenant.name,
        principal=request[PRINCIPAL].label,
        model=asked.model,
        status="completed",
        finish_reason=None,
        cancel_source=None,
        prompt_tokens=used,
        generated_tokens=0,
        sent_tokens=0,
        tail_tokens=0,
        ttft_s=None,
        e2e_s=time.monotonic() - started,
        ended_at=time.time(),
    )
    await request.app[LEDGER].append(record)
    body = embeddings_object(answer, asked.model, asked.encoding_format)
    headers = admission.headers if admission is not None else None
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


def _embedder(request: web.Request, tenant: Tenant, model: str) -> Any:
    """The backend's `embed` for `model`, after the tenant's and the backend's checks."""
    adapter = request.app[CATALOG].lookup(model)
    if adapter is None:
        request[MODEL_LABEL] = "unknown"
        raise model_not_found(model)
    request[MODEL_LABEL] = model
    if not tenant.allows_model(model):
        raise APIError(
            403,
            f"Your key has no access to model '{model}'.",
            param="model",
            code="model_not_allowed",
        )
    embed = getattr(adapter, "embed", None)
    if embed is None:  # a model alias, or a backend with no embeddings
        raise invalid_request("model", f"Model '{model}' does not serve embeddings.")
    if not request.app[HEALTH].ready(adapter):
        raise overloaded(f"No backend for model '{model}' is ready; retry shortly.")
    return embed


async def _reserve(
    app: web.Application, tenant: Tenant, asked: EmbeddingsRequest, call_id: str
) -> Admission | None:
    """The call's reservation: its inputs' estimated tokens (None: the tenant has no limits)."""
    limits = quota_limits(tenant.limits)
    if limits == QuotaLimits():
        return None
    tokens = estimate([("user", text) for text in asked.inputs])
    try:
        return await app[QUOTAS].admit(QuotaRequest(tenant.name, call_id, tokens, limits))
    except QuotaExceeded as exc:
        raise refused(app, exc) from None


async def _embeddings(embed: Any, asked: EmbeddingsRequest, call_id: str) -> Embeddings:
    """The backend's answer; its errors as the client's (never the backend's own text)."""
    try:
        return await embed(asked.inputs, asked.dimensions, call_id)
    except BackendRejected as exc:
        raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None
    except BackendUnavailable as exc:
        raise overloaded("The model backend is busy; retry shortly.", exc.retry_after) from None
    except BackendFailed:
        raise upstream_failed() from None
