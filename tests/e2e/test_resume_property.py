"""Resume by event id against `sluice serve` and its real worker: however often and wherever a
stream is dropped, a resume (by `starting_after` or by `Last-Event-ID`) gives exactly the events
after the id named, and the text put back together is the uninterrupted run's text.

Raw HTTP on purpose: the test reads the SSE frames itself, so it sees every `id:` line, and it
hangs up after exactly the events it chose. The random drops come from a seeded `random.Random`
rather than hypothesis: the 200 drops are an exact budget spread over runs of one to four drops
each, and a failure names the run's seed and every drop and resume point (see `Cycle`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import E2E_KEY
from tests.support.processes import resume_request
from tests.support.waiting import until_sync

PROMPT = [{"role": "user", "content": "Tell me a story about 你好 and café."}]
AUTH = {"Authorization": f"Bearer {E2E_KEY}"}
GREEDY = {"temperature": 0}
SEEDS = (None, 7, 1234, 99991)  # None: greedy; otherwise temperature 1 with that seed
DROPS = 200


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    data: bytes

    @property
    def content(self) -> str:
        (choice,) = orjson.loads(self.data)["choices"]
        return choice["delta"].get("content") or ""


@dataclass(slots=True)
class Reference:
    run_id: str
    events: list[Event]

    @property
    def text(self) -> str:
        return "".join(e.content for e in self.events)


def frames(resp: httpx.Response) -> Iterator[tuple[int | None, bytes]]:
    """(id, data) of each SSE event as it arrives; `: ping` comments are skipped."""
    buffer = b""
    seq: int | None = None
    data: list[bytes] = []
    for chunk in resp.iter_raw():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line == b"":
                assert data, "a blank line that ends no event (a heartbeat must not have one)"
                yield seq, b"\n".join(data)
                seq, data = None, []
            elif line.startswith((b":", b"retry: ")):  # heartbeats; the reconnection hint
                continue
            elif line.startswith(b"id: "):
                assert not data and seq is None, "an id line must open its frame"
                seq = int(line[4:])
            else:
                assert line.startswith(b"data: "), line
                data.append(line[6:])
    assert buffer == b"" and not data, "the stream ended inside a frame"


class Stream:
    """One streaming response, read event by event; leaving it early drops the connection."""

    def __init__(self, resp: httpx.Response) -> None:
        assert resp.status_code in (200, 204), resp.read()
        self._frames = frames(resp)
        self.ended = resp.status_code == 204  # a finished run resumed at its end: no stream
        self.done = self.ended

    def read(self, count: int | None = None) -> list[Event]:
        """Up to `count` events (all when None); `done` once `data: [DONE]` was read."""
        events: list[Event] = []
        while not self.ended and (count is None or len(events) < count):
            frame = next(self._frames, None)
            assert frame is not None, "the stream ended without data: [DONE]"
            seq, data = frame
            if data == b"[DONE]":
                self.done = True
                assert next(self._frames, None) is None, "something after [DONE]"
                break
            assert seq is not None, f"an event without an id: {data!r}"
            events.append(Event(seq, data))
        return events


class Gateway:
    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http = http
        self.model = model
        self.references: dict[bytes, Reference] = {}

    def body(self, seed: int | None, max_tokens: int = 60) -> dict:
        sampling = GREEDY if seed is None else {"temperature": 1.0, "seed": seed}
        return {
            "model": self.model,
            "messages": PROMPT,
            "stream": True,
            **sampling,
            "max_tokens": max_tokens,
        }

    def start(self, body: dict):
        return self.http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH)

    def resume(self, run_id: str, after: int, header: bool):
        params, headers = resume_request(after, header, AUTH)
        return self.http.stream(
            "GET", f"/v1/chat/completions/{run_id}", params=params, headers=headers
        )

    def reference(self, body: dict) -> Reference:
        """The run's events read in one go, never dropped (once per distinct body)."""
        key = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        if key not in self.references:
            with self.start(body) as resp:
                stream = Stream(resp)
                events = stream.read()
                assert stream.done
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            finish = orjson.loads(events[-1].data)["choices"][0]["finish_reason"]
            assert finish in ("length", "stop")
            assert len(events) > 20, "too short a run to drop it in many places"
            run_id = orjson.loads(events[0].data)["id"]
            self.references[key] = Reference(run_id, events)
        return self.references[key]


@pytest.fixture(scope="module")
def gateway(served) -> Iterator[Gateway]:
    with httpx.Client(base_url=served.root, timeout=30) as http:
        (model,) = http.get("/v1/models", headers=AUTH).json()["data"]
        yield Gateway(http, model["id"])


def check_resumed(events: list[Event], after: int, kept: dict[int, bytes], why: object) -> None:
    """Exactly the events after `after`, in order; an event seen before comes back the same."""
    assert [e.seq for e in events] == list(range(after + 1, after + 1 + len(events))), why
    for e in events:
        assert kept.setdefault(e.seq, e.data) == e.data, f"event {e.seq} changed: {why}"


@pytest.mark.parametrize(
    ("dropped_after", "header"),
    [(1, False), (2, True), (5, False), (17, True), (40, False), (40, True)],
)
def test_a_stream_dropped_after_n_events_resumes_to_the_same_text(gateway, dropped_after, header):
    reference = gateway.reference(gateway.body(seed=None))
    assert len(reference.events) > dropped_after + 1
    with gateway.start(gateway.body(seed=None)) as resp:
        head = Stream(resp).read(dropped_after)
    assert [e.seq for e in head] == list(range(1, dropped_after + 1))
    run_id = orjson.loads(head[0].data)["id"]
    assert run_id != reference.run_id
    with gateway.resume(run_id, head[-1].seq, header) as resp:
        stream = Stream(resp)
        rest = stream.read()
    assert stream.done
    seqs = [e.seq for e in head + rest]
    assert seqs == list(range(1, len(reference.events) + 1))  # none missing, none repeated
    assert "".join(e.content for e in head + rest) == reference.text


@dataclass(slots=True)
class Cycle:
    """One run followed with drops: where each stream was dropped and each resume began."""

    seed: int | None
    steps: list[str]


def follow_with_drops(gateway: Gateway, rng: random.Random, seed: int | None, drops: int) -> None:
    """Start a run, drop its stream `drops` times at random points, resume each time (by query
    or header, sometimes from an earlier id than the last one received), then read it to the
    end; check every resumed stream, and the text rebuilt from each seq's event."""
    body = gateway.body(seed, max_tokens=rng.choice((30, 45, 60)))
    reference = gateway.reference(body)
    total = len(reference.events)
    cycle = Cycle(seed, [])
    kept: dict[int, bytes] = {}
    with gateway.start(body) as resp:
        count = rng.randint(1, total)
        head = Stream(resp).read(count)
    cycle.steps.append(f"POST dropped after {count}")
    assert len(head) == count, cycle
    check_resumed(head, 0, kept, cycle)
    run_id = orjson.loads(head[0].data)["id"]
    last = head[-1].seq
    for resumed in range(drops):  # the POST was the first drop; the last resume reads it all
        after = last if rng.random() < 0.6 else rng.randint(0, last)
        header = rng.random() < 0.5
        final = resumed == drops - 1
        count = None if final else rng.randint(0, total - after)
        step = f"resume after {after} ({'Last-Event-ID' if header else 'starting_after'})"
        cycle.steps.append(step + ("" if final else f", dropped after {count}"))
        with gateway.resume(run_id, after, header) as resp:
            stream = Stream(resp)
            events = stream.read(count)
            assert len(events) == (total - after if final else count), cycle
            assert stream.done == final or stream.ended, cycle
            assert not stream.ended or after >= total, cycle  # 204 only past the last event
        check_resumed(events, after, kept, cycle)
        last = max(last, after + len(events))
    assert sorted(kept) == list(range(1, total + 1)), cycle
    assert "".join(Event(s, kept[s]).content for s in sorted(kept)) == reference.text, cycle


def resumes_by_outcome(gateway: Gateway) -> dict[str, float]:
    text = gateway.http.get("/metrics").text
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == "sluice_resumes")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_random_drops_and_resumes_always_rebuild_the_reference(gateway):
    rng = random.Random(20240611)
    before = resumes_by_outcome(gateway)
    drops = 0
    runs = 0
    while drops < DROPS:
        count = min(rng.randint(1, 4), DROPS - drops)
        follow_with_drops(gateway, rng, rng.choice(SEEDS), count)
        drops += count
        runs += 1
    assert drops == DROPS
    assert runs < DROPS  # several drops of one run happened in a row
    assert len(gateway.references) > len(SEEDS)  # distinct references were exercised

    # every drop was followed by one resume (counted once its handler saw the client go)
    def grown() -> dict[str, float]:
        return {k: v - before.get(k, 0) for k, v in resumes_by_outcome(gateway).items()}

    until_sync(lambda: sum(grown().values()) >= DROPS, "every resume to be counted", within=5)
    grew = grown()
    assert sum(grew.values()) == DROPS, grew
    assert grew["live"] > 0 and grew["replayed"] > 0, grew  # live runs and ended ones
