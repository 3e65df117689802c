"""Hostile and malformed input against a real `sluice serve` with its default limits: always an
OpenAI-shaped 4xx naming what was wrong, never a 5xx, never an echo of the request."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.serve import Served, serving
from tests.support.waiting import until_sync

BODY_TIMEOUT = 2.0
MAX_PENDING = 8


@pytest.fixture(scope="module")
def log_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "gateway.log"


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, log_file) -> Served:
    flags = ("--body-timeout", str(BODY_TIMEOUT), "--max-pending-connections", str(MAX_PENDING))
    with (
        log_file.open("wb") as log,
        serving(tiny_model_dir, *flags, stderr=log, env={"SLUICE_LOG_LEVEL": "info"}) as served,
    ):
        yield served


@pytest.fixture(scope="module")
def model(gateway) -> str:
    return httpx.get(f"{gateway.base_url}/models", headers=gateway.auth).json()["data"][0]["id"]


def post(gateway: Served, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/chat/completions",
        json=body,
        headers={**gateway.auth, **headers},
        timeout=60,
    )


def expect_error(resp: httpx.Response, status: int, param: str | None, code: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert set(error) == {"message", "type", "param", "code"}
    assert resp.headers["x-should-retry"] == "false"
    assert resp.headers["x-request-id"].startswith("req_")


USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"messages": [{"role": [], "content": "Hi"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": {}, "content": "Hi"}]}, "messages[0].role", "invalid_value"),
        ({"tool_choice": []}, "tool_choice", "invalid_value"),
        ({"tool_choice": {}}, "tool_choice", "invalid_value"),
        ({"response_format": {"type": []}}, "response_format.type", "invalid_value"),
        ({"response_format": {"type": {}}}, "response_format.type", "invalid_value"),
        (  # the worker's rule, as OpenAI's: no tool_choice without tools
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "invalid_value",
        ),
    ],
)
def test_wrong_json_types_are_400s_naming_the_field(gateway, model, extra, param, code):
    expect_error(post(gateway, {"model": model, "messages": [USER], **extra}), 400, param, code)


def test_a_prompt_over_the_workers_old_limit_reaches_the_worker(gateway, model):
    """1.1 MB of prompt is under the gateway's 4 MiB: the worker takes it too, and says the
    prompt is longer than the model's context (the field named), instead of a 502."""
    huge = {"role": "user", "content": "word " * 220_000}
    expect_error(
        post(gateway, {"model": model, "messages": [huge]}),
        400,
        "messages",
        "context_length_exceeded",
    )


def test_an_over_long_stop_string_is_a_400_naming_stop(gateway, model):
    body = {"model": model, "messages": [USER], "stop": "x" * (1024 * 1024)}
    expect_error(post(gateway, body), 400, "stop", "invalid_value")


def test_a_body_over_the_gateways_limit_is_413(gateway, model):
    huge = {"role": "user", "content": "x" * (4 * 1024 * 1024 + 1)}
    expect_error(
        post(gateway, {"model": model, "messages": [huge]}), 413, None, "request_too_large"
    )


def connect(gateway: Served) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=BODY_TIMEOUT * 5)
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP answer read off a raw socket; the gateway then
    closes the connection."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {raw!r}"
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    while chunk := sock.recv(65536):  # to the end: the connection must close after it
        body += chunk
    assert len(body) == int(headers["content-length"])
    return int(lines[0].split()[1]), headers, body


def raw_request(gateway: Served, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with connect(gateway) as sock:
        sock.sendall(data)
        return read_answer(sock)


def test_an_oversized_header_is_json_and_echoes_no_credential(gateway, log_file):
    secret = "k" * 9000
    status, headers, body = raw_request(
        gateway,
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + secret.encode()
        + b"\r\n\r\n",
    )
    assert status == 431
    assert headers["content-type"].startswith("application/json")
    assert headers["x-request-id"].startswith("req_")
    assert orjson.loads(body)["error"]["code"] == "header_too_large"
    assert b"kkkk" not in body and b"Bearer" not in body
    until_sync(lambda: "request refused by the http parser" in log_file.read_text(), "the log line")
    assert "kkkk" not in log_file.read_text()


def test_a_control_character_in_a_header_is_json_and_not_echoed(gateway, log_file):
    status, headers, body = raw_request(
        gateway,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Idempotency-Key: abc\x01def\r\nContent-Length: 0\r\n\r\n",
    )
    assert status == 400
    assert headers["x-request-id"].startswith("req_")
    error = orjson.loads(body)["error"]
    assert error["code"] in ("invalid_header", "invalid_http_request")
    assert b"abc" not in body and b"Idempotency" not in body
    assert "abc\\x01" not in log_file.read_text() and "abcdef" not in log_file.read_text()


def test_a_body_that_stops_arriving_is_answered_408(gateway):
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {gateway.key}\r\nContent-Length: 100\r\n\r\n"
    )
    began = time.monotonic()
    status, headers, body = raw_request(gateway, head.encode() + b'{"')
    assert status == 408
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert headers["x-request-id"].startswith("req_")
    assert BODY_TIMEOUT * 0.9 <= time.monotonic() - began < BODY_TIMEOUT * 4


def test_a_request_head_that_stops_arriving_is_answered_408(gateway):
    began = time.monotonic()
    status, _, body = raw_request(gateway, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    assert status == 408
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT * 0.9 <= time.monotonic() - began < BODY_TIMEOUT * 4


def test_pending_connections_are_bounded_oldest_first(gateway, model):
    idle = [connect(gateway) for _ in range(MAX_PENDING * 2)]
    try:
        # the oldest MAX_PENDING were closed (with a 408) to make room for the newest
        for sock in idle[:MAX_PENDING]:
            status, _, _ = read_answer(sock)
            assert status == 408
        # a real client still gets served meanwhile
        resp = post(gateway, {"model": model, "messages": [USER], "max_tokens": 2})
        assert resp.status_code == 200
    finally:
        for sock in idle:
            sock.close()


def stalled_mid_body(gateway: Served, body: bytes) -> socket.socket:
    """A connection whose request head the gateway has taken (it answered `100 Continue`) and
    whose body is all there but its last byte."""
    sock = connect(gateway)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {gateway.key}\r\nContent-Length: {len(body)}\r\n"
        "Expect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode())
    answer = b""
    while not answer.endswith(b"\r\n\r\n"):
        chunk = sock.recv(1)
        assert chunk, f"closed before 100 Continue: {answer!r}"
        answer += chunk
    assert answer == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.sendall(body[:-1])
    return sock


def test_connections_stalled_mid_body_are_bounded_oldest_first(gateway, model):
    body = orjson.dumps({"model": model, "messages": [USER], "max_tokens": 1})
    began = time.monotonic()
    stalled = [stalled_mid_body(gateway, body) for _ in range(MAX_PENDING * 2)]
    try:
        # the oldest MAX_PENDING were refused to make room for the newest, sooner than their
        # body timeout could have
        for sock in stalled[:MAX_PENDING]:
            status, _, answer = read_answer(sock)
            assert status == 408
            assert orjson.loads(answer)["error"] == {
                "message": "The request body did not arrive in time.",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        assert time.monotonic() - began < BODY_TIMEOUT
        # the newest MAX_PENDING are still waiting for their last byte, and then served
        for sock in stalled[MAX_PENDING:]:
            sock.sendall(body[-1:])
        for sock in stalled[MAX_PENDING:]:
            status, _, answer = read_answer(sock)
            assert status == 200, answer
    finally:
        for sock in stalled:
            sock.close()
