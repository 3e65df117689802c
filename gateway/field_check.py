"""The fields an API's request may carry: the ones it honours, and the ones it knows but
refuses unless they are null or neutral. Shared by the Responses and Messages parsers, which
rewrite their body as a chat request and must not let an unknown field pass silently."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Any

from gateway.http.errors import invalid_request
from wire.limits import shown

MAX_NAMED = 40  # a longer field name is not repeated as the error's param: it is no field


def check_fields(
    body: dict[str, Any],
    honoured: Container[str],
    refused: Mapping[str, Any],
    unknown: Callable[[str], str],
) -> None:
    """A 400 naming the first field of `body` that is neither honoured nor, when refused, at
    its neutral value (`refused[name]`, or null); `unknown(shown_name)` words an unknown one."""
    for name, value in body.items():
        if name in honoured:
            continue
        if name not in refused:
            param = name if len(name) <= MAX_NAMED else None
            raise invalid_request(param, unknown(shown(name)), code="unknown_parameter")
        if value is not None and value != refused[name]:
            raise invalid_request(
                name, f"'{name}' is not supported by sluicegate.", code="unsupported_parameter"
            )
