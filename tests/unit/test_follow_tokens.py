"""Follow tokens on their own: what they sign, what they refuse, when they expire (a fake
clock, never a wait)."""

from __future__ import annotations

from gateway.http.follow_tokens import FollowTokens

SECRET = b"s" * 32


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tokens(clock: FakeClock, ttl: float = 3600.0, secret: bytes = SECRET) -> FollowTokens:
    return FollowTokens(secret, ttl, clock=clock)


def test_a_token_names_its_tenant_for_its_run():
    signer = tokens(FakeClock())
    token = signer.issue("chatcmpl-a", "acme")
    assert signer.tenant_of(token, "chatcmpl-a") == "acme"
    assert "chatcmpl-a" not in token  # the run comes from the URL, not the token


def test_a_token_for_one_run_reads_no_other():
    signer = tokens(FakeClock())
    token = signer.issue("chatcmpl-a", "acme")
    assert signer.tenant_of(token, "chatcmpl-b") is None


def test_a_token_cannot_be_moved_to_another_tenant():
    signer = tokens(FakeClock())
    version, _, expiry, signature = signer.issue("chatcmpl-a", "acme").split(".")
    globex = signer.issue("chatcmpl-a", "globex").split(".")[1]
    assert signer.tenant_of(f"{version}.{globex}.{expiry}.{signature}", "chatcmpl-a") is None


def test_it_expires_after_its_ttl():
    clock = FakeClock()
    signer = tokens(clock, ttl=60)
    token = signer.issue("chatcmpl-a", "acme")
    clock.now += 59
    assert signer.tenant_of(token, "chatcmpl-a") == "acme"
    clock.now += 1
    assert signer.tenant_of(token, "chatcmpl-a") is None


def test_a_later_expiry_written_in_fails_its_signature():
    clock = FakeClock()
    signer = tokens(clock, ttl=60)
    version, tenant, expiry, signature = signer.issue("chatcmpl-a", "acme").split(".")
    longer = f"{version}.{tenant}.{int(expiry) + 86400}.{signature}"
    assert signer.tenant_of(longer, "chatcmpl-a") is None


def test_tampered_or_malformed_tokens_are_refused():
    signer = tokens(FakeClock())
    token = signer.issue("chatcmpl-a", "acme")
    flipped = token[:-1] + ("A" if token[-1] != "A" else "B")
    for bad in (flipped, "", "f1", "f1...", token + ".x", "f0" + token[2:], token.replace(".", "")):
        assert signer.tenant_of(bad, "chatcmpl-a") is None, bad


def test_another_secret_signs_nothing_this_one_accepts():
    clock = FakeClock()
    token = tokens(clock, secret=b"t" * 32).issue("chatcmpl-a", "acme")
    assert tokens(clock).tenant_of(token, "chatcmpl-a") is None
