"""The safety window as a pipeline stage (design §3): what it releases, redacts and blocks, for
any split of the text into deltas."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.events import Finish, TextDelta, ToolCallDelta, Usage
from safety import policy as policy_module
from safety.checkers import Held, Verdict
from safety.detectors import luhn_valid
from safety.moderation import ModerationFailed, ModerationSettings
from safety.policy import REDACTION, SafetyPolicy
from safety.window import SafetyWindow

TERM = "Project Nightingale"
STRICT = SafetyPolicy.build(
    "strict", block_terms=(TERM, r"/\bcodename-\d+\b/"), redact=("email", "phone", "card", "secret")
)
REDACT_ONLY = SafetyPolicy.build("redact", redact=("email", "phone", "card", "secret"))
SECRETS = [
    "sk-proj-" + "a1B2c3D4e5F6g7H8i9J0kLmN",
    "AKIAIOSFODNN7EXAMPLE",
    "ghp_" + "x" * 36,
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----",
]


class Meter:
    def __init__(self) -> None:
        self.actions: list[str] = []
        self.holds: list[float] = []

    def action(self, action: str) -> None:
        self.actions.append(action)

    def held(self, seconds: float) -> None:
        self.holds.append(seconds)


def pieces(text: str, sizes: list[int]) -> list[str]:
    out, at = [], 0
    for size in sizes:
        if at >= len(text):
            break
        out.append(text[at : at + size])
        at += size
    if at < len(text):
        out.append(text[at:])
    return out


async def stream(policy: SafetyPolicy, parts: list[str], n: int = 1, finish: bool = True):
    """Feed `parts` as one-token deltas (then a Finish); what the window let out, as
    (released text, events, the window, its meter)."""
    meter = Meter()
    window = SafetyWindow(policy, n, meter)
    out = []
    for part in parts:
        out += await window.feed([TextDelta(part)])
    out += await window.feed([Finish("stop")]) if finish else await window.finish()
    text = "".join(e.text for e in out if type(e) is TextDelta)
    return text, out, window, meter


async def test_a_blocked_term_fed_a_character_at_a_time_never_leaves():
    text = f"All about the {TERM.lower()} budget, and more text after it."
    released, events, window, meter = await stream(STRICT, list(text))
    assert released == "All about the "  # judged before the term: it goes, then the block
    assert events[-1] == Finish("content_filter", 0)
    assert [e for e in events if type(e) is Finish] == [Finish("content_filter", 0)]
    assert window.stop_source == "safety" and meter.actions == ["block"]


async def test_a_regex_term_blocks_and_its_near_misses_pass():
    released, events, _, _ = await stream(STRICT, list("see codename-42 now"))
    assert events[-1].reason == "content_filter" and "codename" not in released
    released, events, _, _ = await stream(STRICT, list("see xcodename-42 and codename-x now"))
    assert events[-1].reason == "stop" and released == "see xcodename-42 and codename-x now"


@pytest.mark.parametrize("secret", SECRETS)
async def test_secrets_split_into_single_characters_are_redacted(secret):
    text = f"The key is {secret} and that is all."
    released, events, _, meter = await stream(REDACT_ONLY, list(text))
    assert released == f"The key is {REDACTION} and that is all."
    assert meter.actions == ["redact"] and events[-1].reason == "stop"


async def test_emails_phones_and_valid_cards_are_redacted_but_invalid_cards_are_not():
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")
    text = (
        "Mail bob.smith+x@mail.example.co.uk, call (415) 555-0132 or +44 20 7946 0958. "
        "Card 4111 1111 1111 1111, not 4111 1111 1111 1112. Order 12345 ships 2026-12-01."
    )
    released, _, _, meter = await stream(REDACT_ONLY, pieces(text, [3, 1, 7, 2] * 60))
    assert released == (
        f"Mail {REDACTION}, call {REDACTION} or {REDACTION}. "
        f"Card {REDACTION}, not 4111 1111 1111 1112. Order 12345 ships 2026-12-01."
    )
    assert meter.actions.count("redact") == 4


async def test_a_secret_run_into_a_card_number_is_redacted_for_every_split():
    # the secret's match runs into the card's: two overlapping spans, released as one
    text = f"key {SECRETS[0]}4111 1111 1111 1111 and more text to move the window along."
    expected = f"key {REDACTION} and more text to move the window along."
    for size in range(1, 9):
        released, _, _, _ = await stream(REDACT_ONLY, pieces(text, [size] * len(text)))
        assert released == expected, size


async def test_a_card_beside_other_digits_is_still_redacted():
    text = "Card 4111 1111 1111 1111 12/25, cvv 4111 1111 1111 1111 123; pay 5 4111 1111 1111 1111."
    released, _, _, _ = await stream(REDACT_ONLY, pieces(text, [2, 5, 1] * 40))
    assert released == f"Card {REDACTION} 12/25, cvv {REDACTION} 123; pay 5 {REDACTION}."
    invalid = "Card 4111 1111 1111 1112 12/25 is not one."
    assert (await stream(REDACT_ONLY, list(invalid)))[0] == invalid


@pytest.mark.parametrize(
    "pem",
    [
        "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBkg4LVWM9nuwNSk3yBx",  # cut off before its footer
        "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n"
        "DEK-Info: AES-128-CBC,3F17F5316E2BAC89\n\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----",
    ],
)
async def test_a_pem_key_without_its_footer_or_encrypted_is_redacted_from_its_header(pem):
    released, _, _, _ = await stream(REDACT_ONLY, pieces(f"Here: {pem}", [3] * 80))
    assert released == f"Here: {REDACTION}"


async def test_chars_mode_holds_exactly_the_window_behind_the_front():
    policy = SafetyPolicy.build("w", window_chars=10)
    window = SafetyWindow(policy, 1, Meter())
    out = []
    for ch in "abcdefghijklmnopqrstuvwxyz":
        out += await window.feed([TextDelta(ch)])
        released = "".join(e.text for e in out if type(e) is TextDelta)
        assert len(released) == max(0, len("abcdefghijklmnopqrstuvwxyz"[: len(released) + 10]) - 10)
    assert released == "abcdefghijklmnop"  # 26 - 10
    out += await window.feed([Finish("stop")])
    assert "".join(e.text for e in out if type(e) is TextDelta) == "abcdefghijklmnopqrstuvwxyz"


async def test_sentence_mode_releases_at_sentence_ends_and_bounds_the_hold_by_the_window():
    policy = SafetyPolicy.build("s", mode="sentence", window_chars=40)
    window = SafetyWindow(policy, 1, Meter())
    out = []
    for ch in "It rained. Then":
        out += await window.feed([TextDelta(ch)])
    assert "".join(e.text for e in out) == "It rained."  # 3.14 would not have ended one
    for ch in " the sun came out and stayed out for the whole long afternoon":
        out += await window.feed([TextDelta(ch)])
    released = "".join(e.text for e in out)
    front = "It rained. Then the sun came out and stayed out for the whole long afternoon"
    assert released == front[: len(front) - 40]  # no sentence end: the window bounds the hold


async def test_tokens_and_logprobs_go_out_with_the_text_that_carried_them():
    window = SafetyWindow(REDACT_ONLY, 1, Meter())
    parts = ["Write ", "to ", "a@", "example", ".com ", "now ", "please."]
    out = []
    for part in parts:
        out += await window.feed([TextDelta(part, logprobs=[{"token": part, "logprob": -1.0}])])
    out += await window.feed([Usage(3, 7), Finish("stop")])
    deltas = [e for e in out if type(e) is TextDelta]
    assert sum(d.tokens for d in deltas) == len(parts)
    tokens = [lp["token"] for d in deltas for lp in d.logprobs or ()]
    assert tokens == ["Write ", "to ", REDACTION, REDACTION, REDACTION, "now ", "please."]
    assert "".join(d.text for d in deltas) == f"Write to {REDACTION} now please."
    assert [type(e) for e in out[-2:]] == [TextDelta, Finish]  # the finish after the text


async def test_a_block_in_one_choice_leaves_the_other_choice_running():
    window = SafetyWindow(STRICT, 2, Meter())
    out = await window.feed([TextDelta(f"x {TERM} y", index=0), TextDelta("fine so far", index=1)])
    assert Finish("content_filter", 0) in out and window.stop_source is None
    out = await window.feed([TextDelta(" and after.", index=1), Finish("stop", 1)])
    assert window.stop_source == "safety"
    assert "".join(e.text for e in out if type(e) is TextDelta) == "fine so far and after."


async def test_text_before_a_tool_call_is_checked_and_released_before_it():
    window = SafetyWindow(REDACT_ONLY, 1, Meter())
    call = ToolCallDelta(0, "{}", "call_1", "f")
    out = await window.feed([TextDelta("mail me at a@b.io"), call])
    assert out == [TextDelta(f"mail me at {REDACTION}", 0, 1), call]


async def test_a_tool_calls_arguments_are_redacted_and_stay_valid_json():
    meter = Meter()
    window = SafetyWindow(REDACT_ONLY, 1, meter)
    arguments = json.dumps({"to": "bob@example.com", "notes": [f"key {SECRETS[0]} ok"], "n": 3})
    out = await window.feed([ToolCallDelta(0, arguments, "call_1", "send"), Finish("tool_calls")])
    call = out[0]
    assert json.loads(call.arguments) == {"to": REDACTION, "notes": [f"key {REDACTION} ok"], "n": 3}
    assert (call.id, call.name) == ("call_1", "send") and out[1] == Finish("tool_calls")
    assert meter.actions == ["redact", "redact"]
    untouched = ToolCallDelta(0, '{"city":  "Paris"}', "call_2", "weather")
    assert (await SafetyWindow(REDACT_ONLY, 1, Meter()).feed([untouched]))[0] is untouched


async def test_a_blocked_term_in_a_tool_call_blocks_the_choice():
    window = SafetyWindow(STRICT, 1, Meter())
    arguments = json.dumps({"q": f"all about {TERM.upper()}"})
    out = await window.feed(
        [
            TextDelta("Let me look."),
            ToolCallDelta(0, arguments, "c", "search"),
            Finish("tool_calls"),
        ]
    )
    assert out == [TextDelta("Let me look.", 0, 1), Finish("content_filter", 0)]
    assert window.stop_source == "safety"


class FakeModeration:
    def __init__(self, flag: str = "", fail: bool = False) -> None:
        self.flag, self.fail, self.inputs = flag, fail, []

    async def flagged(self, settings, text: str) -> bool:
        self.inputs.append(text)
        if self.fail:
            raise ModerationFailed("TimeoutError")
        return bool(self.flag) and self.flag in text


def moderation_policy(on_error: str = "block", window: int = 16) -> SafetyPolicy:
    settings = ModerationSettings("http://moderation.invalid/v1/moderations", on_error=on_error)
    return SafetyPolicy.build("remote", window_chars=window, moderation=settings)


async def feed_remote(policy, client, text: str):
    window = SafetyWindow(policy, 1, Meter(), moderation=client)
    out = []
    for ch in text:
        out += await window.feed([TextDelta(ch)])
    out += await window.feed([Finish("stop")])
    return "".join(e.text for e in out if type(e) is TextDelta), out, window


async def test_the_remote_checker_batches_its_calls_and_blocks_what_it_flags():
    client = FakeModeration(flag="violence")
    text = "a calm sentence that goes on for a while, then violence, then more"
    released, out, _ = await feed_remote(moderation_policy(), client, text)
    assert "violence" not in released and out[-1] == Finish("content_filter", 0)
    assert 1 < len(client.inputs) <= len(text) // 16 + 1  # one call per window of text


async def test_a_failing_remote_checker_blocks_or_allows_as_the_policy_says():
    meter_text = "nothing wrong with this text at all"
    released, out, _ = await feed_remote(
        moderation_policy("block"), FakeModeration(fail=True), meter_text
    )
    assert released == "" and out[-1].reason == "content_filter"
    released, out, _ = await feed_remote(
        moderation_policy("allow"), FakeModeration(fail=True), meter_text
    )
    assert released == meter_text and out[-1].reason == "stop"


async def test_a_checker_is_one_class(monkeypatch):
    class NoDigits:
        name = "no_digits"

        async def check(self, held: Held) -> Verdict:
            tail = held.text[held.start :]
            hit = next((i for i, ch in enumerate(tail) if ch.isdigit()), None)
            if hit is None:
                return Verdict(len(held.text))
            return Verdict(held.start + hit, block=self.name)  # what precedes the hit may go

    def no_digits(policy, moderation):
        return [NoDigits()]

    monkeypatch.setattr(policy_module, "CHECKERS", [*policy_module.CHECKERS, no_digits])
    policy = SafetyPolicy.build("plain", window_chars=4)
    window = SafetyWindow(policy, 1, Meter())
    out = await window.feed([TextDelta("abcdefgh"), TextDelta("xy9z"), TextDelta("more" * 5)])
    released = [e.text for e in out if type(e) is TextDelta]
    assert "".join(released) == "abcdefghxy" and out[-1] == Finish("content_filter", 0)


# -- the property: the same released text for every split ---------------------------------------

WORDS = ["the", "model", "said", "hello", "world", "über", "naïve", "日本語", "ok", "3.14", "a-b"]
SEEDS = [
    TERM,
    TERM.upper(),
    "bob@example.com",
    "j.doe42@mail.example.co.uk",  # a greedy match that grows as its labels arrive
    "(415) 555-0132",
    "4111 1111 1111 1111",
    "4111 1111 1111 1112",
    *SECRETS,
]


PEM_BODY = "MHcCAQEEIBkg4LVWM9nuwNSk3yBx"
# items a model may write against each other, with no separator between them
GLUED = [
    SECRETS[0] + "4111 1111 1111 1111",
    "4111 1111 1111 1111 12/25",
    "-----BEGIN EC PRIVATE KEY-----\n" + PEM_BODY,
]
POLICIES = [
    STRICT,
    SafetyPolicy.build("s0", window_chars=0, block_terms=(TERM,), redact=STRICT.redact),
    SafetyPolicy.build("s4", window_chars=4, block_terms=(TERM,), redact=STRICT.redact),
    SafetyPolicy.build("sent", mode="sentence", block_terms=(TERM,), redact=STRICT.redact),
]


@st.composite
def seeded_text(draw):
    tokens = draw(st.lists(st.sampled_from(WORDS + SEEDS + GLUED), min_size=1, max_size=40))
    seps = draw(st.lists(st.sampled_from([" ", " ", ", ", ". ", "\n"]), min_size=len(tokens)))
    return "".join(t + s for t, s in zip(tokens, seps, strict=False))


async def stream_batches(policy: SafetyPolicy, parts: list[str], rng: random.Random) -> tuple:
    """Like `stream`, with several deltas in one batch now and then (a burst of tokens)."""
    window, out, at = SafetyWindow(policy, 1, Meter()), [], 0
    while at < len(parts):
        take = rng.choice([1, 1, 2, 3])
        out += await window.feed([TextDelta(p) for p in parts[at : at + take]])
        at += take
    out += await window.feed([Finish("stop")])
    return "".join(e.text for e in out if type(e) is TextDelta), out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=seeded_text(), seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(POLICIES))
async def test_released_text_is_the_same_for_every_split_and_never_holds_a_blocked_term(
    text, seed, policy
):
    rng = random.Random(seed)
    whole, whole_events, _, _ = await stream(policy, [text])
    for _ in range(3):
        sizes = [rng.randint(1, 6) for _ in range(len(text))]
        released, events = await stream_batches(policy, pieces(text, sizes), rng)
        assert released == whole
        assert events[-1] == whole_events[-1]
        assert TERM.lower() not in released.lower()
        for secret in [*SECRETS, PEM_BODY]:
            assert secret not in released
