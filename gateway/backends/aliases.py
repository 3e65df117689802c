"""The config file's model aliases as adapters (design §6), checked against what the backends
serve once they are up: every target must be a model some backend serves, and an alias may not
take the name of one (a request for that name would be ambiguous, and a tenant allowed the
model would get the alias). Either is a ConfigError naming it, so `sluice serve` does not start.
"""

from __future__ import annotations

from adapters.catalog import Catalog
from adapters.fallback import FallbackAdapter, Outcome
from adapters.fallback_route import Alias
from adapters.retry_budget import RetryBudget
from common.config import ConfigError


def alias_adapters(
    aliases: list[Alias],
    catalog: Catalog,
    *,
    budget: RetryBudget | None = None,
    on_outcome: Outcome | None = None,
) -> list[FallbackAdapter]:
    """An adapter per alias over the catalog's backends (before any alias is added to it)."""
    served = sorted(info.id for info in catalog.models())
    adapters = []
    for alias in aliases:
        where = f'[models."{alias.name}"]'
        if alias.name in served:
            raise ConfigError(
                f"{where}: a backend serves a model of that name; give the alias another name"
            )
        targets = {}
        for model in alias.models:
            adapter = catalog.lookup(model)
            if adapter is None:
                raise ConfigError(
                    f"{where}: target {model!r} is not a model any backend serves "
                    f"(served: {', '.join(served) or 'none'})"
                )
            targets[model] = adapter
        adapters.append(FallbackAdapter(alias, targets, budget=budget, on_outcome=on_outcome))
    return adapters
