"""Redis going away under a real `sluice serve --redis-url`: a private redis-server killed, hung
(SIGSTOP) and restarted by PID while streams run. Live runs ride out an outage shorter than the
grace, end with one `store_unavailable` frame past it, never get bytes after their end, and
leave exactly one usage record; new requests are 503 `overloaded`, never 500, and a restart
costs no request."""

from __future__ import annotations

import concurrent.futures
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from tests.support.redis_server import PrivateRedis
from tests.support.serve import Served, serving

# alone (tests/support/tiers.py): it times streams through Redis killed and hung
pytestmark = pytest.mark.alone

PING = 1.0
DELAY_MS = 20


@pytest.fixture(scope="module")
def upstream(scripted_upstream) -> str:
    return scripted_upstream


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@contextmanager
def gateway(upstream: str, store: PrivateRedis, tmp_path: Path, *flags: str) -> Iterator[Served]:
    log = tmp_path / "gateway.log"
    flags = (
        *("--upstream", f"scripted={upstream}", "--redis-url", store.url),
        *("--ping-interval", str(PING), "--usage-file", str(tmp_path / "usage.jsonl")),
        *flags,
    )
    with log.open("wb") as out, serving(None, *flags, stderr=out) as served:
        served.log = log
        yield served


def usage_records(store: PrivateRedis, tmp_path: Path, run_id: str) -> list[dict]:
    """The run's usage records, in Redis's stream and in this host's fallback file."""
    client = redis.Redis.from_url(store.url)
    try:
        entries = client.xrange("sluice:usage")
    finally:
        client.close()
    records = [orjson.loads(fields[b"r"]) for _, fields in entries]
    fallback = tmp_path / "usage.jsonl"
    if fallback.exists():
        records += [orjson.loads(line) for line in fallback.read_bytes().splitlines()]
    return [r for r in records if r["run_id"] == run_id]


def at(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


class RawStream:
    """A streaming request on a raw socket: the SSE payloads, and whatever comes after the end."""

    def __init__(self, served: Served, tokens: int) -> None:
        body = orjson.dumps(
            {
                "model": "scripted",
                "stream": True,
                "max_tokens": tokens,
                "metadata": {"delay_ms": str(DELAY_MS)},
                "messages": [{"role": "user", "content": "Hi"}],
            }
        )
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {served.key}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.sock = socket.create_connection(("127.0.0.1", served.port), timeout=60)
        self.sock.sendall(head.encode() + body)
        self.buffer = b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, "the connection closed before the stream ended"
        self.buffer += chunk

    def read_to_end(self) -> bytes:
        """The de-chunked body, up to the zero-length chunk that ends it."""
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        body = b""
        while True:
            while b"\r\n" not in self.buffer:
                self._more()
            size_line, _, rest = self.buffer.partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                self._more()
                size_line, _, rest = self.buffer.partition(b"\r\n")
            body += rest[:size]
            self.buffer = rest[size + 2 :]
            if size == 0:
                return body

    def after_the_end(self, wait: float) -> bytes:
        """Bytes the gateway sends on this connection after the response ended."""
        self.sock.settimeout(wait)
        extra = self.buffer
        try:
            while chunk := self.sock.recv(65536):
                extra += chunk
        except TimeoutError:
            pass
        self.sock.close()
        return extra


def payloads(body: bytes) -> list:
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[6:]
            out.append(data.decode() if data == b"[DONE]" else orjson.loads(data))
    return out


def content(events: list) -> list[str]:
    return [
        c["delta"]["content"]
        for e in events
        if isinstance(e, dict) and e.get("choices")
        for c in e["choices"]
        if c["delta"].get("content")
    ]


def run_id_of(events: list) -> str:
    return next(e["id"] for e in events if isinstance(e, dict) and "id" in e)


def quiet_log(served: Served) -> None:
    text = served.log.read_text()
    assert "Traceback" not in text
    assert "run settlement failed" not in text


def test_a_live_stream_rides_out_redis_killed_and_restarted(upstream, private_redis, tmp_path):
    with gateway(upstream, private_redis, tmp_path) as served:
        stream = RawStream(served, 300)  # 6 s of tokens
        timers = [at(1.0, private_redis.kill), at(4.0, private_redis.start)]
        events = payloads(stream.read_to_end())
        for timer in timers:
            timer.join()
        assert stream.after_the_end(PING * 2.5) == b""  # no heartbeat after the end
        assert content(events) == [f"tok{i} " for i in range(300)]
        assert events[-1] == "[DONE]"
        assert not [e for e in events if isinstance(e, dict) and "error" in e]
        run_id = run_id_of(events)
        run = httpx.get(f"{served.base_url}/chat/completions/{run_id}", headers=served.auth)
        assert run.json()["status"] == "completed"
        (record,) = usage_records(private_redis, tmp_path, run_id)
        assert (record["status"], record["generated_tokens"]) == ("completed", 300)
        # Redis came back empty: the owner wrote the run back, as other replicas would read it
        client = redis.Redis.from_url(private_redis.url)
        assert int(client.hget(f"sluice:run:{run_id}", "last_seq")) == len(events) - 1
        client.close()
        quiet_log(served)


def test_a_hang_shorter_than_the_grace_costs_a_live_stream_nothing(
    upstream, private_redis, tmp_path
):
    with gateway(upstream, private_redis, tmp_path) as served:
        stream = RawStream(served, 300)
        timers = [at(1.0, private_redis.pause), at(3.5, private_redis.resume)]
        events = payloads(stream.read_to_end())
        for timer in timers:
            timer.join()
        assert stream.after_the_end(PING * 2.5) == b""
        assert content(events) == [f"tok{i} " for i in range(300)]
        (record,) = usage_records(private_redis, tmp_path, run_id_of(events))
        assert record["status"] == "completed"
        quiet_log(served)


def test_an_outage_past_the_grace_ends_the_stream_with_one_clean_frame(
    upstream, private_redis, tmp_path
):
    grace = 3.0
    with gateway(upstream, private_redis, tmp_path, "--redis-outage-grace", str(grace)) as served:
        stream = RawStream(served, 1000)  # 20 s of tokens
        paused_at = time.monotonic() + 1.0
        timer = at(1.0, private_redis.pause)
        try:
            events = payloads(stream.read_to_end())
            ended = time.monotonic()
            assert stream.after_the_end(PING * 2.5) == b""
        finally:
            timer.join()
            private_redis.resume()
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert [e["code"] for e in errors] == ["store_unavailable"]
        assert events[-2] == {"error": errors[0]} and events[-1] == "[DONE]"
        assert grace <= ended - paused_at < grace + 8
        assert 0 < len(content(events)) < 1000
        run_id = run_id_of(events)
        (record,) = usage_records(private_redis, tmp_path, run_id)
        assert record["status"] == "failed" and record["cancel_source"] == "store"
        run = httpx.get(f"{served.base_url}/chat/completions/{run_id}", headers=served.auth)
        assert run.json()["status"] == "failed"
        assert run.json()["error"]["code"] == "store_unavailable"
        metrics = httpx.get(f"{served.root}/metrics").text
        assert re.search(r'sluice_cancellations_total\{outcome="\w+",source="store"\} 1.0', metrics)
        quiet_log(served)


def chat(served: Served) -> httpx.Response:
    return httpx.post(
        f"{served.base_url}/chat/completions",
        json={"model": "scripted", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        headers=served.auth,
        timeout=30,
    )


def test_redis_away_is_503_and_readyz_says_so_and_a_restart_costs_no_request(
    upstream, private_redis, tmp_path
):
    with gateway(upstream, private_redis, tmp_path) as served:
        assert chat(served).status_code == 200
        private_redis.kill()
        began = time.monotonic()
        down = chat(served)
        assert down.status_code == 503, down.text
        assert down.json()["error"]["code"] == "overloaded"
        assert int(down.headers["retry-after"]) >= 1
        assert time.monotonic() - began < 5
        ready = httpx.get(f"{served.root}/readyz")
        assert (ready.status_code, ready.json()["store"]) == (503, "unavailable")

        private_redis.start()
        assert [chat(served).status_code for _ in range(30)] == [200] * 30
        assert httpx.get(f"{served.root}/readyz").status_code == 200

        private_redis.kill()  # and once more, with a burst on stale pooled connections
        private_redis.start()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda _: chat(served).status_code, range(16)))
        assert statuses == [200] * 16

        private_redis.pause()  # hung: refused within the command timeout, not after minutes
        try:
            began = time.monotonic()
            hung = chat(served)
            assert hung.status_code == 503 and hung.json()["error"]["code"] == "overloaded"
            assert time.monotonic() - began < 10
            assert httpx.get(f"{served.root}/readyz", timeout=10).status_code == 503
        finally:
            private_redis.resume()
        quiet_log(served)
