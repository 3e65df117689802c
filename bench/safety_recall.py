"""How well the safety window's built-in detectors redact what streams through it.

A generated corpus of responses (`--responses`, default 1,000): prose with planted e-mails,
phone numbers, valid card numbers and secrets of every built-in kind, and look-alikes that must
survive (cards failing the Luhn check, dates, order numbers, versions, prices); some cards are
written next to other digits (an expiry, a CVV, an amount before them). A quarter of the
responses also carry a blocked term. Each response goes through the real window (the stage a
run's pipeline uses) in random chunkings (`--splits`, 1-8 characters a chunk), and the table
gives, per detector: recall (planted items that never appeared in the output) and, with that
detector alone in the policy, its redactions and precision (those that covered a planted item of
its kind); overall precision (redactions that covered a planted item, of all redactions) and
look-alikes kept; and for the
blocked term, how many responses let any of it through (target: 0), plus the split-invariance
(the released text is the same for every chunking).

    .venv/bin/python bench/safety_recall.py
    .venv/bin/python bench/safety_recall.py --responses 200 --splits 2 --seed 7
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adapters.events import Finish, TextDelta
from safety.detectors import luhn_valid
from safety.policy import REDACTION, SafetyPolicy
from safety.window import SafetyWindow

TERM = "Project Nightingale"
POLICY = SafetyPolicy.build(
    "recall", window_chars=32, block_terms=(TERM,), redact=("email", "phone", "card", "secret")
)
WORDS = [
    "the",
    "a",
    "report",
    "says",
    "we",
    "will",
    "ship",
    "it",
    "soon",
    "and",
    "then",
    "review",
    "all",
    "of",
    "those",
    "results",
    "again",
]


# each detector on its own, for its precision: its redactions that covered an item of its kind
DETECTOR_ALONE = {
    kind: SafetyPolicy.build(kind, window_chars=32, redact=(kind,))
    for kind in ("email", "phone", "card", "secret")
}


class NullMeter:
    def action(self, action: str) -> None:
        pass

    def held(self, seconds: float) -> None:
        pass


def _alnum(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits):
    return "".join(rng.choice(alphabet) for _ in range(n))


def card(rng: random.Random, valid: bool = True) -> str:
    digits = [rng.choice("3456")] + [rng.choice(string.digits) for _ in range(14)]
    check = next(d for d in string.digits if luhn_valid("".join(digits) + d))
    if not valid:
        check = str((int(check) + rng.randint(1, 9)) % 10)
    number = "".join(digits) + check
    sep = rng.choice(["", " ", "-"])
    return sep.join(number[i : i + 4] for i in range(0, 16, 4))


def card_beside_digits(rng: random.Random) -> tuple[str, str]:
    """A valid card written next to other digits, as (the text, the card): its expiry, its
    CVV, or an amount before it."""
    number = card(rng)
    return rng.choice(
        [
            (f"{number} {rng.randint(1, 12):02d}/{rng.randint(26, 31)}", number),
            (f"{number} {rng.randint(100, 999)}", number),
            (f"{rng.randint(1, 9)} {number}", number),
        ]
    )


def email(rng: random.Random) -> str:
    user = rng.choice(["ann", "bob.smith", "c_d", "eve+news", "j.doe42"])
    domain = rng.choice(["example.com", "mail.example.co.uk", "corp-x.io", "uni.edu"])
    return f"{user}@{domain}"


def phone(rng: random.Random) -> str:
    d = lambda n: "".join(rng.choice(string.digits) for _ in range(n))  # noqa: E731
    return rng.choice(
        [
            f"({d(3)}) {d(3)}-{d(4)}",
            f"{d(3)}-{d(3)}-{d(4)}",
            f"{d(3)}.{d(3)}.{d(4)}",
            f"+1 {d(3)} {d(3)} {d(4)}",
            f"+44 20 {d(4)} {d(4)}",
            f"+49 30 {d(3)} {d(5)}",
        ]
    )


def secret(rng: random.Random) -> str:
    return rng.choice(
        [
            "sk-" + _alnum(rng, 48),
            "sk-proj-" + _alnum(rng, 40),
            "AKIA" + _alnum(rng, 16, string.ascii_uppercase + string.digits),
            "ghp_" + _alnum(rng, 36),
            "xoxb-" + "-".join(_alnum(rng, 12, string.digits) for _ in range(2)),
            "AIza" + _alnum(rng, 35),
            "eyJ" + _alnum(rng, 20) + ".eyJ" + _alnum(rng, 30) + "." + _alnum(rng, 43),
            "-----BEGIN PRIVATE KEY-----\n" + _alnum(rng, 64) + "\n-----END PRIVATE KEY-----",
        ]
    )


def look_alike(rng: random.Random) -> str:
    return rng.choice(
        [
            card(rng, valid=False),
            f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            f"order {rng.randint(10000, 99999)}",
            f"v{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}",
            f"${rng.randint(1, 9)},{rng.randint(100, 999)}.{rng.randint(10, 99)}",
            f"{rng.randint(1, 12)}:{rng.randint(10, 59)} pm",
        ]
    )


MAKERS = {"email": email, "phone": phone, "card": card, "secret": secret}


def response(rng: random.Random) -> tuple[str, list[tuple[str, str]], list[str], bool]:
    """A text, its planted (kind, item)s, its look-alikes, and whether it holds the term."""
    parts, planted, alikes = [], [], []
    blocked = rng.random() < 0.25
    for i in range(rng.randint(4, 9)):
        parts += rng.sample(WORDS, rng.randint(2, 6))
        roll = rng.random()
        if roll < 0.05:
            text, item = card_beside_digits(rng)
            planted.append(("card", item))
            parts.append(text)
        elif roll < 0.55:
            kind = rng.choice(list(MAKERS))
            item = MAKERS[kind](rng)
            planted.append((kind, item))
            parts.append(item)
        elif roll < 0.85:
            item = look_alike(rng)
            alikes.append(item)
            parts.append(item)
        if blocked and i == 2:
            parts.append(rng.choice([TERM, TERM.lower(), TERM.upper()]))
        parts[-1] += rng.choice([",", ".", "", ";"])
    return " ".join(parts) + ".", planted, alikes, blocked


async def released(text: str, rng: random.Random, policy: SafetyPolicy = POLICY) -> tuple[str, str]:
    window = SafetyWindow(policy, 1, NullMeter())
    out, at = [], 0
    while at < len(text):
        size = rng.randint(1, 8)
        out += await window.feed([TextDelta(text[at : at + size])])
        at += size
    out += await window.feed([Finish("stop")])
    finish = next(e.reason for e in out if type(e) is Finish)
    return "".join(e.text for e in out if type(e) is TextDelta), finish


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    stats = {k: {"planted": 0, "caught": 0} for k in MAKERS}
    alike_total = alike_kept = term_leaks = blocked_total = variant = 0
    redactions = true_redactions = 0
    alone = {k: {"redactions": 0, "true": 0} for k in MAKERS}
    started = time.process_time()
    for _ in range(args.responses):
        text, planted, alikes, blocked = response(rng)
        outs = {await released(text, rng) for _ in range(args.splits)}
        if not blocked:
            for kind, policy in DETECTOR_ALONE.items():
                out, _ = await released(text, rng, policy)
                alone[kind]["redactions"] += out.count(REDACTION)
                alone[kind]["true"] += sum(k == kind and i not in out for k, i in planted)
        variant += len(outs) > 1
        out, finish = next(iter(outs))
        if blocked:
            blocked_total += 1
            term_leaks += TERM.lower() in out.lower() or finish != "content_filter"
            continue
        for kind, item in planted:
            stats[kind]["planted"] += 1
            stats[kind]["caught"] += item not in out
        true_redactions += sum(item not in out for _, item in planted)
        redactions += out.count(REDACTION)
        alike_total += len(alikes)
        alike_kept += sum(a in out for a in alikes)
    cpu = time.process_time() - started
    print(
        f"{'detector':<8} {'planted':>8} {'recall':>8} | {'alone: redactions':>17} {'precision':>9}"
    )
    print("-" * 56)
    for kind, s in stats.items():
        a = alone[kind]
        print(
            f"{kind:<8} {s['planted']:>8} {s['caught'] / max(s['planted'], 1):>8.2%} | "
            f"{a['redactions']:>17} {a['true'] / max(a['redactions'], 1):>9.2%}"
        )
    print()
    precision = true_redactions / max(redactions, 1)
    print(f"precision (redactions covering a planted item): {precision:.2%}")
    print(f"look-alikes kept: {alike_kept}/{alike_total} ({alike_kept / max(alike_total, 1):.2%})")
    print(f"responses with the blocked term: {blocked_total}, any of it sent: {term_leaks}")
    print(f"responses whose output depended on the chunking: {variant}")
    print(f"CPU: {cpu:.1f} s for {args.responses * args.splits} streamed responses")
    return 1 if term_leaks or variant else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--responses", type=int, default=1000)
    p.add_argument("--splits", type=int, default=3, help="random chunkings of each response")
    p.add_argument("--seed", type=int, default=1)
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
