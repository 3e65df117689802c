"""The base of every load user: its tenant turns, its requests, its rows of its own.

Also the two hooks of the locust process: it refuses to start without keys or a model, and at the
end it writes the final count of every row for run_local.py.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path

import requests
from load_checks import (
    Unexpected,
    checked,
    expect_event_stream,
    expect_retry_after,
    unexpected_status,
)
from load_settings import LoadConfigError, Tenant, load_settings
from locust import HttpUser, between, events
from locust.clients import ResponseContextManager
from sse_frames import ChatStream

CHAT = "/v1/chat/completions"
RUN = CHAT + "/{id}"  # how run URLs are named in the stats
PROMPTS = (
    "Tell me a long story about a lighthouse keeper and a storm.",
    "Explain, step by step, how a paged KV cache works.",
    "Write a travel diary entry about a week in Lisbon.",
    "List twenty facts about octopuses, one sentence each.",
)


@events.init.add_listener
def _check_settings(environment, **_) -> None:
    """Refuse to start without keys or a model, instead of failing every request."""
    if environment.host is None:
        raise SystemExit("sluicegate load: give --host (or LOCUST_HOST)")
    try:
        load_settings(environment.host)
    except (LoadConfigError, requests.RequestException) as exc:
        raise SystemExit(f"sluicegate load: {exc}") from None


@events.quitting.add_listener
def _write_counts(environment, **_) -> None:
    """The final counts per row, for run_local.py (`SLUICE_LOAD_COUNTS_FILE`): written once
    every user has stopped, unlike `--csv`, whose last periodic write can miss the last second."""
    path = os.environ.get("SLUICE_LOAD_COUNTS_FILE")
    if not path:
        return
    stats = environment.stats
    rows = [
        {"type": e.method, "name": e.name, "count": e.num_requests, "failures": e.num_failures}
        for e in stats.entries.values()
    ]
    counts = {
        "rows": rows,
        "requests": stats.total.num_requests,
        "failures": stats.total.num_failures,
        "exceptions": sum(row["count"] for row in environment.runner.exceptions.values()),
    }
    Path(path).write_text(json.dumps(counts), encoding="utf-8")


class SluiceUser(HttpUser):
    abstract = True
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.settings = load_settings(self.host)
        tenants = list(self.settings.tenants)
        random.shuffle(tenants)
        self._tenants = itertools.cycle(tenants)

    def body(self, max_tokens: int, stream: bool = True) -> dict:
        body = {
            "model": self.settings.model,
            "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def post_chat(
        self, tenant: Tenant, body: dict, name: str, key: str | None = None
    ) -> tuple[ResponseContextManager, float]:
        """The request and when it was sent (TTFT counts from there)."""
        headers = tenant.auth if key is None else {**tenant.auth, "Idempotency-Key": key}
        sent = time.perf_counter()
        resp = self.client.post(
            CHAT, json=body, headers=headers, stream=body["stream"], catch_response=True, name=name
        )
        return resp, sent

    def admitted(self, resp: ResponseContextManager, tenant: Tenant) -> bool:
        """True for a 200; an expected 429 is checked and recorded."""
        if resp.status_code == 429 and tenant.throttled:
            expect_retry_after(resp)
            self.record("429", tenant.name, resp.elapsed.total_seconds() * 1000)
            resp.success()
            return False
        if resp.status_code != 200:
            raise unexpected_status(resp, f"tenant {tenant.name}'s request")
        return True

    def open_stream(
        self, resp: ResponseContextManager, tenant: Tenant, sent: float, cut: bool
    ) -> ChatStream:
        """Read a new stream (to its end, or `cut_after` text frames) and report its timings."""
        expect_event_stream(resp)
        stream = ChatStream(resp.iter_content(None), sent)
        stream.read(self.settings.cut_after if cut else None)
        if (ttft := stream.ttft_ms()) is not None:
            self.record("TTFT", tenant.name, ttft)
        for gap in stream.gaps_ms():
            self.record("ITL", tenant.name, gap)
        return stream

    def final_object(self, tenant: Tenant, run_id: str) -> dict:
        with checked(
            self.client.get(f"{CHAT}/{run_id}", headers=tenant.auth, catch_response=True, name=RUN)
        ) as resp:
            if resp.status_code != 200:
                raise unexpected_status(resp, "retrieving the run")
            return resp.json()
        raise Unexpected("the run could not be retrieved to check its text")

    def record(self, kind: str, name: str, ms: float) -> None:
        """A row of our own in locust's stats (a kind it cannot time by itself)."""
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=ms, response_length=0, exception=None
        )
