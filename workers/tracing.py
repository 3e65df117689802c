"""A worker's span per generate call (`--otlp-endpoint`, docs/tracing.md).

The gateway sends the run span's W3C `traceparent` with its call; the worker's span is its child
(kind SERVER: the worker serves the call), and lasts until the stream ends. Its facts come from
the lines the stream carried: the prompt's tokens, the tokens generated, the finish reasons, the
time queued until admitted and to the first token. Its three phases, `queue`, `prefill` (to the
first token) and `decode`, are child spans laid out from those times once the stream is over,
so the engine's loop never touches tracing. Only imported when tracing is on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.tracing import build_provider, parent_from, tracer_of
from wire import api

PROVIDER = "sluicegate"


class GenerateTracer:
    def __init__(self, endpoint: str) -> None:
        """NOTE: a worker has no sampling ratio of its own: it follows its caller's decision
        (parent-based); a call without a `traceparent` is always traced."""
        self.provider = build_provider(endpoint, 1.0, "sluicegate-worker")
        self.tracer = tracer_of(self.provider)

    async def close(self) -> None:
        await asyncio.to_thread(self.provider.shutdown)

    async def traced(
        self,
        headers: Mapping[str, str],
        request_id: str,
        model: str,
        lines: AsyncIterator[api.Line],
    ) -> AsyncIterator[api.Line]:
        """`lines`, passed through, watched by the call's span (closed with it)."""
        start = time.time_ns()
        span = self.tracer.start_span(
            f"generate {model}",
            context=parent_from(headers),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.request.model": model,
                "sluice.request_id": request_id,
            },
            start_time=start,
        )
        if not span.is_recording():  # not sampled: nothing to watch
            async with aclosing(lines):
                async for line in lines:
                    yield line
            return
        seen = _Seen(start)
        try:
            async with aclosing(lines):
                async for line in lines:
                    seen.line(line)
                    yield line
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            seen.record(span, self.tracer, time.time_ns())


class _Seen:
    """What the lines of one stream said, and when."""

    __slots__ = ("admitted", "error", "first", "prompt", "reasons", "start", "tokens")

    def __init__(self, start: int) -> None:
        self.start = start
        self.admitted: int | None = None
        self.first: int | None = None
        self.prompt: int | None = None
        self.tokens = 0
        self.reasons: list[str] = []
        self.error: str | None = None

    def line(self, line: api.Line) -> None:
        kind = type(line)
        if kind is api.TextLine or kind is api.ToolCallLine:
            self.tokens += line.tokens
            if self.first is None:
                self.first = time.time_ns()
        elif kind is api.AdmittedLine:
            self.admitted = time.time_ns()
        elif kind is api.AcceptedLine:
            self.prompt = line.prompt_tokens
        elif kind is api.FinishLine:
            self.reasons.append(line.reason)
        elif kind is api.ErrorLine:
            self.error = line.code

    def record(self, span: trace.Span, tracer: trace.Tracer, end: int) -> None:
        attributes: dict[str, object] = {
            "gen_ai.usage.output_tokens": self.tokens,
            "gen_ai.response.finish_reasons": self.reasons,
        }
        if self.prompt is not None:
            attributes["gen_ai.usage.input_tokens"] = self.prompt
        admitted = self.admitted or self.first
        if admitted is not None:
            attributes["sluice.worker.queue_s"] = (admitted - self.start) / 1e9
        if self.first is not None:
            attributes["sluice.worker.ttft_s"] = (self.first - self.start) / 1e9
        if self.error is not None:
            attributes["error.type"] = self.error
            span.set_status(Status(StatusCode.ERROR, self.error))
        span.set_attributes(attributes)
        context = trace.set_span_in_context(span)
        phases = (("queue", self.start, admitted or end), ("prefill", admitted, self.first))
        for name, begin, until in (*phases, ("decode", self.first, end)):
            if begin is not None and until is not None:
                tracer.start_span(name, context, start_time=begin).end(until)
        span.end(end)
