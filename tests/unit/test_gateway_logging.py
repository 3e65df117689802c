"""Logs never carry secrets; metrics histograms expose the standard family."""

from __future__ import annotations

import logging

import orjson
import pytest
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.logs import configure_logging, redact_secrets
from gateway.metrics import LoopHistogram


def test_secret_fields_and_embedded_keys_are_redacted():
    event = {
        "event": "x",
        "authorization": "Bearer abc",
        "api_key": "sk-sluice-abc",
        "detail": "header was 'Bearer sk-live-123' and key sk-sluice-AbC_9-x used",
        "count": 3,
    }
    out = redact_secrets(None, "info", event)
    assert out["authorization"] == "[REDACTED]" and out["api_key"] == "[REDACTED]"
    assert "sk-live-123" not in out["detail"] and "sk-sluice-AbC" not in out["detail"]
    assert out["detail"].count("[REDACTED]") == 2
    assert out["count"] == 3


def test_loop_histogram_exposes_cumulative_buckets():
    registry = CollectorRegistry()
    h = LoopHistogram("sluice_test_seconds", "doc", [0.1, 1.0], registry)
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    (family,) = text_string_to_metric_families(generate_latest(registry).decode())
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("sluice_test_seconds_bucket", "0.1")] == 2
    assert samples[("sluice_test_seconds_bucket", "1.0")] == 3
    assert samples[("sluice_test_seconds_bucket", "+Inf")] == 4
    assert samples[("sluice_test_seconds_count", None)] == 4
    assert abs(samples[("sluice_test_seconds_sum", None)] - 3.65) < 1e-9


@pytest.fixture
def configured_logging():
    """The serve process's logging set-up, undone afterwards (it is process-wide)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("info")
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def test_library_log_lines_are_json_and_redacted(configured_logging, capsys):
    try:
        raise ValueError("Got more than 8190 bytes when reading: b'Bearer kkkk'")
    except ValueError:
        logging.getLogger("aiohttp.server").exception("Error handling request")
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "Error handling" in x]
    record = orjson.loads(line)
    assert record["logger"] == "aiohttp.server" and record["level"] == "error"
    assert "kkkk" not in line and "[REDACTED]" in record["exception"]
