"""The worker engine's typed outputs as the dicts the worker puts on the wire."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from wire.api import Line


def wire(lines: Iterable[Line]) -> list[dict[str, Any]]:
    return [line.wire() for line in lines]
