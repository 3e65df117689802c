"""A property of Responses streams against `sluice serve` and its real worker: however a stream
is dropped and resumed (by `starting_after` or `Last-Event-ID`, from the last event received or
an earlier one), the events put back together are numbered 0..K with none missing or repeated,
every resume gives exactly the events after the number it named, and the text is the
uninterrupted stream's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import E2E_KEY
from tests.e2e.test_resume_property import frames
from tests.support.processes import resume_request

AUTH = {"Authorization": f"Bearer {E2E_KEY}"}


@dataclass(slots=True)
class Read:
    """Events read from one stream: (sequence_number, event), and whether it ended whole."""

    events: list[tuple[int, dict]]
    done: bool


def read(resp: httpx.Response, count: int | None = None) -> Read:
    """Up to `count` events (all when None); leaving early drops the connection."""
    if resp.status_code == 204:  # resumed at the end of a finished response
        return Read([], True)
    assert resp.status_code == 200, resp.read()
    events: list[tuple[int, dict]] = []
    for seq, data in frames(resp):
        if data == b"[DONE]":
            return Read(events, True)
        event = orjson.loads(data)
        assert seq == event["sequence_number"], "the SSE id is the sequence number"
        events.append((seq, event))
        if count is not None and len(events) == count:
            break
    return Read(events, False)


class Gateway:
    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http = http
        self.body = {
            "model": model,
            "input": "Tell me a story about 你好 and café.",
            "temperature": 0,
            "max_output_tokens": 40,
            "stream": True,
        }

    def start(self):
        return self.http.stream("POST", "/v1/responses", json=self.body, headers=AUTH)

    def resume(self, rid: str, after: int, header: bool):
        params, headers = resume_request(after, header, AUTH)
        return self.http.stream("GET", f"/v1/responses/{rid}", params=params, headers=headers)


def text(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@pytest.fixture(scope="module")
def gateway(served) -> Iterator[Gateway]:
    with httpx.Client(base_url=served.root, timeout=30) as http:
        (model,) = http.get("/v1/models", headers=AUTH).json()["data"]
        yield Gateway(http, model["id"])


@pytest.fixture(scope="module")
def reference(gateway) -> list[dict]:
    """The stream read in one go, never dropped."""
    with gateway.start() as resp:
        whole = read(resp)
    assert whole.done
    assert [seq for seq, _ in whole.events] == list(range(len(whole.events)))
    assert len(whole.events) > 30, "too short a stream to drop it in many places"
    return [event for _, event in whole.events]


DROPS = st.lists(
    st.tuples(st.integers(1, 60), st.integers(0, 3), st.booleans()), min_size=1, max_size=4
)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(drops=DROPS)
def test_drops_and_resumes_give_the_uninterrupted_stream(gateway, reference, drops):
    """Each drop: read `count` more events, hang up, resume `back` events before the last one
    received (by header or by query)."""
    kept: dict[int, dict] = {}
    with gateway.start() as resp:
        got = read(resp, drops[0][0])
    rid = got.events[0][1]["response"]["id"]
    for seq, event in got.events:
        kept[seq] = event
    for count, back, header in [*drops[1:], (None, drops[0][1], drops[0][2])]:
        if got.done:
            break
        after = max(max(kept) - back, 0)
        with gateway.resume(rid, after, header) as resp:
            got = read(resp, count)
        seqs = [seq for seq, _ in got.events]
        assert seqs == list(range(after + 1, after + 1 + len(seqs))), (drops, after)
        for seq, event in got.events:
            assert kept.setdefault(seq, event) == event, f"event {seq} changed"
    if not got.done:  # read the rest in one go
        with gateway.resume(rid, max(kept), False) as resp:
            got = read(resp)
        kept.update(dict(got.events))
    assert sorted(kept) == list(range(len(reference)))  # none missing, none repeated
    events = [kept[seq] for seq in sorted(kept)]
    assert [e["type"] for e in events] == [e["type"] for e in reference]
    assert text(events) == text(reference)
