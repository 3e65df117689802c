"""Which adapter serves which model id."""

from __future__ import annotations

import time
from dataclasses import replace

from adapters.base import Adapter, ModelInfo


class Catalog:
    """Model id → adapter, built from what each started adapter says it serves."""

    def __init__(self) -> None:
        self._routes: dict[str, tuple[Adapter, ModelInfo]] = {}
        self.adapters: list[Adapter] = []

    async def add(self, adapter: Adapter) -> None:
        """Route the adapter's models; a model whose backend does not say when it was made
        available counts from now."""
        self.adapters.append(adapter)
        now = int(time.time())
        for info in await adapter.models():
            if info.created is None:
                info = replace(info, created=now)
            self._routes.setdefault(info.id, (adapter, info))

    async def add_alias(self, alias: Adapter) -> None:
        """Route a model alias (adapters/fallback.py) like a model of its own; it is no backend
        (`adapters` lists the backends: its targets are, and are probed as such)."""
        for info in await alias.models():
            self._routes[info.id] = (alias, replace(info, created=int(time.time())))

    def lookup(self, model: str) -> Adapter | None:
        route = self._routes.get(model)
        return route[0] if route else None

    def models(self) -> list[ModelInfo]:
        return [info for _, info in self._routes.values()]

    def served(self) -> list[tuple[Adapter, ModelInfo]]:
        """Each model with the adapter that serves it, in the order they were added."""
        return list(self._routes.values())
