"""Which member of a pool a request goes to (design §6), its ingredients in one place.

- `affinity` (the default): the usable member holding the longest prefix of the prompt
  (adapters/prefix_affinity.py), unless it is overloaded, more than `AFFINITY_SLACK` requests
  above the least loaded, in which case load wins. Load is the member's own reported waiting +
  running (adapters/pool_members.py), the same number for every gateway replica; between equal
  loads the one with more free KV blocks goes first.
- `least_load`: the least loaded member; equal loads take turns.
- `random`: any usable member, uniformly (a baseline for `bench/pool.py`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from adapters.pool_members import Member
from adapters.prefix_affinity import PrefixAffinity, prefix_keys
from adapters.requests import ChatRequest

AFFINITY_SLACK = 2
ROUTINGS = ("affinity", "least_load", "random")


class Router:
    def __init__(self, policy: str = "affinity", rng: random.Random | None = None) -> None:
        if policy not in ROUTINGS:
            raise ValueError(f"pool routing must be one of {', '.join(ROUTINGS)}, got {policy!r}")
        self.policy = policy
        self.affinity = PrefixAffinity()
        self.affinity_routes = 0  # requests affinity sent to a member other than the least loaded
        self._rng = rng or random.Random()
        self._turn = 0

    def choose(self, members: Sequence[Member], usable: list[int], request: ChatRequest) -> int:
        """The index (into `members`) of the member to send `request` to; `usable` is not empty."""
        if self.policy == "random":
            return self._rng.choice(usable)
        n, turn = len(members), self._turn
        least = min(usable, key=lambda i: (members[i].score(), members[i].kv_usage, (i - turn) % n))
        self._turn = (turn + 1) % n  # equal loads take turns (the fuller KV cache last)
        if self.policy == "least_load":
            return least
        floor = members[least].score()
        keys = prefix_keys(request)
        chosen = least
        for owner in self.affinity.owners(keys):
            if owner in usable and members[owner].score() <= floor + AFFINITY_SLACK:
                chosen = owner
                self.affinity_routes += owner != least
                break
        self.affinity.remember(keys, chosen)
        return chosen
