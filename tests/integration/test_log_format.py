"""Every sluicegate process logs in one format (common/logs.py): a real worker's lines are JSON
objects of the same shape as the gateway's, library lines included, with no secret in them."""

from __future__ import annotations

import io
import re
import socket
import sys

import httpx
import orjson
import structlog

from common.logs import configure_logging
from tests.support.worker_process import running_worker

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z$")


def entry(line: bytes) -> dict:
    """One line, checked: a JSON object with an ISO UTC timestamp, a level and an event."""
    parsed = orjson.loads(line)
    assert ISO_UTC.match(parsed["timestamp"]), parsed
    assert parsed["level"] in {"debug", "info", "warning", "error", "critical"}, parsed
    assert isinstance(parsed["event"], str) and parsed["event"], parsed
    return parsed


def test_a_worker_logs_like_the_gateway(tiny_model_dir, tmp_path, monkeypatch):
    with running_worker(tiny_model_dir, tmp_path) as worker:
        # a header past aiohttp's limit: its parser logs the error through the stdlib logger
        with socket.create_connection(("127.0.0.1", worker.port)) as raw:
            raw.sendall(b"GET /health HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n")
            assert raw.recv(12) == b"HTTP/1.0 400"
        assert httpx.get(f"{worker.url}/health").status_code == 200
        worker.proc.terminate()
        worker.proc.wait(10)
    lines = [line for line in worker.log.read_bytes().splitlines() if line.strip()]
    entries = [entry(line) for line in lines]  # every line, the library's included
    events = {(e["event"], e.get("logger")) for e in entries}
    assert {("worker ready", None), ("worker stopping", None)} <= events
    assert ("Error handling request from 127.0.0.1", "aiohttp.server") in events

    buffer = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(buffer))
    structlog.reset_defaults()
    try:
        configure_logging("info")
        structlog.get_logger("sluice.gateway").info("run end", api_key="sk-sluice-abc")
        sys.stderr.flush()
    finally:
        structlog.reset_defaults()
    (gateway_line,) = buffer.getvalue().splitlines()
    assert entry(gateway_line)["api_key"] == "[REDACTED]"
