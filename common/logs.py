"""One log format for every sluicegate process, the gateway's and the workers': structlog JSON
lines on stderr (timestamp in UTC, level, event, fields), library lines (aiohttp, redis,
transformers) in the same shape, and secrets redacted before anything is written.

It lives beside the workers' other torch-free shared parts (limits.py) so the gateway and the
worker both import it, and neither imports the other's process code."""

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


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a line is logged."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _stdlib_handler(renderer: structlog.typing.Processor) -> logging.Handler:
    """Lines from libraries' stdlib loggers (aiohttp, redis) in the same shape, redacted too."""
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                redact_secrets,
                renderer,
            ],
        )
    )
    return handler


def configure_logging(level: str = "info", json: bool = True) -> None:
    """Configure structlog and the stdlib root logger for this process."""
    if json:
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
        text_renderer = structlog.processors.JSONRenderer(
            serializer=lambda obj, **_: orjson.dumps(obj).decode()
        )
    else:
        renderer = text_renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    root = logging.getLogger()
    root.handlers[:] = [_stdlib_handler(text_renderer)]
    root.setLevel(level.upper())
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
