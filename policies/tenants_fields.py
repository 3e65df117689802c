"""Typed reads from a tenants-file table, failing with the file, the tenant and the field named.

Kept apart from the tenant model so that policies/tenants.py reads as "what a tenant is" and this
file as "what counts as a valid value".
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any, NoReturn

_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class TenantsFileError(ValueError):
    """A message that names the file, the tenant and the field (never a key or a secret)."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        tenant: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.tenant = tenant
        self.field = field


class Section:
    """A table of the file (a tenant, `[jwt]`, …): reads its fields, or fails naming them."""

    def __init__(self, path: Path, label: str, tenant: str | None = None) -> None:
        self.path, self.label, self.tenant = path, label, tenant

    def fail(self, name: str, problem: str) -> NoReturn:
        raise TenantsFileError(
            f"{self.path}: {self.label}: field {name!r}: {problem}",
            path=str(self.path),
            tenant=self.tenant,
            field=name,
        )

    def reject_unknown(self, table: dict[str, Any], known: tuple[str, ...]) -> None:
        for name in table:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
                self.fail(name, f"unknown field ({hint})")

    def positive_int(self, table: dict[str, Any], name: str) -> int | None:
        value = table.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(name, f"expected a positive integer, got {value!r}")
        return value

    def amount(self, table: dict[str, Any], name: str) -> float | None:
        """An amount of money: a finite number, at least 0."""
        value = table.get(name)
        if value is None:
            return None
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not 0 <= value < math.inf:
            self.fail(name, f"expected a number at least 0, got {value!r}")
        return float(value)

    def seconds(self, table: dict[str, Any], name: str, *, allow_zero: bool) -> float | None:
        value = table.get(name)
        if value is None:
            return None
        try:
            seconds = parse_duration(value)
        except ValueError:
            self.fail(name, f'expected seconds or a duration ("30d", "12h", "90m"), got {value!r}')
        if seconds < 0 or (seconds == 0 and not allow_zero):
            self.fail(name, f"must be {'at least 0' if allow_zero else 'positive'}, got {value!r}")
        return seconds

    def text(self, table: dict[str, Any], name: str) -> str | None:
        value = table.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            self.fail(name, f"expected a non-empty string, got {value!r}")
        return value

    def strings(self, table: dict[str, Any], name: str) -> tuple[str, ...] | None:
        value = table.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(name, f"expected a list of non-empty strings, got {value!r}")
        return tuple(value)


def parse_duration(value: object) -> float:
    """Seconds from a number or from "30d" / "12h" / "90m" / "45s"."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match[1]) * _UNIT_SECONDS[match[2]]
    else:
        raise ValueError(f"not a duration: {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite duration: {value!r}")
    return seconds
