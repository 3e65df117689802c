"""A pool's requests that are answered whole, with no stream to continue (design §6): embeddings
and token counts, routed like a request not yet started and failed over before the answer."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from adapters.base import BackendFailed, BackendRejected, BackendUnavailable, TokenCount
from adapters.pool_members import Member
from adapters.requests import ChatRequest
from adapters.retry_budget import RetryBudget, retry_reason
from wire.embed_body import Embeddings, EmbedInput
from wire.share import DEFAULT_SHARE, Share

log = structlog.get_logger("sluice.pool")


class PoolOneShots:
    """The one-shot half of PoolAdapter (adapters/pool.py), which owns the state it reads."""

    members: list[Member]
    model: str | None
    name: str
    budget: RetryBudget
    clock: Callable[[], float]
    choose: Callable[..., int | None]

    @property
    def serves_embeddings(self) -> bool:
        """Whether some member serves embeddings (`GET /v1/models` says so)."""
        return any(hasattr(m.adapter, "embed") for m in self.members)

    async def embed(
        self,
        inputs: list[EmbedInput],
        dimensions: int | None,
        request_id: str,
        share: Share = DEFAULT_SHARE,
    ) -> Embeddings:
        """The vectors from a usable member that serves embeddings; on a failure before its
        answer, the next one (the retry budget allowing); a refusal is the request's own."""
        tried = {i for i, m in enumerate(self.members) if not hasattr(m.adapter, "embed")}
        if len(tried) == len(self.members):
            raise BackendRejected(
                f"Model '{self.model}' does not serve embeddings.", "model", code="invalid_value"
            )
        self.budget.requested(request_id)
        routing = ChatRequest(self.model or self.name, [])  # no prompt: load alone decides
        last: Exception = BackendUnavailable("No member of the pool can serve this model now.")
        while (index := self.choose(routing, tried)) is not None:
            tried.add(index)
            member = self.members[index]
            lease = member.lease(self.clock())
            try:
                answer = await member.adapter.embed(inputs, dimensions, request_id, share)
                member.answered(lease, self.clock())
                return answer
            except (BackendUnavailable, BackendFailed) as exc:
                member.failed(self.clock(), lease, exc)
                last = exc
                if not self.budget.allow(retry_reason(exc)):
                    break
                log.warning("pool member failed an embedding", member=member.name, retry=True)
            finally:
                member.release(lease)
        raise last

    async def count_tokens(self, request: ChatRequest, request_id: str) -> TokenCount | None:
        """The count of the usable member the request would be routed to, or of the next that
        can count; None when none can (the caller estimates). Not leased: nothing runs."""
        tried = {i for i, m in enumerate(self.members) if not hasattr(m.adapter, "count_tokens")}
        while (index := self.choose(request, tried)) is not None:
            tried.add(index)
            count = await self.members[index].adapter.count_tokens(request, request_id)
            if count is not None:
                return count
        return None
