"""JWT bearer tokens (design §5): keys and algorithms come from config, never from the token.

The classic JWT attacks all let the token pick how it is checked (`alg: none`, an RS256 public key
reused as an HS256 secret). Here the algorithm list is pinned by `[jwt]`, narrowed further to what
the configured key can actually verify, and the token's header only ever selects a key by `kid`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from policies.tenants import JWTSettings, TenantsFileError

# NOTE: RFC 7518 §3.2: an HS256 key must be at least as long as the hash output (256 bits).
MIN_HS256_SECRET_BYTES = 32

PublicKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


class JWTVerifier:
    """Verifies tokens against the key material loaded once, when it is built."""

    def __init__(self, settings: JWTSettings) -> None:
        self.settings = settings
        self._algorithms = list(settings.algorithms)
        self._key: str | PublicKey | None = None
        self._jwks: list[jwt.PyJWK] = []
        if settings.hs256_secret_env:
            self._key = _secret_from_env(settings.hs256_secret_env)
        elif settings.public_key_file:
            self._key = _load_pem(settings.public_key_file)
            self._algorithms = _algorithms_for(
                self._key, self._algorithms, settings.public_key_file
            )
        elif settings.jwks_file:
            self._jwks = _load_jwks(settings.jwks_file, self._algorithms)
        else:
            raise TenantsFileError("[jwt]: no key source (jwks_file, public_key_file, ...)")

    def verify(self, token: str) -> dict[str, Any] | None:
        """The token's claims, or None if anything about it is wrong or it names no tenant."""
        claims = self.claims(token)
        if claims is None:
            return None
        tenant = claims.get(self.settings.tenant_claim)
        return claims if isinstance(tenant, str) and tenant else None

    def claims(self, token: str) -> dict[str, Any] | None:
        """The claims of a token whose signature, issuer, audience and expiry check out, tenant
        or not (an administrator's token may name none)."""
        try:
            key, algorithms = self._key_for(token)
            if key is None:
                return None
            claims = jwt.decode(
                token,
                key,
                algorithms=algorithms,
                issuer=self.settings.issuer,
                audience=self.settings.audience,
                leeway=self.settings.leeway,
                options={"require": ["exp"]},
            )
        except jwt.PyJWTError:
            return None
        return claims

    def _key_for(self, token: str) -> tuple[Any, list[str]]:
        """The key to check this token with, and the algorithms that key may verify."""
        if self._key is not None:
            return self._key, self._algorithms
        kid = jwt.get_unverified_header(token).get("kid")
        matches = [k for k in self._jwks if kid is not None and k.key_id == kid]
        if not matches and len(self._jwks) == 1:
            matches = self._jwks
        # NOTE: a JWK's algorithm is bound to it, so a token cannot have an RSA key checked as
        # ES256 or the other way round even when both are pinned.
        return (matches[0].key, [matches[0].algorithm_name]) if matches else (None, [])


def _secret_from_env(name: str) -> str:
    secret = os.environ.get(name)
    if not secret:
        raise TenantsFileError(
            f"[jwt]: field 'hs256_secret_env': environment variable {name} is not set",
            field="hs256_secret_env",
        )
    if len(secret.encode()) < MIN_HS256_SECRET_BYTES:
        raise TenantsFileError(
            f"[jwt]: field 'hs256_secret_env': the secret in {name} is shorter than "
            f"{MIN_HS256_SECRET_BYTES} bytes",
            field="hs256_secret_env",
        )
    return secret


def _read(file: str, field: str) -> bytes:
    try:
        return Path(file).read_bytes()
    except OSError as exc:
        raise TenantsFileError(
            f"[jwt]: field {field!r}: cannot read {file}: {exc.strerror}", field=field
        ) from None


def _load_pem(file: str) -> PublicKey:
    """A PEM public key, or the public key of a PEM certificate."""
    data = _read(file, "public_key_file")
    try:
        if b"-----BEGIN CERTIFICATE-----" in data:
            key = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        key = None
    if not isinstance(key, PublicKey):
        raise TenantsFileError(
            f"[jwt]: field 'public_key_file': {file} is not a PEM RSA or EC public key",
            field="public_key_file",
        )
    return key


def _algorithms_for(key: PublicKey, pinned: list[str], file: str) -> list[str]:
    """The pinned algorithms this key can verify (an RSA key never checks an ES256 token)."""
    if isinstance(key, rsa.RSAPublicKey):
        usable = [alg for alg in pinned if alg == "RS256"]
    else:
        usable = [alg for alg in pinned if alg == "ES256" and isinstance(key.curve, ec.SECP256R1)]
    if not usable:
        raise TenantsFileError(
            f"[jwt]: field 'algorithms': the key in {file} cannot verify any of {pinned}",
            field="algorithms",
        )
    return usable


def _load_jwks(file: str, pinned: list[str]) -> list[jwt.PyJWK]:
    """The signing keys of a JWKS file whose algorithm is pinned; others are dropped."""
    try:
        data = json.loads(_read(file, "jwks_file"))
        keys = jwt.PyJWKSet.from_dict(data).keys if isinstance(data, dict) else []
    except (ValueError, jwt.PyJWKSetError):
        keys = []
    usable = [k for k in keys if k.algorithm_name in pinned and k.public_key_use in (None, "sig")]
    if not usable:
        raise TenantsFileError(
            f"[jwt]: field 'jwks_file': {file} holds no usable signing key for {pinned}",
            field="jwks_file",
        )
    return usable
