"""Bearer API keys: only SHA-256 hashes are kept in memory or on disk."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

KEY_PREFIX = "sk-sluice-"


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: the tenant and which credential proved it."""

    tenant: str
    key_id: str


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def key_id(key_hash: str) -> str:
    """A short, stable, non-secret name for a key (from its hash)."""
    return "key_" + key_hash.removeprefix("sha256:")[:12]


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeyAuthenticator:
    """Maps API-key hashes to principals."""

    def __init__(self) -> None:
        self._by_hash: dict[str, Principal] = {}

    def add_key(self, key: str, tenant: str = "default") -> None:
        self.add_hash(hash_key(key), tenant)

    def add_hash(self, key_hash: str, tenant: str) -> None:
        self._by_hash[key_hash] = Principal(tenant, key_id(key_hash))

    def authenticate(self, authorization: str | None) -> Principal | None:
        token = bearer_token(authorization)
        return self._by_hash.get(hash_key(token)) if token else None

    def __len__(self) -> int:
        return len(self._by_hash)
