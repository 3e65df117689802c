"""A local worker that dies or hangs, under a real `sluice serve` on the tiny model: the gateway
restarts a dead one, refuses work at once while a hung one is not ready, and never leaves a
streaming client without headers and heartbeats."""

from __future__ import annotations

import re
import signal
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serve import Served, serving
from tests.support.waiting import until_sync

# alone (tests/support/tiers.py): it times how soon killed and hung workers are noticed
pytestmark = pytest.mark.alone

PING = 1.0
TOKEN = re.compile(rb'"delta":\{"content":"[^"]')  # a chunk with text (the role chunk has none)


def metric(gateway: Served, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.root}/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(check, timeout: float, what: str):
    return until_sync(check, what, within=timeout)


def ready(gateway: Served) -> bool:
    return httpx.get(f"{gateway.root}/readyz").status_code == 200


def chat(gateway: Served, **extra) -> httpx.Response:
    body = {"model": model_id(gateway), "messages": [{"role": "user", "content": "Hi"}]}
    return httpx.post(
        f"{gateway.base_url}/chat/completions",
        json={"max_tokens": 4, **body, **extra},
        headers=gateway.auth,
        timeout=30,
    )


def model_id(gateway: Served) -> str:
    return httpx.get(f"{gateway.base_url}/models", headers=gateway.auth).json()["data"][0]["id"]


def test_a_killed_worker_is_restarted_and_serves_again(tiny_model_dir, tmp_path):
    log_path = tmp_path / "gateway.log"
    info = {"SLUICE_LOG_LEVEL": "info"}
    with log_path.open("wb") as log, serving(tiny_model_dir, stderr=log, env=info) as gateway:
        first = gateway.worker_process()
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # while it restarts: the request waits for it (tests/e2e/test_worker_restart.py)
        assert chat(gateway).status_code == 200
        wait_until(lambda: ready(gateway) and chat(gateway).status_code == 200, 60, "restart")
        assert gateway.worker_process().pid != first.pid
        assert metric(gateway, "sluice_local_worker_exits_total", reason="signal:SIGKILL") == 1
        assert metric(gateway, "sluice_local_worker_restarts_total") == 1
        assert metric(gateway, "sluice_local_worker_crash_looping") == 0
    text = log_path.read_text()
    assert '"worker exited"' in text and "signal:SIGKILL" in text
    assert '"worker restarted"' in text


def read_until(sock: socket.socket, marker: bytes, timeout: float) -> tuple[bytes, float]:
    """Bytes off the socket up to and including `marker`, and when it was seen."""
    sock.settimeout(timeout)
    raw = b""
    while marker not in raw:
        chunk = sock.recv(65536)
        assert chunk, raw
        raw += chunk
    return raw, time.monotonic()


def open_stream(gateway: Served, model: str, max_tokens: int) -> socket.socket:
    body = (
        f'{{"model": "{model}", "stream": true, "max_tokens": {max_tokens}, "temperature": 0,'
        ' "messages": [{"role": "user", "content": "Hi"}]}'
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {gateway.key}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
    sock.sendall(head.encode() + body)
    return sock


def test_a_hung_worker_refuses_new_work_and_streams_get_headers_and_pings(tiny_model_dir):
    with serving(tiny_model_dir, "--ping-interval", str(PING)) as gateway:
        model = model_id(gateway)
        worker = gateway.worker_process()
        worker.send_signal(signal.SIGSTOP)
        try:
            # a stream sent before the gateway noticed is not left in the dark: a 503, or
            # headers within one heartbeat interval and then heartbeats
            sent = time.monotonic()
            sock = open_stream(gateway, model, 4)
            raw, at = read_until(sock, b"\r\n\r\n", PING * 5)
            if raw.startswith(b"HTTP/1.1 200"):
                assert at - sent < PING * 3
                _, pinged = read_until(sock, b": ping", PING * 5)
                assert pinged - sent < PING * 5
            else:
                assert raw.startswith(b"HTTP/1.1 503")
            sock.close()
            # once noticed: a 503 overloaded at once, and /readyz says so
            wait_until(lambda: not ready(gateway), 10, "the hang to be noticed")
            began = time.monotonic()
            refused = chat(gateway, stream=True)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "overloaded"
            assert int(refused.headers["retry-after"]) >= 1
            assert time.monotonic() - began < 1.0
        finally:
            worker.send_signal(signal.SIGCONT)
        wait_until(lambda: ready(gateway) and chat(gateway).status_code == 200, 30, "recovery")


def test_a_stream_queued_behind_others_gets_its_headers_role_and_pings(tiny_model_dir):
    env = {"SLUICE_MAX_NUM_SEQS": "1"}  # serve hands it to its worker: one sequence at a time
    with serving(tiny_model_dir, "--ping-interval", str(PING), env=env) as gateway:
        model = model_id(gateway)
        # NOTE: one 800-token run of the tiny model can end within the pings' wait, so three
        # run one after another in front of the queued stream. The gateway sends a worker two
        # batches (design §12): the first generates, the second waits in the engine's queue,
        # the third and the queued stream wait in the gateway's.
        blockers = [open_stream(gateway, model, 900) for _ in range(3)]
        read_until(blockers[0], b'"delta":{"content":', 30)  # the first one is generating
        raw, _ = read_until(blockers[1], b'"role":"assistant"', PING)  # the worker accepted it
        assert not TOKEN.search(raw)
        sent = time.monotonic()
        queued = open_stream(gateway, model, 4)
        raw, at = read_until(queued, b"\r\n\r\n", PING * 3)  # headers, its id among them
        assert raw.startswith(b"HTTP/1.1 200") and at - sent < PING * 1.5
        assert re.search(rb"x-sluice-run-id: chatcmpl-[0-9a-f]+", raw, re.IGNORECASE)
        raw, _ = read_until(queued, b": ping", PING * 4)
        assert not TOKEN.search(raw)  # still queued: pings before any token
        for blocker in blockers:
            blocker.close()  # their runs are cancelled after the grace window; the queued one runs
        read_until(queued, b"data: [DONE]", 60)
        queued.close()
