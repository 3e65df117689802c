"""The soak's clients: threads that each, until told to stop, pick a kind of stream at random,
act it out against a random replica, and check every frame they read (deploy/locust's
`ChatStream`: ids, JSON, error frames, `[DONE]`).

Kinds: `plain` reads a greedy stream to its end; `slow` reads it through a small socket buffer,
pausing between reads, so the gateway sees a client that fell behind; `resume` drops the
connection one to three times and resumes from the last id read, on either replica, by
`starting_after` or by `Last-Event-ID`; `cancel` cancels mid-stream (on either replica) and
reads the stream's end; `abandon` drops it for good, so the disconnect grace cancels the run.
What each client saw of each run is kept in `Observed`, for the checks after the run.
"""

from __future__ import annotations

import itertools
import random
import socket
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import httpx
from soak_cluster import AUTH
from soak_observed import Observed, Seen
from sse_frames import ChatStream, StreamViolation

KINDS = {"plain": 3, "slow": 2, "resume": 3, "cancel": 2, "abandon": 1}
RETRY_FOR = 40.0  # seconds a client retries 503s (Redis away) before it calls that a problem
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    max_tokens: int


# Long enough on each model that a client can act mid-stream; greedy, so that on the tiny model
# every run of one prompt says the same.
PROFILES = {
    "tiny": (
        Prompt("Tell me a story about 你好 and café.", 500),
        Prompt("Count from one to a hundred, in words.", 320),
        Prompt("Ça va ? Describe a crème brûlée, then a Straße in Zürich.", 420),
        Prompt("Explain paged attention: blocks, tables, prefix caching. 日本語で。", 600),
    ),
    "default": (
        Prompt("Write a long story about a lighthouse keeper and a storm.", 160),
        Prompt("Explain, step by step, how a paged KV cache works.", 128),
        Prompt("Write a travel diary entry about a week in Lisbon.", 144),
        Prompt("List twenty facts about octopuses, one sentence each.", 112),
    ),
}


class Unexpected(Exception):
    """An answer that is well formed but not what sluicegate promises."""


@dataclass(frozen=True, slots=True)
class Target:
    """What every client talks to: the replicas' roots, the model, the prompt profile, and the
    replicas' disconnect grace (a resume later than that may find the run cancelled)."""

    roots: tuple[str, ...]
    model: str
    profile: str
    grace: float


class Client:
    """One client thread's connections, random choices and scenarios."""

    def __init__(self, target: Target, observed: Observed, seed: int) -> None:
        self.target, self.observed = target, observed
        self.prompts = PROFILES[target.profile]
        self.rng = random.Random(seed)
        self.http = httpx.Client(timeout=TIMEOUT)
        small = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
        self.slow_http = httpx.Client(
            timeout=TIMEOUT, transport=httpx.HTTPTransport(socket_options=small)
        )

    def loop(self, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            kind = self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            try:
                getattr(self, kind)()
            except (StreamViolation, Unexpected) as exc:
                self.observed.problem(f"{kind}: {exc}")
            except httpx.HTTPError as exc:
                self.observed.problem(f"{kind}: {type(exc).__name__} {exc}")

    def close(self) -> None:
        self.http.close()
        self.slow_http.close()

    # -- the kinds --------------------------------------------------------------------------------

    def plain(self, kind: str = "plain") -> None:
        stream, resp, seen = self._start(kind)
        with closing(resp):
            stream.read()
        self._finished(seen, stream)

    def slow(self) -> None:
        self.plain("slow")

    def resume(self) -> None:
        stream, resp, seen = self._start("resume", frames=self._cut())
        with closing(resp):
            pass  # the drop
        text, drops, late = stream.content, self.rng.randint(1, 3), False
        while not stream.done:
            drops -= 1
            dropped_at = time.monotonic()
            stream = self._resume(seen, stream.last_id, None if drops <= 0 else self._cut())
            late = late or stream.sent - dropped_at > self.target.grace
            text += stream.content
            seen.merged = seen.merged or stream.gaps > 0
        if late and (stream.error or {}).get("code") == "cancelled":
            # NOTE: refused (503) while Redis was away for longer than the disconnect grace,
            # the resume came too late: the grace had cancelled the run, as it should
            seen.expect = frozenset({"cancelled"})
            self.observed.count("resumes later than the grace: cancelled")
            return
        self._finished(seen, stream, text)

    def cancel(self) -> None:
        stream, resp, seen = self._start("cancel", frames=self._cut())
        with closing(resp):
            if not stream.done:
                status = self._cancel(seen.run_id)
                seen.expect = frozenset({status})
                stream.read()
                if status == "cancelled":
                    if (stream.error or {}).get("code") != "cancelled":
                        raise Unexpected(
                            f"cancelled {seen.run_id}, its stream ended {stream.error}"
                        )
                    return
        self._finished(seen, stream)

    def abandon(self) -> None:
        stream, resp, seen = self._start("abandon", frames=self._cut())
        with closing(resp):
            if not stream.done:
                seen.expect = frozenset({"cancelled", "completed"})  # the grace may outlast it
                return
        self._finished(seen, stream)

    # -- steps ------------------------------------------------------------------------------------

    def _cut(self) -> int:
        return self.rng.randint(2, 30)

    def _start(self, kind: str, frames: int = 1) -> tuple[ChatStream, httpx.Response, Seen]:
        """POST a greedy stream, read `frames` text frames, and note the run."""
        index = self.rng.randrange(len(self.prompts))
        prompt = self.prompts[index]
        body = {
            "model": self.target.model,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": prompt.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        http = self.slow_http if kind == "slow" else self.http
        self.observed.count("requests")
        resp = self._send(http, "POST", self._urls("/v1/chat/completions"), body)
        if resp.status_code != 200:
            raise Unexpected(f"POST answered {resp.status_code}: {resp.read()[:200]!r}")
        chunks = resp.iter_raw(1024)
        stream = ChatStream(self._slowly(chunks) if kind == "slow" else chunks, time.perf_counter())
        try:
            stream.read(1)
        except BaseException:
            resp.close()
            self.observed.count("streams cut before their first text")
            raise
        if stream.run_id is None:
            resp.close()
            raise Unexpected(f"a stream without a chunk: error {stream.error}")
        seen = self.observed.add(Seen(stream.run_id, kind, index))
        if frames > 1 and not stream.done:
            stream.read(frames - 1)
        return stream, resp, seen

    def _slowly(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            time.sleep(self.rng.uniform(0.01, 0.04))  # NOTE: the slow reader's pace
            yield chunk

    def _resume(self, seen: Seen, after: int, frames: int | None) -> ChatStream:
        params, headers = {"stream": "true"}, {}
        if self.rng.random() < 0.5:
            headers["Last-Event-ID"] = str(after)
            self.observed.count("resumes by Last-Event-ID")
        else:
            params["starting_after"] = str(after)
            self.observed.count("resumes by starting_after")
        urls = self._urls(f"/v1/chat/completions/{seen.run_id}")
        dropped = time.time()
        resp = self._send(self.http, "GET", urls, None, params, headers)
        with closing(resp):
            seen.trail.append(
                f"dropped after {after} at {dropped:.3f}, resumed by {next(iter(headers), 'query')}"
                f" on {resp.url.host}:{resp.url.port}: {resp.status_code} at +"
                f"{time.time() - dropped:.3f} s"
            )
            if resp.status_code != 200:
                raise Unexpected(f"resume after {after} answered {resp.status_code}")
            seen.resumes += 1
            # `sent`: when the resume was answered, on the clock `resume` compares with
            stream = ChatStream(resp.iter_raw(1024), time.monotonic(), after + 1, seen.run_id)
            stream.read(frames)
            seen.trail.append(f"read to {stream.last_id} by {time.time():.3f}")
        return stream

    def _cancel(self, run_id: str) -> str:
        resp = self._send(self.http, "POST", self._urls(f"/v1/chat/completions/{run_id}/cancel"))
        with closing(resp):
            resp.read()
            status = resp.json().get("status") if resp.status_code == 200 else None
        if status not in ("cancelled", "completed"):
            raise Unexpected(f"cancel of {run_id} answered {resp.status_code} {status}")
        self.observed.count(f"cancels answered {status}")
        return status

    def _finished(self, seen: Seen, stream: ChatStream, text: str | None = None) -> None:
        """A stream read to its end must end as a completed run's does."""
        seen.merged = seen.merged or stream.gaps > 0
        if stream.error is not None or stream.finish_reason is None or stream.usage is None:
            raise Unexpected(
                f"{seen.kind} stream of {seen.run_id} ended with error {stream.error}, "
                f"finish {stream.finish_reason}, usage {stream.usage}; " + "; ".join(seen.trail)
            )
        seen.text = stream.content if text is None else text

    def _urls(self, path: str) -> list[str]:
        """`path` on a random replica, then on the others: where a 503 is retried."""
        roots = list(self.target.roots)
        self.rng.shuffle(roots)
        return [root + path for root in roots]

    def _send(self, http, method, urls, body=None, params=None, headers=None) -> httpx.Response:
        """The streamed response; a 503 (Redis away) is retried on the next replica after its
        retry-after, for up to RETRY_FOR seconds."""
        deadline = time.monotonic() + RETRY_FOR
        headers = {**AUTH, **(headers or {})}
        for attempt in itertools.count():
            url = urls[attempt % len(urls)]
            request = http.build_request(method, url, json=body, params=params, headers=headers)
            resp = http.send(request, stream=True)
            if resp.status_code != 503 or time.monotonic() > deadline:
                return resp
            resp.close()
            self.observed.count("503s retried")
            if "retry-after" not in resp.headers:
                raise Unexpected(f"a 503 without retry-after from {url}")
            time.sleep(min(float(resp.headers["retry-after"]), 1.0))  # NOTE: as told to
        raise AssertionError("unreachable")
