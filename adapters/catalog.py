"""Which adapter serves which model id."""

from __future__ import annotations

from adapters.base import Adapter, ModelInfo


class Catalog:
    """Model id → adapter, built from what each started adapter says it serves."""

    def __init__(self) -> None:
        self._routes: dict[str, tuple[Adapter, ModelInfo]] = {}
        self.adapters: list[Adapter] = []

    async def add(self, adapter: Adapter) -> None:
        self.adapters.append(adapter)
        for info in await adapter.models():
            self._routes.setdefault(info.id, (adapter, info))

    def lookup(self, model: str) -> Adapter | None:
        route = self._routes.get(model)
        return route[0] if route else None

    def models(self) -> list[ModelInfo]:
        return [info for _, info in self._routes.values()]
