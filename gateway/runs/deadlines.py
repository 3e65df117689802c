"""A run's deadlines (DESIGN §2): defaults from the settings, tenants may lower them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Deadlines:
    """Seconds; None means no limit. Each one that fires is its own terminal cause."""

    queue: float | None = None  # run start → the upstream admits it (or its first token)
    ttft: float | None = None  # run start → first token
    inter_token: float | None = None  # between tokens
    total: float | None = None  # run start → end
