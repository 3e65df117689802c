"""How `POST /v1/messages/count_tokens` counts: by the backend that would serve the request, else
by the gateway's estimate, and which of the two answered.

Our workers count with the model's own tokenizer and chat template, rendering the prompt exactly
as a generation of the same request does (tools included), so the count equals the
`input_tokens` a create reports. An OpenAI-compatible upstream counts with its own `/tokenize`
where it has one (vLLM's). Anything else, or a backend that cannot answer now, gets the
gateway's estimate (policies/quotas.py: what quotas reserve, high by design).
"""

from __future__ import annotations

import uuid

from adapters.base import Adapter, BackendRejected, TokenCount
from adapters.requests import ChatRequest
from gateway.http.errors import APIError
from gateway.runs.admission import prompt_estimate

# the answer's header that says who counted: `worker`, `upstream` or `estimate`
COUNT_SOURCE_HEADER = "x-sluice-token-count"


async def count_prompt(adapter: Adapter, chat: ChatRequest, ready: bool) -> TokenCount:
    """The prompt's tokens: the backend's count where it gives one (`ready`: its health check
    passes; one that is not ready is not asked), else the estimate. A refusal (a 400 from our
    worker: a bad tool schema, say) is the client's error."""
    count = getattr(adapter, "count_tokens", None)
    if ready and count is not None:
        try:
            counted = await count(chat, f"count_{uuid.uuid4().hex}")
        except BackendRejected as exc:
            raise APIError(exc.status, exc.message, param=exc.param, code=exc.code) from None
        if counted is not None:
            return counted
    return TokenCount(prompt_estimate(chat), "estimate")
