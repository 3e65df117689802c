"""What a model's tokens cost: the config file's `[prices."MODEL"]` tables.

A usage record carries `cost`, the run's prompt tokens at `input_per_million` plus its generated
tokens (the tail included: the upstream produced them) at `output_per_million`, in whatever
currency the prices are written in; a model without a price has no cost (None). A tenant's
`budget_cost` is charged the same amounts (policies/quotas.py), counted in integer billionths
(`nanos`) so the Redis scripts add them exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from common.config import ConfigError, check_keys
from policies.quotas import nanos

KEYS = ("input_per_million", "output_per_million")


@dataclass(slots=True, frozen=True)
class Price:
    """A model's price per million tokens, prompt (input) and generated (output)."""

    input_per_million: float = 0.0
    output_per_million: float = 0.0

    def cost(self, prompt_tokens: int, generated_tokens: int) -> float:
        amount = prompt_tokens * self.input_per_million + generated_tokens * self.output_per_million
        return round(amount / 1_000_000, 12)  # NOTE: no float noise in the usage record

    def cost_nanos(self, prompt_tokens: int, generated_tokens: int) -> int:
        """The same cost in billionths, rounded up: a budget is never charged less."""
        return nanos(self.cost(prompt_tokens, generated_tokens))


def parse_prices(table: Mapping[str, Any]) -> dict[str, Price]:
    """The `[prices."MODEL"]` tables; a ConfigError names the model and key it cannot use."""
    prices = {}
    for model, row in table.items():
        where = f'[prices."{model}"]'
        if not isinstance(row, dict):
            raise ConfigError(f"{where} must be a table with {' and/or '.join(KEYS)}")
        try:
            check_keys(row, KEYS, where)
        except ConfigError as e:
            raise ConfigError(f"{e}; a price takes {' and '.join(KEYS)}") from None
        if not row:
            raise ConfigError(f"{where} sets no price; give {' and/or '.join(KEYS)}")
        for key, value in row.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{where} {key} must be a number, not {value!r}")
            if value < 0 or not math.isfinite(value):
                raise ConfigError(f"{where} {key} must be a finite number >= 0, not {value!r}")
        prices[model] = Price(**{key: float(value) for key, value in row.items()})
    return prices


def cost_of(
    prices: Mapping[str, Price], model: str, prompt_tokens: int, generated_tokens: int
) -> float | None:
    """What a run of `model` cost; None when the model has no price."""
    price = prices.get(model)
    return None if price is None else price.cost(prompt_tokens, generated_tokens)


def unserved(prices: Mapping[str, Price], served: Iterable[str]) -> list[str]:
    """Priced models no backend serves: a price for a model served later (another replica's
    backend, a worker added) is no error, so these are a warning at start."""
    served = set(served)
    return sorted(model for model in prices if model not in served)
