"""OpenTelemetry set-up shared by the gateway and the workers (`--otlp-endpoint`).

Imported only when tracing is on: a gateway or worker started without the flag never loads
OpenTelemetry. Each process builds its own provider (never the global one, so two apps in one
process, as in tests, keep apart) exporting OTLP/HTTP protobuf in batches from a background
thread; `OTEL_BSP_SCHEDULE_DELAY` and the other standard batch variables apply.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SCOPE = "sluicegate"
_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """`http://collector:4318` → its OTLP/HTTP traces path, `…/v1/traces`."""
    return endpoint.rstrip("/") + "/v1/traces"


def build_provider(endpoint: str, ratio: float, service: str) -> TracerProvider:
    """A provider exporting to `endpoint`. NOTE: parent-based sampling: a run whose caller sent
    a sampled (or unsampled) `traceparent` follows that decision; `ratio` picks the rest by
    trace id, so a gateway and its workers agree on every trace."""
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        sampler=ParentBased(TraceIdRatioBased(ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    return provider


def tracer_of(provider: TracerProvider) -> Tracer:
    return provider.get_tracer(SCOPE)


def parent_from(headers: Mapping[str, str]) -> Context | None:
    """The caller's span as a parent (W3C `traceparent`), or None (a malformed one is ignored,
    as the spec asks)."""
    if "traceparent" not in headers:
        return None
    context = _PROPAGATOR.extract({"traceparent": headers["traceparent"]})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def traceparent(span: Span) -> str:
    """The W3C `traceparent` naming `span` as the parent of what a call it makes starts.
    NOTE: only the `sampled` flag is sent (trace context level 1), which every receiver
    reads; level 2's `random` flag is left out."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags) & 1:02x}"


def ns_ago(seconds: float, now_ns: int) -> int:
    """A wall-clock timestamp `seconds` before `now_ns` (spans take wall time; the run's clocks
    are monotonic)."""
    return now_ns - int(seconds * 1e9)
