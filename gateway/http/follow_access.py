"""Where follow tokens (gateway/http/follow_tokens.py) meet the app: which routes take
`?token=`, the principal a token proves, the token a run's answers carry, and where the signing
secret comes from.

The secret is `follow_token_secret` (`SLUICE_FOLLOW_TOKEN_SECRET`, or the `--config` file): set
it the same on every replica to control rotation. Without it, replicas sharing Redis agree on a
random secret the first of them stores there (under the Redis prefix), and a lone replica makes
one per process, so its tokens end with it.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from gateway.app_keys import FOLLOW_TOKEN, FOLLOW_TOKENS, REDIS, SETTINGS
from gateway.http.errors import APIError
from gateway.http.follow_tokens import FollowTokens
from policies.auth import Principal

HEADER = "x-follow-token"
SECRET_KEY = "follow-token-secret"  # under the Redis prefix, when no secret is configured
_ACCEPTS = "_accepts_follow_token"

Handler = TypeVar("Handler", bound=Callable[[web.Request], Awaitable[web.StreamResponse]])


def accepts_follow_token(handler: Handler) -> Handler:
    """Mark a run's GET route (its path names the run as `{id}`) as one a follow token reads."""
    setattr(handler, _ACCEPTS, True)
    return handler


def token_principal(request: web.Request) -> Principal | None:
    """The principal a `?token=` proves on a route that accepts one, or None where the request
    authenticates as usual (no token, another route or method, an Authorization header). A
    token that does not check out is a 401, never a fallback to anything else."""
    token = request.query.get("token")
    if token is None or "Authorization" in request.headers:
        return None
    if request.method not in ("GET", "HEAD") or not getattr(
        request.match_info.route.handler, _ACCEPTS, False
    ):
        return None
    tenant = request.app[FOLLOW_TOKENS].tenant_of(token, request.match_info.get("id", ""))
    if tenant is None:
        raise APIError(
            401,
            "The follow token is not valid for this run, or it has expired.",
            param="token",
            code="invalid_follow_token",
        )
    request[FOLLOW_TOKEN] = token
    return Principal(tenant=tenant, key_id=None, subject="follow-token")


def follow_token(request: web.Request, run_id: str, tenant: str) -> str:
    """The token a run's answer carries: the one this request came with (a token never makes a
    longer-lived one), else a new one."""
    return request.get(FOLLOW_TOKEN) or request.app[FOLLOW_TOKENS].issue(run_id, tenant)


async def _shared_secret(app: web.Application) -> bytes:
    """One random secret for every replica sharing this Redis: the first to start sets it."""
    redis, key = app[REDIS].redis, app[SETTINGS].redis_prefix + SECRET_KEY
    await redis.set(key, secrets.token_hex(32), nx=True)
    value = await redis.get(key)
    return value if isinstance(value, bytes) else str(value).encode()


async def follow_tokens_ctx(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx, after shared_state (it may read Redis): the app's FollowTokens."""
    settings = app[SETTINGS]
    if settings.follow_token_secret:
        secret = settings.follow_token_secret.encode()
    elif settings.redis_url:
        secret = await _shared_secret(app)
    else:
        secret = secrets.token_bytes(32)
    app[FOLLOW_TOKENS] = FollowTokens(secret, settings.follow_token_ttl)
    yield
