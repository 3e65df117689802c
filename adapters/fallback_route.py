"""Model aliases (design §6): a public model name over an ordered or weighted list of target
models, as the config file's `[models."ALIAS"]` tables declare them, and one request's route
through them.

- Ordered (`targets = ["a", "b"]`): tried in that order.
- Weighted (`targets = [{model = "a", weight = 90}, {model = "b", weight = 10}]`): one target
  is chosen by weight from a stable hash of the conversation's start (`sticky_point`), so every
  turn of a conversation goes to the same target, on every replica; the others follow, heaviest
  first. A weight of 0 takes no traffic of its own: a fallback only.

A `Route` is the order for one request plus what became of each target: passed over (and why,
`SKIP_REASONS`), being tried, or serving. It is the `x-sluice-route` header's source.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adapters.requests import ChatRequest
from common.config import ConfigError, check_keys

ROUTE_HEADER = "x-sluice-route"
# why a target was passed over: the tenant may not use it; it cannot honour a parameter of the
# request; no member was ready; the gateway's queue for it shed the run; it failed before its
# first token; no first token within the alias's first_token_timeout; the retry budget had no
# room for another try
SKIP_REASONS = (
    "not_allowed",
    "unsupported",
    "unavailable",
    "shed",
    "failed",
    "timeout",
    "budget",
)
OUTCOMES = ("served_first", "fell_back", "exhausted")  # sluice_fallbacks_total{alias,outcome}
_ALIAS_KEYS = ("targets", "first_token_timeout")
_TARGET_KEYS = ("model", "weight")


@dataclass(slots=True, frozen=True)
class Target:
    model: str
    weight: int | None = None  # None: an ordered alias's target


@dataclass(slots=True, frozen=True)
class Alias:
    name: str
    targets: tuple[Target, ...]
    first_token_timeout: float | None = None  # seconds a target may take to its first token

    @property
    def weighted(self) -> bool:
        return self.targets[0].weight is not None

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(t.model for t in self.targets)

    def order(self, request: ChatRequest) -> list[str]:
        """The targets in the order this request tries them."""
        if not self.weighted:
            return list(self.models)
        total = sum(t.weight or 0 for t in self.targets)
        point = sticky_point(request) * total
        chosen = max(self.targets, key=lambda t: t.weight or 0)  # (rounding at the very end)
        for target in self.targets:
            if point < (target.weight or 0):
                chosen = target
                break
            point -= target.weight or 0
        rest = sorted((t for t in self.targets if t is not chosen), key=lambda t: -(t.weight or 0))
        return [chosen.model, *(t.model for t in rest)]


def sticky_point(request: ChatRequest) -> float:
    """A number in [0, 1) that stays the same for every turn of a conversation: a hash of its
    start (the tools shown, the messages up to and including the first user message), which
    later turns only add to. NOTE: blake2b, not `hash()`: Python's string hash differs per
    process, and a conversation must land on the same target on every replica."""
    digest = hashlib.blake2b(digest_size=8)
    if request.tools and request.tool_choice != "none":
        digest.update(json.dumps(request.tools, sort_keys=True).encode())
    if request.prompt is not None:  # a legacy completion: its raw text (or token ids)
        digest.update(str(request.prompt).encode())
    for message in request.messages:
        digest.update(f"{message.role}\x00{message.content or ''}\x00".encode())
        if message.role == "user":
            break
    return int.from_bytes(digest.digest(), "big") / 2**64


@dataclass(slots=True)
class Route:
    """One request's way through its alias's targets."""

    alias: str
    order: list[str]  # every target, in the order this request tries them
    skipped: dict[str, str] = field(default_factory=dict)  # target → why it was passed over
    trying: str | None = None  # the target the run is on (or goes to next) before it serves
    served: str | None = None

    def candidates(self) -> list[str]:
        """The targets still to try, in order."""
        return [t for t in self.order if t not in self.skipped and t != self.served]

    def skip(self, target: str, reason: str) -> None:
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}")
        self.skipped[target] = reason
        if self.trying == target:
            self.trying = None

    def serve(self, target: str) -> str:
        """The target serves the request; the outcome to count (`served_first`, `fell_back`)."""
        self.served, self.trying = target, None
        return "served_first" if target == self.order[0] else "fell_back"

    def header(self) -> str:
        """`x-sluice-route`: the targets in order up to the one serving (or being tried), each
        as `MODEL;served`, `MODEL;trying` or `MODEL;skipped=REASON`; those never reached are
        left out. `a;skipped=unavailable, b;served`."""
        now = self.served or self.trying or next(iter(self.candidates()), None)
        parts = []
        for target in self.order:
            if target == now:
                parts.append(f"{target};{'served' if target == self.served else 'trying'}")
                break
            if target in self.skipped:
                parts.append(f"{target};skipped={self.skipped[target]}")
        return ", ".join(parts)


# -- the config file's [models."ALIAS"] tables ---------------------------------------------------


def parse_aliases(tables: Mapping[str, Any]) -> list[Alias]:
    """The aliases of the config file's `[models."ALIAS"]` tables; ConfigError names what is
    wrong. A target may not be an alias itself (aliases do not chain, so none can loop)."""
    aliases = [_alias(name, table) for name, table in tables.items()]
    for alias in aliases:
        for model in alias.models:
            if model == alias.name:
                raise ConfigError(f'[models."{alias.name}"]: it names itself as a target (a loop)')
            if model in tables:
                raise ConfigError(
                    f'[models."{alias.name}"]: target {model!r} is an alias too; a target must '
                    "be a model a backend serves (aliases do not chain, so none can loop)"
                )
    return aliases


def _alias(name: str, table: Any) -> Alias:
    where = f'[models."{name}"]'
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table with targets (and first_token_timeout)")
    check_keys(table, _ALIAS_KEYS, where)
    listed = table.get("targets")
    if not isinstance(listed, list) or not listed:
        raise ConfigError(f"{where}: targets must be a non-empty list of model names or tables")
    if all(isinstance(t, str) and t for t in listed):
        targets = tuple(Target(t) for t in listed)
    elif all(isinstance(t, dict) for t in listed):
        targets = tuple(_weighted(t, where) for t in listed)
        if not any(t.weight for t in targets):
            raise ConfigError(f"{where}: at least one target needs a weight above 0")
    else:
        raise ConfigError(
            f'{where}: targets are either all model names (["a", "b"]) or all tables '
            '([{model = "a", weight = 90}, …]), not a mix'
        )
    models = [t.model for t in targets]
    if len(set(models)) != len(models):
        raise ConfigError(f"{where}: a target is listed twice")
    timeout = table.get("first_token_timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise ConfigError(f"{where}: first_token_timeout must be a number of seconds above 0")
    return Alias(name, targets, None if timeout is None else float(timeout))


def _weighted(table: dict[str, Any], where: str) -> Target:
    check_keys(table, _TARGET_KEYS, f"{where} target")
    model, weight = table.get("model"), table.get("weight")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}: each target table needs model = a model name")
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
        raise ConfigError(f"{where}: target {model!r} needs weight = an integer of 0 or more")
    return Target(model, weight)
