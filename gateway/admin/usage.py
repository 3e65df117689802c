"""`GET /admin/usage`: tokens and cost per tenant, model and (with `group_by=day`) UTC day,
summed from the usage ledger's records (gateway/state/ledger.py)."""

from __future__ import annotations

from collections.abc import AsyncIterable
from datetime import UTC, datetime
from typing import Any

from gateway.state.ledger import UsageRecord

GROUP_BYS = ("day",)


async def usage_rows(
    records: AsyncIterable[UsageRecord], model: str | None, group_by: str | None
) -> list[dict[str, Any]]:
    """One row per (tenant, model[, day]), sorted by them. `cost` sums the records' costs; it
    is null when none of a row's records had one (no price configured for its model)."""
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    async for r in records:
        if model is not None and r.model != model:
            continue
        day = datetime.fromtimestamp(r.ended_at, UTC).strftime("%Y-%m-%d")
        group = (r.tenant, r.model, day) if group_by == "day" else (r.tenant, r.model)
        row = rows.get(group)
        if row is None:
            row = rows[group] = {"tenant": r.tenant, "model": r.model}
            if group_by == "day":
                row["day"] = day
            row |= {"runs": 0, "prompt_tokens": 0, "generated_tokens": 0, "total_tokens": 0}
            row["cost"] = None
        row["runs"] += 1
        row["prompt_tokens"] += r.prompt_tokens
        row["generated_tokens"] += r.generated_tokens
        row["total_tokens"] += r.prompt_tokens + r.generated_tokens
        if r.cost is not None:  # None: no price for its model when it ran
            row["cost"] = (row["cost"] or 0.0) + r.cost
    return [rows[k] for k in sorted(rows)]
