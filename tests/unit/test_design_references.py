"""The project carries its own design (docs/design.md), and every `design §N` reference in the
code, the tests and the docs points at a section it has: each number of a list (`design §1,
§6`) and of a range (`design §2-§4`), in every file git tracks or would add."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# NOTE: a reference may wrap onto the next line, inside a comment as well: `design` and its
# numbers are apart by any mix of whitespace and comment marks.
_GAP = r"[\s#]*"
EN_DASH = "\u2013"
_SEPARATOR = rf"(?:,\s*and|,|and|-|{EN_DASH})"  # a list, or a range (`-` or an en dash)
REFERENCE = re.compile(rf"design(?:\.md)?{_GAP}§\d+(?:{_GAP}{_SEPARATOR}{_GAP}§\d+)*")
ITEM = re.compile(rf"(?:({_SEPARATOR}){_GAP})?§(\d+)")


def sections() -> set[int]:
    text = (ROOT / "docs" / "design.md").read_text()
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, flags=re.MULTILINE)}


def cited(text: str) -> list[int]:
    """Every section number the references in `text` name, ranges spelled out, in order."""
    numbers: list[int] = []
    for reference in REFERENCE.finditer(text):
        for separator, digits in ITEM.findall(reference.group()):
            n = int(digits)
            if separator in ("-", EN_DASH):
                numbers += range(numbers[-1] + 1, n + 1)
            else:
                numbers.append(n)
    return numbers


def project_files() -> list[Path]:
    """The .py and .md files git tracks, and the new ones it does not ignore (so `.venv` and
    build output stay out), less the design itself."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    paths = [ROOT / name for name in listed if name != "docs/design.md"]
    return [path for path in paths if path.is_file()]  # a deletion not yet staged is gone


def references() -> list[tuple[str, int]]:
    return [
        (str(path.relative_to(ROOT)), n)
        for path in project_files()
        for n in cited(path.read_text())
    ]


def test_lists_and_ranges_name_every_number():
    assert cited("(design §1, §6)") == [1, 6]
    assert cited("tenants file (design §5, §9).") == [5, 9]
    assert cited("lapses (design §2-§4).") == [2, 3, 4]
    assert cited("design §2-§4, §7 and §9") == [2, 3, 4, 7, 9]
    assert cited(f"design §5{EN_DASH}§6, and §1") == [5, 6, 1]
    assert cited("(design §3, gateway/http/backpressure.py)") == [3]
    assert cited("the design\n    # §12, §13 here") == [12, 13]
    assert cited("docs/design.md §8") == [8]
    assert cited("RFC 7518 §3.2; design.md's sections") == []


@pytest.mark.process  # `git ls-files`
def test_every_folder_is_scanned():
    folders = {path.relative_to(ROOT).parts[0] for path in project_files()}
    assert {"gateway", "adapters", "policies", "safety", "workers", "testkit"} <= folders
    assert {"tests", "bench", "docs", "README.md"} <= folders
    assert ".venv" not in folders


@pytest.mark.process  # `git ls-files`
def test_every_reference_resolves():
    known = sections()
    refs = references()
    assert len(refs) > 20  # the code does point here
    assert {"safety/window.py", "gateway/backends/from_settings.py"} <= {path for path, _ in refs}
    assert [r for r in refs if r[1] not in known] == []


def test_the_sections_are_numbered_in_order():
    assert sorted(sections()) == list(range(1, max(sections()) + 1))
