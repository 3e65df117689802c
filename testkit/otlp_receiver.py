"""A real OTLP/HTTP trace receiver for tests and benches: `POST /v1/traces`, protobuf decoded with
opentelemetry-proto's ExportTraceServiceRequest, spans kept in arrival order.

It runs on a thread of its own with its own event loop, so gateways in other processes and in
the test's own loop export to it alike, and a test can wait for spans from either side.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from gateway.backends.local_worker import free_port


@dataclass(slots=True)
class SpanSeen:
    """One exported span, flattened: ids as hex, attributes as Python values."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    service: str
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status_code: int = 0

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(body: bytes) -> list[SpanSeen]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        service = _attributes(resource_spans.resource.attributes).get("service.name", "")
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                spans.append(
                    SpanSeen(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        service=service,
                        attributes=_attributes(s.attributes),
                        events=[(e.name, _attributes(e.attributes)) for e in s.events],
                        status_code=s.status.code,
                    )
                )
    return spans


class OtlpReceiver:
    """The spans received so far; `endpoint` is what `--otlp-endpoint` takes."""

    def __init__(self, port: int) -> None:
        self.endpoint = f"http://127.0.0.1:{port}"
        self.spans: list[SpanSeen] = []
        self.posts = 0
        self._arrived = threading.Condition()

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        spans = decode(await request.read())
        with self._arrived:
            self.spans += spans
            self.posts += 1
            self._arrived.notify_all()
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    def wait_sync(
        self, check: Callable[[list[SpanSeen]], Any], what: str, within: float = 30.0
    ) -> Any:
        """The first truthy `check(spans)`, re-checked as each export arrives."""
        deadline = time.monotonic() + within
        with self._arrived:
            while not (found := check(list(self.spans))):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {within} s waiting for {what}")
                self._arrived.wait(left)
            return found

    async def wait(
        self, check: Callable[[list[SpanSeen]], Any], what: str, within: float = 30.0
    ) -> Any:
        return await asyncio.to_thread(self.wait_sync, check, what, within)

    def named(self, prefix: str) -> list[SpanSeen]:
        with self._arrived:
            return [s for s in self.spans if s.name.startswith(prefix)]


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver on a free loopback port until the block ends."""
    receiver = OtlpReceiver(free_port())
    app = web.Application()
    app.router.add_post("/v1/traces", receiver._traces)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    port = int(receiver.endpoint.rsplit(":", 1)[1])
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, name="otlp receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def span_named(spans: list[SpanSeen], prefix: str) -> SpanSeen | None:
    return next((s for s in spans if s.name.startswith(prefix)), None)
