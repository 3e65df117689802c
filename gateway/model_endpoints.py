"""Which routes serve a model: the `endpoints` of `GET /v1/models` (a sluicegate extension).

- Every backend generates text, and the gateway serves each of its generation APIs over the
  same runs: `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`.
- `/v1/embeddings` only where the backend has an `embed`: our own workers (a pool: some member
  does); an OpenAI-compatible upstream has one too, since the gateway forwards to its own
  `/embeddings`: whether the model there computes them is the upstream's to answer (its 400 is
  relayed naming the field).
- A model alias: the union of its targets' (a call is passed to the targets that serve it, the
  others are passed over as `unsupported`).
"""

from __future__ import annotations

from typing import Any

from adapters.fallback import FallbackAdapter

GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (*GENERATION, EMBEDDINGS)


def serves_embeddings(adapter: Any) -> bool:
    if isinstance(adapter, FallbackAdapter):
        return any(serves_embeddings(a) for a in adapter.target_adapters)
    return getattr(adapter, "serves_embeddings", hasattr(adapter, "embed"))


def endpoints_of(adapter: Any) -> list[str]:
    """The routes that serve the model `adapter` serves, in `ENDPOINTS`' order."""
    return [*GENERATION, EMBEDDINGS] if serves_embeddings(adapter) else list(GENERATION)
