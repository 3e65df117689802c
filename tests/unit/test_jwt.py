"""JWT bearer tokens: pinned algorithms, checked claims, and the tenant from a claim in the file."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from policies.auth import Authenticator, Principal, hash_key
from policies.jwt import JWTVerifier
from policies.tenants import JWTSettings, TenantsFileError, load_tenants

ISSUER = "https://issuer.example"
AUDIENCE = "sluicegate"
SECRET = "s" * 40


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def other_rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def public_pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def claims(**overrides: object) -> dict:
    now = int(time.time())
    base = {"tenant": "acme", "sub": "user-7", "iss": ISSUER, "aud": AUDIENCE, "exp": now + 60}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def settings(**fields: object) -> JWTSettings:
    return JWTSettings(**{"issuer": ISSUER, "audience": AUDIENCE, **fields})


def pem_verifier(tmp_path: Path, key, algorithms=("RS256",), **fields) -> JWTVerifier:
    path = tmp_path / "issuer.pem"
    path.write_bytes(public_pem(key))
    return JWTVerifier(settings(algorithms=algorithms, public_key_file=str(path), **fields))


def hs256_by_hand(secret: bytes, payload: dict) -> str:
    """An HS256 token signed with any bytes (PyJWT itself refuses a PEM as an HMAC secret)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps(payload).encode())
    signature = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(signature)}"


def test_hs256_with_the_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLUICE_JWT_SECRET", SECRET)
    verifier = JWTVerifier(settings(algorithms=("HS256",), hs256_secret_env="SLUICE_JWT_SECRET"))
    assert verifier.verify(jwt.encode(claims(), SECRET, algorithm="HS256"))["tenant"] == "acme"
    assert verifier.verify(jwt.encode(claims(), "x" * 40, algorithm="HS256")) is None


def test_rs256_from_a_pem_file(tmp_path, rsa_key):
    verifier = pem_verifier(tmp_path, rsa_key)
    assert verifier.verify(jwt.encode(claims(), rsa_key, algorithm="RS256"))["sub"] == "user-7"


def test_es256_from_a_pem_file(tmp_path, ec_key):
    verifier = pem_verifier(tmp_path, ec_key, algorithms=("ES256",))
    assert verifier.verify(jwt.encode(claims(), ec_key, algorithm="ES256"))["tenant"] == "acme"


def test_a_jwks_file_picks_the_key_by_kid(tmp_path, rsa_key, other_rsa_key, ec_key):
    jwks = {"keys": []}
    for kid, key in (("old", other_rsa_key), ("current", rsa_key)):
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        jwks["keys"].append({**jwk, "kid": kid, "alg": "RS256", "use": "sig"})
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key()))
    jwks["keys"].append({**jwk, "kid": "ec"})  # no "alg": inferred from the curve
    (tmp_path / "jwks.json").write_text(json.dumps(jwks))
    pinned = ("RS256", "ES256")
    verifier = JWTVerifier(settings(algorithms=pinned, jwks_file=str(tmp_path / "jwks.json")))

    def token(key, alg="RS256", **headers) -> str:
        return jwt.encode(claims(), key, algorithm=alg, headers=headers or None)

    assert verifier.verify(token(rsa_key, kid="current"))["tenant"] == "acme"
    assert verifier.verify(token(other_rsa_key, kid="old"))["tenant"] == "acme"
    assert verifier.verify(token(ec_key, "ES256", kid="ec"))["tenant"] == "acme"
    assert verifier.verify(token(rsa_key, kid="old")) is None  # right key, wrong kid
    assert verifier.verify(token(rsa_key, kid="unknown")) is None
    assert verifier.verify(token(rsa_key)) is None  # no kid and three keys: nothing to pick
    assert verifier.verify(token(ec_key, "ES256", kid="current")) is None  # kid of an RSA key


def test_a_jwks_with_one_key_needs_no_kid(tmp_path, rsa_key):
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(rsa_key.public_key()))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
    verifier = JWTVerifier(settings(algorithms=("RS256",), jwks_file=str(tmp_path / "jwks.json")))
    assert verifier.verify(jwt.encode(claims(), rsa_key, algorithm="RS256"))["tenant"] == "acme"


def test_files_in_the_jwt_table_are_found_beside_the_tenants_file(tmp_path, rsa_key):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "issuer.pem").write_bytes(public_pem(rsa_key))
    (tmp_path / "tenants.toml").write_text(
        f'[tenants.acme]\n[jwt]\nalgorithms = ["RS256"]\npublic_key_file = "keys/issuer.pem"\n'
        f'issuer = "{ISSUER}"\naudience = "{AUDIENCE}"\n'
    )
    config = load_tenants(tmp_path / "tenants.toml")
    assert config.jwt is not None
    token = jwt.encode(claims(), rsa_key, algorithm="RS256")
    assert JWTVerifier(config.jwt).verify(token)["tenant"] == "acme"


REJECTED = {
    "alg none": lambda rsa_key, other, pem: jwt.encode(claims(), None, algorithm="none"),
    "RS256 key re-used as an HS256 secret": lambda rsa_key, other, pem: hs256_by_hand(
        pem, claims()
    ),
    "signed by another key": lambda rsa_key, other, pem: jwt.encode(claims(), other, "RS256"),
    "expired": lambda k, o, p: jwt.encode(claims(exp=int(time.time()) - 60), k, "RS256"),
    "not yet valid": lambda k, o, p: jwt.encode(claims(nbf=int(time.time()) + 120), k, "RS256"),
    "no exp": lambda k, o, p: jwt.encode(claims(exp=None), k, "RS256"),
    "wrong audience": lambda k, o, p: jwt.encode(claims(aud="someone-else"), k, "RS256"),
    "no audience": lambda k, o, p: jwt.encode(claims(aud=None), k, "RS256"),
    "wrong issuer": lambda k, o, p: jwt.encode(claims(iss="https://evil.example"), k, "RS256"),
    "no tenant claim": lambda k, o, p: jwt.encode(claims(tenant=None), k, "RS256"),
    "tenant claim not a string": lambda k, o, p: jwt.encode(claims(tenant=["acme"]), k, "RS256"),
    "PS256 (same key, not pinned)": lambda k, o, p: jwt.encode(claims(), k, "PS256"),
    "garbage": lambda k, o, p: "not.a.jwt",
    "tampered payload": lambda k, o, p: _tamper(jwt.encode(claims(), k, "RS256")),
}


def _tamper(token: str) -> str:
    head, _, sig = token.split(".")
    body = base64.urlsafe_b64encode(json.dumps(claims(tenant="root")).encode()).rstrip(b"=")
    return f"{head}.{body.decode()}.{sig}"


@pytest.mark.parametrize("case", REJECTED)
def test_rejected_tokens(tmp_path, rsa_key, other_rsa_key, case):
    verifier = pem_verifier(tmp_path, rsa_key)
    token = REJECTED[case](rsa_key, other_rsa_key, public_pem(rsa_key))
    assert verifier.verify(token) is None


def test_an_rs256_token_is_not_checked_by_an_es256_verifier(tmp_path, rsa_key, ec_key):
    verifier = pem_verifier(tmp_path, ec_key, algorithms=("ES256",))
    assert verifier.verify(jwt.encode(claims(), rsa_key, algorithm="RS256")) is None


def test_leeway_is_honoured(tmp_path, rsa_key):
    token = jwt.encode(claims(exp=int(time.time()) - 5), rsa_key, algorithm="RS256")
    assert pem_verifier(tmp_path, rsa_key, leeway=30.0).verify(token) is not None
    assert pem_verifier(tmp_path, rsa_key, leeway=0.0).verify(token) is None


def test_issuer_and_audience_are_only_checked_when_configured(tmp_path, rsa_key):
    verifier = pem_verifier(tmp_path, rsa_key, issuer=None, audience=None)
    token = jwt.encode(claims(iss="anyone", aud=None), rsa_key, algorithm="RS256")
    assert verifier.verify(token) is not None


def test_key_material_problems_are_reported_at_construction(tmp_path, monkeypatch, rsa_key):
    monkeypatch.delenv("NO_SUCH_SECRET", raising=False)
    hs = settings(algorithms=("HS256",), hs256_secret_env="NO_SUCH_SECRET")
    with pytest.raises(TenantsFileError, match="environment variable NO_SUCH_SECRET is not set"):
        JWTVerifier(hs)
    monkeypatch.setenv("NO_SUCH_SECRET", "short")
    with pytest.raises(TenantsFileError, match="shorter than 32 bytes"):
        JWTVerifier(hs)
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(TenantsFileError, match=r"missing\.pem"):
        JWTVerifier(settings(algorithms=("RS256",), public_key_file=missing))
    (tmp_path / "private.pem").write_bytes(
        rsa_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(TenantsFileError, match="not a PEM RSA or EC public key"):
        JWTVerifier(settings(algorithms=("RS256",), public_key_file=str(tmp_path / "private.pem")))
    with pytest.raises(TenantsFileError, match="cannot verify any of"):
        pem_verifier(tmp_path, rsa_key, algorithms=("ES256",))
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}))
    with pytest.raises(TenantsFileError, match="no usable signing key"):
        JWTVerifier(settings(algorithms=("RS256",), jwks_file=str(tmp_path / "jwks.json")))


def tenants_file(tmp_path: Path, rsa_key, extra: str = "") -> Path:
    (tmp_path / "issuer.pem").write_bytes(public_pem(rsa_key))
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenants.acme]\nkeys = ["{hash_key("sk-sluice-acme")}"]\n{extra}'
        f'[jwt]\nalgorithms = ["RS256"]\npublic_key_file = "issuer.pem"\n'
        f'issuer = "{ISSUER}"\naudience = "{AUDIENCE}"\ntenant_claim = "org"\n'
    )
    return path


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_authenticator_takes_the_tenant_from_the_configured_claim(tmp_path, rsa_key):
    auth = Authenticator(load_tenants(tenants_file(tmp_path, rsa_key)))
    token = jwt.encode(claims(tenant=None, org="acme"), rsa_key, algorithm="RS256")
    assert auth.authenticate(bearer(token)) == Principal("acme", None, "user-7")
    unknown = jwt.encode(claims(tenant=None, org="globex"), rsa_key, algorithm="RS256")
    assert auth.authenticate(bearer(unknown)) is None  # signed, but not a tenant of the file
    wrong_claim = jwt.encode(claims(), rsa_key, algorithm="RS256")  # `tenant`, not `org`
    assert auth.authenticate(bearer(wrong_claim)) is None
    assert auth.authenticate(bearer("sk-sluice-acme")).tenant == "acme"  # keys still work
    assert auth.authenticate(None) is None
    assert auth.authenticate("Basic abc") is None
    assert len(auth) == 2  # one key + the JWT issuer
    assert auth.tenant("acme").name == "acme"


def test_reload_swaps_the_whole_config_or_keeps_the_old_one(tmp_path, rsa_key):
    path = tenants_file(tmp_path, rsa_key)
    auth = Authenticator(load_tenants(path))
    globex = bearer(jwt.encode(claims(tenant=None, org="globex"), rsa_key, algorithm="RS256"))
    assert auth.authenticate(globex) is None

    path.write_text(path.read_text().replace("[jwt]", "[tenants.globex]\n[jwt]"))
    auth.reload(load_tenants(path))
    assert auth.authenticate(globex) == Principal("globex", None, "user-7")

    (tmp_path / "issuer.pem").unlink()
    with pytest.raises(TenantsFileError):
        auth.reload(load_tenants(path))
    assert auth.authenticate(globex) == Principal("globex", None, "user-7")
