"""Who a request is for, as fair sharing sees it (design §12): its tenant, weight and tier.

The gateway sets a request's share from its tenant and the request's `service_tier`; the worker's
scheduler orders and preempts by it (workers/fair_policy.py). One definition for both ends, and
torch-free like wire/api.py, so the gateway imports it without any model code. The tenant is
a digest of its name (the same one the prefix-cache salt starts from): workers never see names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Service tiers, highest first: `priority` goes ahead of `default`; `flex` is sheddable batch
# work, served only when nothing above it waits.
TIERS = ("priority", "default", "flex")
TIER_RANK = {tier: rank for rank, tier in enumerate(TIERS)}
MAX_WEIGHT = 1000.0  # a weight's upper bound (and 1 / its lower bound): shares stay finite
MAX_TENANT_LEN = 64


class InvalidShare(ValueError):
    """A share that is not well formed; `param` names its field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True, frozen=True)
class Share:
    """A request's claim on a saturated engine: its tenant's weight, within its tier."""

    tenant: str = ""  # a digest of the tenant's name; "" for a request sent with none
    weight: float = 1.0  # relative to the other tenants' weights
    tier: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_LEN:
            raise InvalidShare(
                f"share.tenant must be a string of at most {MAX_TENANT_LEN} characters",
                "share.tenant",
            )
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise InvalidShare("share.weight must be a number", "share.weight")
        if not 1 / MAX_WEIGHT <= weight <= MAX_WEIGHT:
            raise InvalidShare(
                f"share.weight must be between {1 / MAX_WEIGHT} and {MAX_WEIGHT}", "share.weight"
            )
        if self.tier not in TIER_RANK:
            raise InvalidShare(f"share.tier must be one of {', '.join(TIERS)}", "share.tier")

    @property
    def rank(self) -> int:
        """0 for the highest tier: lower ranks go first."""
        return TIER_RANK[self.tier]

    def wire(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "weight": self.weight, "tier": self.tier}

    @classmethod
    def from_wire(cls, value: Any) -> Share:
        """A share as the worker API carries it; InvalidShare names the bad field."""
        if not isinstance(value, dict):
            raise InvalidShare("share must be an object", "share")
        return cls(
            tenant=value.get("tenant", ""),
            weight=value.get("weight", 1.0),
            tier=value.get("tier", "default"),
        )


DEFAULT_SHARE = Share()
