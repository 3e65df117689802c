"""structlog set-up: one JSON object per line, secrets redacted before anything is written."""

from __future__ import annotations

import logging
import re
import sys

import structlog

_SECRET_KEYS = frozenset({"authorization", "api_key", "key", "token", "password", "secret"})
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"']+")
_SLUICE_KEY = re.compile(r"sk-sluice-[A-Za-z0-9_-]+")


def redact_secrets(_logger: object, _name: str, event: dict) -> dict:
    """Drop values of secret-named fields and mask bearer tokens and keys inside strings."""
    for key, value in list(event.items()):
        if key.lower() in _SECRET_KEYS:
            event[key] = "[REDACTED]"
        elif isinstance(value, str):
            event[key] = _SLUICE_KEY.sub("[REDACTED]", _BEARER.sub(r"\1[REDACTED]", value))
    return event


def configure_logging(level: str = "info", json: bool = True) -> None:
    logging.basicConfig(stream=sys.stderr, format="%(message)s", level=level.upper())
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
