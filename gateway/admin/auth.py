"""Who may call the admin API: an `--admin-key`, or a JWT (checked with the tenants file's
`[jwt]` keys and pinned algorithms) whose `roles` claim holds `sluice-admin`.

A tenant's own credential is refused with 403; anything else with 401. With no admin key and no
`[jwt]` the admin API does not exist: every /admin route answers 404, so nothing about it can
be probed.
"""

from __future__ import annotations

import hmac

from gateway.http.errors import APIError, invalid_api_key
from policies.auth import Authenticator, bearer_token, hash_key, key_id

ADMIN_ROLE = "sluice-admin"


def not_enabled() -> APIError:
    return APIError(404, "Unknown path: the admin API is not enabled.", code="not_found")


def not_an_admin() -> APIError:
    return APIError(
        403,
        "This credential may not use the admin API (it needs an admin key or the "
        f"{ADMIN_ROLE!r} role).",
        type="permission_error",
        code="permission_denied",
    )


class AdminAuth:
    """Checks admin credentials; only the keys' SHA-256 hashes are kept."""

    def __init__(self, admin_keys: list[str], tenants: Authenticator) -> None:
        self._hashes = tuple(dict.fromkeys(hash_key(k) for k in admin_keys))
        self._tenants = tenants  # its current [jwt] verifier, and tenant keys to tell apart

    @property
    def enabled(self) -> bool:
        return bool(self._hashes) or self._tenants.verifier is not None

    def identify(self, authorization: str | None) -> str:
        """Who is calling, for the audit log: `admin:key_…` (never the key) or `jwt:<sub>`;
        raises the APIError to answer otherwise."""
        if not self.enabled:
            raise not_enabled()
        token = bearer_token(authorization)
        if token is None:
            raise invalid_api_key()
        digest = hash_key(token)
        # NOTE: every stored hash is compared, in constant time, whatever matched first
        matched = [h for h in self._hashes if hmac.compare_digest(h, digest)]
        if matched:
            return "admin:" + key_id(matched[0])
        who = self._from_jwt(token)
        if who is not None:
            return who
        if self._tenants.authenticate(authorization) is not None:
            raise not_an_admin()  # a tenant's key or token: known, but not an admin
        raise invalid_api_key()

    def _from_jwt(self, token: str) -> str | None:
        verifier = self._tenants.verifier
        if verifier is None or token.count(".") != 2:
            return None
        claims = verifier.claims(token)
        if claims is None:
            return None
        roles = claims.get("roles")
        roles = [roles] if isinstance(roles, str) else roles
        if not isinstance(roles, list) or ADMIN_ROLE not in roles:
            raise not_an_admin()
        subject = claims.get("sub")
        return f"jwt:{subject if isinstance(subject, str) else '?'}"
