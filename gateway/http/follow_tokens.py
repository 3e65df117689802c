"""Follow tokens: a run-scoped, expiring, signed capability to read one run (design §4).

A browser's `EventSource` cannot send an `Authorization` header, so a run's GET routes also take
`?token=` (gateway/http/follow_access.py): an HMAC-SHA256 over the run id, its tenant and an expiry,
with a server secret. It proves only "this tenant may read this run until then": it is not the
API key, and it opens no other run, no other route and no other tenant's data.

Shape: `f1.<tenant, base64url>.<expiry, unix seconds>.<signature, base64url>`. The run id is not
in the token: it comes from the URL, so a token used on another run's URL fails its signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field

VERSION = "f1"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class FollowTokens:
    """Issues and checks follow tokens; `clock` (unix seconds) is injectable for tests."""

    secret: bytes
    ttl: float = 3600.0
    clock: Callable[[], float] = field(default=time.time)

    def issue(self, run_id: str, tenant: str) -> str:
        """A token for `tenant` to read `run_id` for the next `ttl` seconds."""
        expiry = int(self.clock() + self.ttl)
        tenant_part = _b64(tenant.encode())
        return f"{VERSION}.{tenant_part}.{expiry}.{self._sign(run_id, tenant_part, expiry)}"

    def tenant_of(self, token: str, run_id: str) -> str | None:
        """The tenant the token lets read `run_id`; None if it is malformed, signed for another
        run or tenant, tampered with, or expired."""
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != VERSION or not parts[2].isdigit():
            return None
        _, tenant_part, expiry_text, signature = parts
        expiry = int(expiry_text)
        if not hmac.compare_digest(signature, self._sign(run_id, tenant_part, expiry)):
            return None
        if self.clock() >= expiry:
            return None
        try:
            return _unb64(tenant_part).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None

    def _sign(self, run_id: str, tenant_part: str, expiry: int) -> str:
        message = f"{VERSION}\n{run_id}\n{tenant_part}\n{expiry}".encode()
        return _b64(hmac.new(self.secret, message, hashlib.sha256).digest())
