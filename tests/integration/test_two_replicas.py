"""Two gateway replicas sharing Redis, in front of one real worker on the tiny model: a stream
started on one replica is resumed and cancelled on the other, and when the replica driving a run
is killed, the other marks the run failed once the owner lease lapses (design §2-§4)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
import redis
from openai import OpenAI
from openai._streaming import SSEDecoder

from gateway.backends.local_worker import free_port
from tests.support.metrics import scraped
from tests.support.processes import resume_request, stop, wait_ready
from tests.support.waiting import until_sync

API_KEY = "sk-sluice-replicas"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
REDIS_URL = "redis://127.0.0.1:6379/0"
LEASE_TTL = 2
PROMPT = [{"role": "user", "content": "Tell me a story about 你好 and café."}]
LONG = 900  # max_tokens of runs that must still be live when the test acts on them (~3 ms/token)


def _redis() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    return client


def _launch(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *cmd], env={**os.environ, **(env or {})}
    )


@dataclass
class Replica:
    root: str
    proc: subprocess.Popen

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0, timeout=30)

    def run_url(self, run_id: str) -> str:
        return f"{self.base_url}/chat/completions/{run_id}"


@pytest.fixture(scope="module")
def prefix() -> Iterator[str]:
    store = _redis()
    prefix = f"sluice-test-{uuid.uuid4().hex[:8]}:"
    yield prefix
    keys = list(store.scan_iter(match=f"{prefix}*", count=500))
    if keys:
        store.delete(*keys)
    store.close()


@pytest.fixture(scope="module")
def worker(tiny_model_dir) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["worker", "--model", str(tiny_model_dir), "--port", str(port)]
    proc = _launch([*cmd, "--dtype", "float32", "--device", "cpu"])
    wait_ready(proc, f"{url}/health")
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def start_replica(worker, prefix):
    procs: list[subprocess.Popen] = []

    def start(count: int = 1) -> list[Replica]:
        """`count` gateway processes, started side by side."""
        launched = []
        for _ in range(count):
            port = free_port()
            cmd = ["serve", "--worker-url", worker, "--api-key", API_KEY, "--port", str(port)]
            cmd += ["--redis-url", REDIS_URL, "--redis-prefix", prefix]
            cmd += ["--disconnect-grace", "30"]
            env = {"SLUICE_LEASE_TTL": str(LEASE_TTL), "SLUICE_LOG_LEVEL": "warning"}
            procs.append(_launch(cmd, env))
            launched.append(Replica(f"http://127.0.0.1:{port}", procs[-1]))
        for replica in launched:
            wait_ready(replica.proc, f"{replica.root}/readyz")
        return launched

    yield start
    for proc in procs:
        stop(proc)


@pytest.fixture(scope="module")
def replicas(start_replica) -> list[Replica]:
    return start_replica(2)


@pytest.fixture(scope="module")
def replica_a(replicas) -> Replica:
    return replicas[0]


@pytest.fixture(scope="module")
def replica_b(replicas) -> Replica:
    return replicas[1]


@pytest.fixture(scope="module")
def model(replica_a, replica_b) -> str:
    (only,) = replica_a.client().models.list().data
    assert [m.id for m in replica_b.client().models.list().data] == [only.id]
    return only.id


def sse_frames(chunks: Iterator[bytes]) -> Iterator[tuple[int | None, dict | str]]:
    """(event id, JSON payload) for each SSE event of a raw byte stream, and (None, "[DONE]")
    at its end (the decoder keeps the last id for frames without one, as the SSE spec says)."""
    for event in SSEDecoder().iter_bytes(chunks):
        if event.data == "[DONE]":
            yield None, event.data
        else:
            yield (int(event.id) if event.id else None), orjson.loads(event.data)


def increasing(ids: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(ids))


def text_of(frames) -> str:
    return "".join(
        choice["delta"].get("content") or ""
        for _, data in frames
        if isinstance(data, dict)
        for choice in data.get("choices", [])
    )


def resume(replica: Replica, run_id: str, after: int, *, header: bool = False):
    """Resume a run's stream on `replica` from event `after`; all of its frames."""
    params, headers = resume_request(after, header, AUTH)
    with httpx.stream(
        "GET", replica.run_url(run_id), params=params, headers=headers, timeout=30
    ) as resp:
        assert resp.status_code == 200, resp.read()
        return list(sse_frames(resp.iter_bytes()))


def worker_idle(worker: str, within: float = 10.0) -> dict:
    def idle() -> dict | None:
        stats = httpx.get(f"{worker}/v1/stats", timeout=5).json()
        return stats if stats["running"] == 0 and stats["waiting"] == 0 else None

    return until_sync(idle, "the worker to go idle", within=within)


def metric(replica: Replica, name: str, **labels: str) -> float:
    return scraped(replica.root, name, **labels)


def test_stream_started_on_a_resumes_on_b(replica_a, replica_b, model):
    max_tokens = 300
    greedy = replica_b.client().chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=max_tokens
    )
    expected = greedy.choices[0].message.content
    assert expected

    with replica_a.client().chat.completions.with_streaming_response.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=max_tokens, stream=True
    ) as response:
        head = []
        for frame in sse_frames(response.iter_bytes()):
            head.append(frame)
            if len(head) == 5:
                break
    run_id = head[0][1]["id"]
    after = head[-1][0]

    tail = resume(replica_b, run_id, after)
    assert tail[-1] == (None, "[DONE]")
    assert text_of(head + tail) == expected
    finishes = [c["finish_reason"] for _, d in tail[:-1] for c in d["choices"]]
    assert finishes[-1] == greedy.choices[0].finish_reason
    # Event ids are the log's seq numbers: they start at 1 and only go up, never repeating. A
    # backlog (a resume's replay) has its text chunks merged under the last merged seq
    # (design §3, gateway/http/backpressure.py), so ids may skip, but no text may: resuming from
    # any id seen gives exactly the rest of the answer, from either replica.
    seqs = [seq for seq, _ in head + tail[:-1]]
    assert seqs[0] == 1 and increasing(seqs)
    seen = ""
    texts_after = {}
    for seq, data in head + tail[:-1]:
        seen += text_of([(seq, data)])
        texts_after[seq] = expected[len(seen) :]
    points = seqs[: -1 : max(1, len(seqs) // 8)]  # after the last one: 204, checked below
    for i, point in enumerate(points):
        replica = (replica_a, replica_b)[i % 2]
        rest = resume(replica, run_id, point, header=i % 4 == 1)  # some through Last-Event-ID
        assert rest[-1] == (None, "[DONE]") and rest[-2][0] == seqs[-1]
        ids = [seq for seq, _ in rest[:-1]]
        assert ids[0] > point and increasing(ids)
        assert text_of(rest) == texts_after[point], f"resume after {point} on {replica.root}"
    for replica in (replica_a, replica_b):  # the run's end: nothing to resume, on either one
        params, headers = resume_request(seqs[-1], False, AUTH)
        ended = httpx.get(replica.run_url(run_id), params=params, headers=headers, timeout=10)
        assert ended.status_code == 204

    stored = httpx.get(replica_b.run_url(run_id), headers=AUTH, timeout=10).json()
    assert stored["status"] == "completed"
    assert stored["id"] == run_id
    assert stored["choices"][0]["message"]["content"] == expected


def test_cancel_on_b_stops_the_stream_on_a(replica_a, replica_b, model, worker):
    cancelled_before = metric(replica_a, "sluice_cancellations_total", source="client")
    stream = replica_a.client().chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=LONG, stream=True
    )
    chunks: list = []
    errors: list[BaseException] = []
    reading = threading.Event()

    def read() -> None:
        try:
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) >= 3:
                    reading.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            reading.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert reading.wait(15)
    assert not errors and chunks, "the stream on A did not start"
    run_id = chunks[0].id

    answer = httpx.post(f"{replica_b.run_url(run_id)}/cancel", headers=AUTH, timeout=15)
    assert answer.status_code == 200
    assert answer.json()["status"] == "cancelled"

    reader.join(15)
    assert not reader.is_alive(), "the stream on A did not end after the cancel"
    (error,) = errors
    assert isinstance(error, openai.APIError)
    assert error.code == "cancelled"
    assert all(c.choices[0].finish_reason is None for c in chunks if c.choices)
    assert len(chunks) < LONG

    stats = worker_idle(worker)
    assert stats["running"] == 0 and stats["waiting"] == 0

    for replica in (replica_a, replica_b):
        again = httpx.post(f"{replica.run_url(run_id)}/cancel", headers=AUTH, timeout=15)
        assert again.status_code == 200
        assert again.json()["status"] == "cancelled"
    stored = httpx.get(replica_b.run_url(run_id), headers=AUTH, timeout=10).json()
    assert stored["status"] == "cancelled"
    assert metric(replica_a, "sluice_cancellations_total", source="client") >= cancelled_before + 1


def test_killed_owner_has_its_run_failed_by_the_other_replica(
    start_replica, replica_b, model, worker
):
    (owner,) = start_replica()  # its own process, so the shared replicas survive the kill
    stream = owner.client().chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=LONG, stream=True
    )
    first = next(iter(stream))
    run_id = first.id

    params = {"stream": "true", "starting_after": "1"}
    with httpx.stream(
        "GET", replica_b.run_url(run_id), params=params, headers=AUTH, timeout=20
    ) as resp:
        assert resp.status_code == 200
        frames = sse_frames(resp.iter_bytes())
        followed = [next(frames) for _ in range(3)]  # live: B follows the run A drives

        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait(timeout=10)
        killed_at = time.monotonic()
        followed += list(frames)
        ended_after = time.monotonic() - killed_at
    stream.close()

    assert ended_after < 15
    assert followed[-1] == (None, "[DONE]")
    _, last = followed[-2]
    assert last["error"]["code"] == "run_lost"
    seqs = [seq for seq, _ in followed[:-1]]
    assert seqs[0] > 1 and increasing(seqs)
    assert text_of(followed[:-2]), "the resumed stream carried no text before the kill"

    stored = httpx.get(replica_b.run_url(run_id), headers=AUTH, timeout=10).json()
    assert stored["status"] == "failed"
    assert stored["error"]["code"] == "run_lost"

    stats = worker_idle(worker)
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_unknown_run_is_404_on_either_replica(replica_a, replica_b):
    for replica in (replica_a, replica_b):
        resp = httpx.get(replica.run_url("chatcmpl-unknown"), headers=AUTH, timeout=10)
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "not_found"
