"""The project carries its own design (docs/design.md), and every `design §N` reference in the
code, the tests and the docs points at a section it has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"design §(\d+)(?:-§(\d+))?")


def sections() -> set[int]:
    text = (ROOT / "docs" / "design.md").read_text()
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, flags=re.MULTILINE)}


def references() -> list[tuple[str, int]]:
    found = []
    for folder in (
        "gateway",
        "adapters",
        "policies",
        "workers",
        "testkit",
        "tests",
        "bench",
        "docs",
    ):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".md") or path.name == "design.md":
                continue
            for match in REFERENCE.finditer(path.read_text()):
                first, last = int(match.group(1)), int(match.group(2) or match.group(1))
                found += [(str(path.relative_to(ROOT)), n) for n in range(first, last + 1)]
    return found


def test_every_reference_resolves():
    known = sections()
    refs = references()
    assert len(refs) > 20  # the code does point here
    assert [r for r in refs if r[1] not in known] == []


def test_the_sections_are_numbered_in_order():
    assert sorted(sections()) == list(range(1, max(sections()) + 1))
