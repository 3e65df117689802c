"""What the load users need to know, from the environment (read once per locust process).

- `SLUICE_LOAD_KEYS="gold=sk-…,silver=sk-…"`, or `SLUICE_LOAD_KEYS_FILE` naming a file with one
  `tenant=key` a line (`#` comments): the tenants to load and a key of each.
- `SLUICE_LOAD_THROTTLED="trickle"`: tenants whose limits are meant to be hit; their 429s (with
  `retry-after`) are expected. Any other tenant's 429 is a failure.
- `SLUICE_LOAD_MODEL`: the model to ask for; by default the first one `/v1/models` lists.
- `SLUICE_LOAD_MAX_TOKENS` (32): a plain stream's `max_tokens`; cancelled and resumed streams
  ask for more, so that they are still running when cut.
- `SLUICE_LOAD_CUT_AFTER` (3): text frames read before a cancel or a disconnect.
- `SLUICE_LOAD_COUNTS_FILE`: where to write the final count of every row as JSON at the end.
The host is locust's own (`--host` or `LOCUST_HOST`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import requests


class LoadConfigError(Exception):
    """The environment does not say what to load."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key: str
    throttled: bool  # its 429s are expected

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass(frozen=True, slots=True)
class LoadSettings:
    tenants: tuple[Tenant, ...]
    model: str
    max_tokens: int
    cut_after: int


def parse_keys(text: str) -> dict[str, str]:
    """`tenant=key` pairs, separated by commas or newlines; `#` starts a comment."""
    keys: dict[str, str] = {}
    for raw in text.replace(",", "\n").splitlines():
        item = raw.split("#", 1)[0].strip()
        if not item:
            continue
        name, sep, key = (part.strip() for part in item.partition("="))
        if not sep or not name or not key:
            raise LoadConfigError(f"expected tenant=key, got {item[:20]!r}…")
        if name in keys:
            raise LoadConfigError(f"tenant {name!r} is given twice")
        keys[name] = key
    return keys


def _keys_from_env() -> dict[str, str]:
    path = os.environ.get("SLUICE_LOAD_KEYS_FILE")
    text = Path(path).read_text(encoding="utf-8") if path else os.environ.get("SLUICE_LOAD_KEYS")
    keys = parse_keys(text or "")
    if not keys:
        raise LoadConfigError("set SLUICE_LOAD_KEYS=tenant=key,… or SLUICE_LOAD_KEYS_FILE=PATH")
    return keys


def _positive(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or int(raw) < 1:
        raise LoadConfigError(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


def first_model(host: str, tenant: Tenant) -> str:
    """The first model the gateway lists for this tenant."""
    response = requests.get(f"{host.rstrip('/')}/v1/models", headers=tenant.auth, timeout=10)
    response.raise_for_status()
    models = response.json()["data"]
    if not models:
        raise LoadConfigError(f"{host}/v1/models lists no model")
    return models[0]["id"]


@functools.cache
def load_settings(host: str) -> LoadSettings:
    keys = _keys_from_env()
    throttled = set(parse_names(os.environ.get("SLUICE_LOAD_THROTTLED", "")))
    if unknown := throttled - keys.keys():
        raise LoadConfigError(f"SLUICE_LOAD_THROTTLED names tenants without keys: {unknown}")
    tenants = tuple(Tenant(name, key, name in throttled) for name, key in keys.items())
    unthrottled = [t for t in tenants if not t.throttled] or list(tenants)
    model = os.environ.get("SLUICE_LOAD_MODEL") or first_model(host, unthrottled[0])
    return LoadSettings(
        tenants=tenants,
        model=model,
        max_tokens=_positive("SLUICE_LOAD_MAX_TOKENS", 32),
        cut_after=_positive("SLUICE_LOAD_CUT_AFTER", 3),
    )


def parse_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]
