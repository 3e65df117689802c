"""A tenant's place when the pool is saturated (design §12): its weight, the service tiers it may
use, and how many runs it may have waiting for capacity.

`weight` is the tenant's share of a saturated pool relative to the other tenants' weights (a
tenant with 3 gets three times the tokens of one with 1 while both have work; an idle tenant's
share goes to the busy ones). `tiers` are the OpenAI `service_tier` values its requests may ask
for; `default_tier` is what `auto` (or no `service_tier`) means for it. `max_queued` bounds its
runs waiting in a gateway's queue; past it, its `flex` runs are shed first (design §12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.tenants_fields import Section
from wire.share import MAX_WEIGHT, TIERS

SHARING_FIELDS = ("weight", "tiers", "default_tier", "max_queued")
DEFAULT_MAX_QUEUED = 256
DEFAULT_TIERS = ("default", "flex")


@dataclass(slots=True, frozen=True)
class Sharing:
    weight: float = 1.0
    tiers: tuple[str, ...] = DEFAULT_TIERS
    default_tier: str = "default"
    max_queued: int = DEFAULT_MAX_QUEUED


def parse_sharing(table: dict[str, Any], where: Section) -> Sharing:
    """The sharing fields of one tenant's table; failures name the field."""
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        where.fail("weight", f"expected a positive number, got {weight!r}")
    if not 1 / MAX_WEIGHT <= weight <= MAX_WEIGHT:
        where.fail("weight", f"must be between {1 / MAX_WEIGHT} and {MAX_WEIGHT}, got {weight!r}")
    tiers = where.strings(table, "tiers") or DEFAULT_TIERS
    for tier in tiers:
        if tier not in TIERS:
            where.fail("tiers", f"{tier!r} is not a service tier (known: {', '.join(TIERS)})")
    default_tier = where.text(table, "default_tier") or "default"
    if default_tier not in tiers:
        where.fail("default_tier", f"{default_tier!r} is not among its tiers {list(tiers)}")
    max_queued = where.positive_int(table, "max_queued")
    return Sharing(
        weight=float(weight),
        tiers=tuple(dict.fromkeys(tiers)),
        default_tier=default_tier,
        max_queued=DEFAULT_MAX_QUEUED if max_queued is None else max_queued,
    )
