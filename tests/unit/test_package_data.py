"""Every file the installed package needs beside its modules (the pages the gateway serves, the
kernel sources a worker builds) is named in pyproject.toml's package-data: a file left out is
missing only from an installed gateway (`.ci/gateway-only`), never from this checkout."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = {".py", ".pyc", ".typed"}


def test_every_data_file_of_a_package_is_declared():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = config["package-data"]
    missing = []
    for package in ("gateway", "workers", "adapters", "policies", "safety", "wire", "common"):
        for path in (ROOT / package).rglob("*"):
            if not path.is_file() or path.suffix in SKIPPED or "__pycache__" in path.parts:
                continue
            inner = path.relative_to(ROOT / package).as_posix()
            if not any(fnmatch(inner, pattern) for pattern in declared.get(package, [])):
                missing.append(f"{package}/{inner}")
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
