"""structlog set-up: one JSON object per line, secrets redacted before anything is written."""

from __future__ import annotations

import logging
import re
import sys

import orjson
import structlog

_SECRET_KEYS = frozenset({"authorization", "api_key", "key", "token", "password", "secret"})
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"']+")
_SLUICE_KEY = re.compile(r"sk-sluice-[A-Za-z0-9_-]+")


def _mask(value: str) -> str:
    # NOTE: the substring checks keep the regexes off the common path (one log line per request).
    if "sk-sluice-" in value:
        value = _SLUICE_KEY.sub("[REDACTED]", value)
    if "earer" in value or "EARER" in value:
        value = _BEARER.sub(r"\1[REDACTED]", value)
    return value


def redact_secrets(_logger: object, _name: str, event: dict) -> dict:
    """Drop values of secret-named fields and mask bearer tokens and keys inside strings."""
    for key, value in event.items():
        if key.lower() in _SECRET_KEYS:
            event[key] = "[REDACTED]"
        elif isinstance(value, str):
            event[key] = _mask(value)
    return event


def configure_logging(level: str = "info", json: bool = True) -> None:
    logging.basicConfig(stream=sys.stderr, format="%(message)s", level=level.upper())
    if json:
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
    else:
        renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
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
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
