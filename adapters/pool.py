"""Several adapters serving one model: each request goes to the member with the fewest of this
gateway's requests in flight. (Health checks, prefix affinity and retry-before-first-token come
with the worker-pool milestone.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from adapters.base import Adapter, ModelInfo
from adapters.events import Event
from adapters.requests import ChatRequest


class PoolAdapter:
    def __init__(self, members: list[Adapter], name: str = "pool") -> None:
        if not members:
            raise ValueError("a pool needs at least one member")
        self.name = name
        self.members = members
        self._in_flight = [0] * len(members)
        self._serving: dict[str, Adapter] = {}  # live request id → the member streaming it

    async def start(self) -> None:
        for member in self.members:
            await member.start()

    async def close(self) -> None:
        for member in self.members:
            await member.close()

    async def models(self) -> list[ModelInfo]:
        return await self.members[0].models()

    async def ready(self) -> bool:
        for member in self.members:
            if await member.ready():
                return True
        return False

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return self.members[0].unsupported_param(request)

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        slot = min(range(len(self.members)), key=self._in_flight.__getitem__)
        member = self.members[slot]
        self._in_flight[slot] += 1
        self._serving[request_id] = member
        try:
            async with aclosing(member.stream(request, request_id)) as events:
                async for batch in events:
                    yield batch
        finally:
            self._in_flight[slot] -= 1
            if self._serving.get(request_id) is member:
                del self._serving[request_id]

    async def abort(self, request_id: str) -> bool:
        """Routed to the member streaming `request_id`; an id no member streams is False."""
        member = self._serving.get(request_id)
        return False if member is None else await member.abort(request_id)
