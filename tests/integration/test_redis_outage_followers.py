"""A run followed on another replica while Redis is away: the replica that drives it cannot
count the other replica's followers then, so when its disconnect grace ends it must not take its
own zero for everyone's (it asks again once Redis answers). Found by the soak (deploy/soak/): a
stream dropped on its owner and resumed on the other replica was cancelled for `disconnect`
while its client was reading it, when Redis went away inside the owner's grace window."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.redis_server import PrivateRedis
from tests.support.serve import Served, serving

# a private redis-server, hung and resumed; alone (tests/support/tiers.py): it times streams
# through Redis hung
pytestmark = [pytest.mark.redis, pytest.mark.process, pytest.mark.alone]
GRACE = 1.0  # the disconnect grace
AWAY = 3.0  # Redis hung this long: past the grace, well within the outage grace (30 s)
DELAY_MS = 20  # between the scripted upstream's tokens: a 300-token run takes 6 s


def frames(resp: httpx.Response) -> Iterator[tuple[int | None, dict | str]]:
    """(event id, payload) of each SSE event; (None, "[DONE]") at the end."""
    event_id = None
    for line in resp.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line == "data: [DONE]":
            yield None, "[DONE]"
        elif line.startswith("data: "):
            yield event_id, orjson.loads(line[6:])
            event_id = None


def test_a_run_followed_elsewhere_outlives_the_owners_grace_while_redis_is_away(
    scripted_upstream, tmp_path
):
    store = PrivateRedis(tmp_path)
    store.start()
    flags = ("--upstream", f"scripted={scripted_upstream}", "--redis-url", store.url)
    flags += ("--disconnect-grace", str(GRACE), "--redis-timeout", "0.5")
    try:
        with (
            serving(None, *flags, "--usage-file", str(tmp_path / "a.jsonl")) as owner,
            serving(None, *flags, "--usage-file", str(tmp_path / "b.jsonl")) as other,
            httpx.Client(timeout=60) as http,
        ):
            run_id, last_id, first = start_stream(http, owner)
            follower = Follower(http, other, run_id, last_id)
            assert follower.attached.wait(10), "the resume on the other replica never began"

            first.close()  # the owner's only follower goes: its grace window starts
            store.pause()
            threading.Timer(AWAY, store.resume).start()
            follower.join(60)

            assert follower.error is None, follower.error  # not cancelled for `disconnect`
            assert follower.finish_reason == "length" and follower.done
            run = http.get(f"{owner.base_url}/chat/completions/{run_id}", headers=owner.auth)
            assert run.json()["status"] == "completed"
    finally:
        store.stop()


def start_stream(http: httpx.Client, served: Served) -> tuple[str, int, httpx.Response]:
    """A 300-token stream on `served`, read for three events: (run id, last id, response)."""
    body = {
        "model": "scripted",
        "stream": True,
        "max_tokens": 300,
        "metadata": {"delay_ms": str(DELAY_MS)},
        "messages": [{"role": "user", "content": "Hi"}],
    }
    request = http.build_request(
        "POST", f"{served.base_url}/chat/completions", json=body, headers=served.auth
    )
    resp = http.send(request, stream=True)
    assert resp.status_code == 200
    seen = []
    for event_id, payload in frames(resp):
        seen.append((event_id, payload))
        if len(seen) == 3:
            break
    return seen[0][1]["id"], seen[-1][0], resp


class Follower(threading.Thread):
    """A resume of the run on another replica, read to its end on a thread of its own."""

    def __init__(self, http: httpx.Client, served: Served, run_id: str, after: int) -> None:
        super().__init__(daemon=True)
        self.http, self.served, self.run_id, self.after = http, served, run_id, after
        self.attached = threading.Event()
        self.error: dict | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.start()

    def run(self) -> None:
        url = f"{self.served.base_url}/chat/completions/{self.run_id}"
        params = {"stream": "true", "starting_after": str(self.after)}
        with self.http.stream("GET", url, params=params, headers=self.served.auth) as resp:
            assert resp.status_code == 200
            for _, payload in frames(resp):
                self.attached.set()
                if payload == "[DONE]":
                    self.done = True
                elif "error" in payload:
                    self.error = payload["error"]
                elif payload["choices"] and payload["choices"][0]["finish_reason"]:
                    self.finish_reason = payload["choices"][0]["finish_reason"]
