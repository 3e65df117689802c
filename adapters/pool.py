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
        self._in_flight[slot] += 1
        try:
            async with aclosing(self.members[slot].stream(request, request_id)) as events:
                async for batch in events:
                    yield batch
        finally:
            self._in_flight[slot] -= 1
