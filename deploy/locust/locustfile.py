"""Load for sluicegate that exercises what sets it apart from a plain HTTP server.

Four kinds of users, each turn on the next tenant (so every kind meets every tenant's limits):
- `StreamingUser`: streams and reports its own rows, `TTFT` (request sent → first text frame)
  and `ITL` (between text frames), per tenant, beside locust's usual time-to-headers rows.
- `CancellingUser`: cuts a stream with `POST …/{id}/cancel`; the stream must end with a
  `cancelled` error frame and `[DONE]` (or finish normally if the cancel answered `completed`).
- `ResumingUser`: drops the connection mid-stream, resumes by `starting_after` or
  `Last-Event-ID`; the resumed ids continue exactly after the last one read, and the text read
  before and after equals the run's final text.
- `IdempotentUser`: repeats a request with its `Idempotency-Key`: the same completion (id and
  choices, or the stream replayed from event 1 after a dropped first try) with
  `idempotent-replayed: true`; the key with another body is `422 idempotency_key_reused`.
Configuration: load_settings.py; how to run it and read it: docs/operations/load-testing.md.
"""

from __future__ import annotations

import itertools
import time
import uuid

from load_checks import (
    Unexpected,
    checked,
    expect_cancelled,
    expect_event_stream,
    expect_finished,
    expect_same_text,
    unexpected_status,
)
from load_settings import Tenant
from locust import task
from locust.clients import ResponseContextManager
from sluice_user import CHAT, RUN, SluiceUser
from sse_frames import ChatStream


class StreamingUser(SluiceUser):
    weight = 3

    @task
    def stream(self) -> None:
        tenant = next(self._tenants)
        resp, sent = self.post_chat(tenant, self.body(self.settings.max_tokens), "chat stream")
        with checked(resp):
            if not self.admitted(resp, tenant):
                return
            stream = self.open_stream(resp, tenant, sent, cut=False)
            expect_finished(stream)
            self.record("STREAM", "completed", (time.perf_counter() - sent) * 1000)
            if stream.gaps:  # merged chunks of a client that fell behind: the text must add up
                expect_same_text(stream.content, self.final_object(tenant, stream.run_id))


class CancellingUser(SluiceUser):
    @task
    def cancel_mid_stream(self) -> None:
        tenant = next(self._tenants)
        body = self.body(self.settings.max_tokens * 8)
        resp, sent = self.post_chat(tenant, body, "chat stream, to cancel")
        with checked(resp):
            if not self.admitted(resp, tenant):
                return
            stream = self.open_stream(resp, tenant, sent, cut=True)
            if stream.done:  # the model stopped before the cut: nothing left to cancel
                expect_finished(stream)
                return
            asked = time.perf_counter()
            status = self.cancel(tenant, stream.run_id)
            if status is None:
                return
            stream.read()
            expect_cancelled(stream, status)
            kind = "stream ended cancelled" if status == "cancelled" else "too late: completed"
            self.record("CANCEL", kind, (time.perf_counter() - asked) * 1000)

    def cancel(self, tenant: Tenant, run_id: str) -> str | None:
        """The run's terminal status as `…/cancel` answers it; None after a failure."""
        with checked(
            self.client.post(
                f"{CHAT}/{run_id}/cancel",
                headers=tenant.auth,
                catch_response=True,
                name=f"{RUN}/cancel",
            )
        ) as resp:
            if resp.status_code != 200:
                raise unexpected_status(resp, "the cancel")
            status = resp.json().get("status")
            if status not in ("cancelled", "completed"):
                raise Unexpected(f"the cancel answered status {status!r}")
            return status
        return None


class ResumingUser(SluiceUser):
    def on_start(self) -> None:
        super().on_start()
        self._by_header = itertools.cycle((False, True))

    @task
    def disconnect_and_resume(self) -> None:
        tenant = next(self._tenants)
        body = self.body(self.settings.max_tokens * 2)
        resp, sent = self.post_chat(tenant, body, "chat stream, dropped")
        first = None
        with checked(resp):
            if not self.admitted(resp, tenant):
                return
            first = self.open_stream(resp, tenant, sent, cut=True)
            resp.close()  # the client goes away mid-stream; the run waits out its grace
        if first is not None and first.run_id is not None and not first.done:
            self.resume(tenant, first, next(self._by_header))

    def resume(self, tenant: Tenant, first: ChatStream, by_header: bool) -> None:
        after = first.last_id
        params, headers = {"stream": "true"}, dict(tenant.auth)
        if by_header:
            headers["Last-Event-ID"] = str(after)
        else:
            params["starting_after"] = str(after)
        how = "Last-Event-ID" if by_header else "starting_after"
        sent = time.perf_counter()
        resp = self.client.get(
            f"{CHAT}/{first.run_id}",
            params=params,
            headers=headers,
            stream=True,
            catch_response=True,
            name=f"{RUN}?stream=true ({how})",
        )
        with checked(resp):
            if resp.status_code != 200:
                raise unexpected_status(resp, "the resume")
            expect_event_stream(resp)
            rest = ChatStream(resp.iter_content(None), sent, first_id=after + 1)
            rest.read()
            if rest.run_id != first.run_id:
                raise Unexpected("the resume streamed another run")
            expect_finished(rest)
            expect_same_text(first.content + rest.content, self.final_object(tenant, rest.run_id))
            self.record("RESUME", f"gap-free by {how}", rest.ttft_ms() or 0.0)


class IdempotentUser(SluiceUser):
    def on_start(self) -> None:
        super().on_start()
        self._streamed = itertools.cycle((False, True))

    @task
    def retry_with_key(self) -> None:
        tenant = next(self._tenants)
        if next(self._streamed):
            self.repeat_dropped_stream(tenant)
        else:
            self.repeat_object(tenant)

    def repeat_object(self, tenant: Tenant) -> None:
        key = f"load-{uuid.uuid4()}"
        body = self.body(self.settings.max_tokens, stream=False)
        resp, _ = self.post_chat(tenant, body, "chat with a key", key)
        original = None
        with checked(resp):
            if self.admitted(resp, tenant):
                original = resp.json()
        if original is None:
            return
        resp, sent = self.post_chat(tenant, body, "chat, repeat of a key", key)
        with checked(resp):
            expect_replayed(resp)
            again = resp.json()
            if (again["id"], again["choices"]) != (original["id"], original["choices"]):
                raise Unexpected("a repeat answered another completion")
            self.record("REPLAY", "same object", (time.perf_counter() - sent) * 1000)
        other = {**body, "max_tokens": body["max_tokens"] + 1}
        resp, _ = self.post_chat(tenant, other, "chat, a key with another body", key)
        with checked(resp):
            if resp.status_code != 422:
                raise unexpected_status(resp, "a key reused with another body")
            if resp.json()["error"]["code"] != "idempotency_key_reused":
                raise Unexpected("a key reused with another body: not idempotency_key_reused")
            resp.success()

    def repeat_dropped_stream(self, tenant: Tenant) -> None:
        key = f"load-{uuid.uuid4()}"
        body = self.body(self.settings.max_tokens * 2)
        resp, sent = self.post_chat(tenant, body, "chat stream with a key, dropped", key)
        first = None
        with checked(resp):
            if not self.admitted(resp, tenant):
                return
            first = self.open_stream(resp, tenant, sent, cut=True)
            resp.close()  # as if the network failed: the client retries with the same key
        if first is None or first.run_id is None:
            return
        resp, sent = self.post_chat(tenant, body, "chat stream, repeat of a key", key)
        with checked(resp):
            expect_replayed(resp)
            expect_event_stream(resp)
            again = ChatStream(resp.iter_content(None), sent)
            again.read()
            if again.run_id != first.run_id:
                raise Unexpected("a repeat streamed another run")
            expect_finished(again)
            if not again.content.startswith(first.content):
                raise Unexpected("a replayed stream's text differs from the first try's")
            self.record("REPLAY", "same stream from event 1", again.ttft_ms() or 0.0)


def expect_replayed(resp: ResponseContextManager) -> None:
    if resp.status_code != 200:  # a replay costs no quota, so not even a throttled tenant's 429
        raise unexpected_status(resp, "a repeat with the same key")
    if resp.headers.get("idempotent-replayed") != "true":
        raise Unexpected("a repeat without idempotent-replayed: true")
