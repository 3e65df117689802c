"""Bearer credentials: API keys (only SHA-256 hashes are kept in memory or on disk) and JWTs."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.jwt import JWTVerifier
    from policies.tenants import Tenant, TenantsConfig

KEY_PREFIX = "sk-sluice-"


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: the tenant and which credential proved it, an API key (`key_id`) or a
    JWT (`key_id` None; its `sub`, when it has one, in `subject`)."""

    tenant: str
    key_id: str | None
    subject: str | None = None

    @property
    def label(self) -> str:
        """Who to bill inside the tenant: the key's id (`key_…`) or `jwt:<sub>`."""
        return self.key_id if self.key_id is not None else f"jwt:{self.subject or '?'}"


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


@dataclass(slots=True, frozen=True)
class _Credentials:
    """Everything one config yields, so a reload replaces it in a single assignment."""

    config: TenantsConfig
    by_hash: dict[str, Principal]
    verifier: JWTVerifier | None


class Authenticator:
    """Turns an Authorization header into a Principal of a tenant in the tenants file."""

    def __init__(self, config: TenantsConfig) -> None:
        self._creds = self._build(config)

    def reload(self, config: TenantsConfig) -> None:
        """Swap in a new config; raises (keeping the old one) if its JWT keys cannot load."""
        # NOTE: built in full before one assignment, so a request sees the old config or the
        # new one, never a mix of the two.
        self._creds = self._build(config)

    @property
    def config(self) -> TenantsConfig:
        return self._creds.config

    @property
    def verifier(self) -> JWTVerifier | None:
        """The current `[jwt]` verifier (None without one); the admin API checks roles with it."""
        return self._creds.verifier

    def tenant(self, name: str) -> Tenant:
        """The tenant's current settings; KeyError if a reload removed it."""
        return self._creds.config.tenants[name]

    def authenticate(self, authorization: str | None) -> Principal | None:
        token = bearer_token(authorization)
        if not token:
            return None
        creds = self._creds
        if creds.verifier is not None and token.count(".") == 2:
            principal = _from_jwt(creds, token)
            if principal is not None:
                return principal
        return creds.by_hash.get(hash_key(token))

    def __len__(self) -> int:
        return len(self._creds.by_hash) + (self._creds.verifier is not None)

    @staticmethod
    def _build(config: TenantsConfig) -> _Credentials:
        # NOTE: imported here because policies.jwt -> policies.tenants -> policies.auth.
        from policies.jwt import JWTVerifier

        by_hash = {
            entry.hash: Principal(tenant.name, entry.id)
            for tenant in config.tenants.values()
            for entry in tenant.keys
        }
        verifier = JWTVerifier(config.jwt) if config.jwt else None
        return _Credentials(config, by_hash, verifier)


def _from_jwt(creds: _Credentials, token: str) -> Principal | None:
    """A verified token whose tenant claim names a tenant of the file (else a 401)."""
    assert creds.verifier is not None
    claims = creds.verifier.verify(token)
    if claims is None:
        return None
    tenant = claims[creds.verifier.settings.tenant_claim]
    if tenant not in creds.config.tenants:
        return None
    subject = claims.get("sub")
    return Principal(tenant, None, subject if isinstance(subject, str) else None)
