"""A run's span, after the OpenTelemetry GenAI semantic conventions (docs/tracing.md).

One span per run, named `{gen_ai.operation.name} {gen_ai.request.model}` (`chat …`,
`text_completion …`), kind CLIENT (the gateway calls the model for its client), backdated to
the request's arrival and ended when the run settles; the facts of the run-end line become its
attributes (`gen_ai.*` where the conventions name them, `sluice.*` for the rest). What happens
on the way (a retry, a fallback, a migration, a resume) is a span event. Only imported when
tracing is on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import orjson
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from common.tracing import build_provider, ns_ago, parent_from, traceparent, tracer_of
from gateway.runs.accounting import RunAccounting
from gateway.runs.spec import RunOutcome, RunSpec
from gateway.runs.status import PUBLIC_STATUS, RunStatus
from gateway.tracing import Settle

PROVIDER = "sluicegate"  # gen_ai.provider.name: the gateway serves the model to its client
_ERRORS = (RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.REJECTED)
_GIVEN = ("temperature", "top_p")  # recorded only where the request set them


class OtelRunTracer:
    """The gateway's tracer: one provider, one exporter, for every run."""

    def __init__(self, endpoint: str, ratio: float, service: str = "sluicegate") -> None:
        self.provider: TracerProvider = build_provider(endpoint, ratio, service)
        self.tracer = tracer_of(self.provider)

    def prepare(
        self, headers: Mapping[str, str], content: bool, body: Mapping[str, Any]
    ) -> OtelRunTrace:
        given = tuple(name for name in _GIVEN if name in body)
        return OtelRunTrace(self.tracer, parent_from(headers), content, given)

    async def close(self) -> None:
        """Export what is left (a blocking HTTP call: off the event loop)."""
        await asyncio.to_thread(self.provider.shutdown)


class OtelRunTrace:
    __slots__ = ("_acct", "_content", "_given", "_parent", "_tp", "dispatched_at", "span", "tracer")

    def __init__(
        self, tracer: Tracer, parent: Context | None, content: bool, given: tuple[str, ...]
    ) -> None:
        self.tracer = tracer
        self._parent = parent
        self._content = content
        self._given = given
        self._acct: RunAccounting | None = None
        self._tp = ""
        self.span: Span | None = None
        self.dispatched_at: float | None = None

    @property
    def traceparent(self) -> str:
        """NOTE: read by the adapter as it makes the upstream call: the first read marks when
        the run left the gateway's queue (`sluice.queue_wait_s`)."""
        if self.dispatched_at is None:
            self.dispatched_at = time.monotonic()
        return self._tp

    def start(self, spec: RunSpec, settle: Settle | None) -> Settle:
        if self.span is None:  # once: a run whose upstream call left early opened it then
            self._open(spec)

        async def settle_traced(outcome: RunOutcome) -> None:
            self.end(spec, outcome)
            if settle is not None:
                await settle(outcome)

        return settle_traced

    def _open(self, spec: RunSpec) -> None:
        chat = spec.chat
        operation = "chat" if chat.prompt is None else "text_completion"
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": chat.model,
            "sluice.run_id": spec.run_id,
            "sluice.tenant": spec.tenant,
        }
        if chat.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = chat.max_tokens
        for name in self._given:
            attributes[f"gen_ai.request.{name}"] = float(getattr(chat, name))
        if chat.n != 1:
            attributes["gen_ai.request.choice.count"] = chat.n
        if chat.share is not None:
            attributes["sluice.service_tier"] = chat.share.tier
        if self._content:
            attributes["gen_ai.input.messages"] = _input_text(chat)
        started = ns_ago(time.monotonic() - spec.started, time.time_ns())
        self.span = span = self.tracer.start_span(
            f"{operation} {chat.model}",
            context=self._parent,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=started,
        )
        self._tp = traceparent(span)
        chat.trace = self

    def abandon(self, error: str) -> None:
        span = self.span
        if span is None or not span.is_recording():
            return
        span.set_attribute("error.type", error)
        span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def attach(self, acct: RunAccounting) -> dict[str, str] | None:
        self._acct = acct
        span = self.span
        if span is None or not span.is_recording():
            return None
        return {"trace_id": f"{span.get_span_context().trace_id:032x}"}

    def event(self, name: str, **attributes: str | int) -> None:
        if self.span is not None:
            self.span.add_event(name, attributes)

    def end(self, spec: RunSpec, outcome: RunOutcome) -> None:
        """The run-end facts as attributes, then the span's end (at its terminal state)."""
        span = self.span
        if span is None or not span.is_recording():
            return
        span.set_attributes(_outcome_attributes(outcome, self._content, spec.chat.n))
        acct = self._acct
        if self.dispatched_at is not None:
            span.set_attribute("sluice.queue_wait_s", max(0.0, self.dispatched_at - spec.started))
        if acct is not None and spec.safety is not None and acct.first_token_at is not None:
            first = acct.first_arrival_at or acct.first_token_at
            span.set_attribute("sluice.safety_hold_s", max(0.0, acct.first_token_at - first))
        if outcome.status in _ERRORS:
            span.set_attribute("error.type", outcome.terminal.cause)
            span.set_status(Status(StatusCode.ERROR, outcome.terminal.cause))
        span.end(ns_ago(time.monotonic() - spec.started - outcome.e2e_s, time.time_ns()))


def _outcome_attributes(outcome: RunOutcome, content: bool, n: int) -> dict[str, Any]:
    terminal = outcome.terminal
    choices: list[dict[str, Any]] = []
    if terminal.completion and (content or n > 1):  # NOTE: parsed only when it must be read
        choices = (terminal.completion_object() or {}).get("choices") or []
    reasons = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    if not reasons and terminal.finish_reason:
        reasons = [terminal.finish_reason]
    attributes: dict[str, Any] = {
        "gen_ai.response.id": outcome.run_id,  # the completion's id
        "gen_ai.response.model": outcome.model,
        "gen_ai.response.finish_reasons": reasons,
        "gen_ai.usage.output_tokens": outcome.generated_tokens,
        "sluice.status": PUBLIC_STATUS[outcome.status],
        "sluice.cause": terminal.cause,
        "sluice.sent_tokens": outcome.sent_tokens,
        "sluice.tail_tokens": outcome.tail_tokens,
    }
    if outcome.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = outcome.prompt_tokens
    if outcome.ttft_s is not None:
        attributes["sluice.ttft_s"] = outcome.ttft_s
    if outcome.cancel_source is not None:
        attributes["sluice.cancel_source"] = outcome.cancel_source
    if outcome.safety is not None:
        attributes["sluice.safety_policy"] = outcome.safety
    if content and choices:
        attributes["gen_ai.output.messages"] = _output_text(choices)
    return attributes


def _input_text(chat: Any) -> str:
    """The prompt as the conventions' `gen_ai.input.messages` (JSON), or a completion's raw
    prompt; only for a tenant that opted in (`trace_content`)."""
    if chat.prompt is not None:
        prompt = chat.prompt if isinstance(chat.prompt, str) else list(chat.prompt)
        return orjson.dumps(
            [{"role": "user", "parts": [{"type": "text", "content": prompt}]}]
        ).decode()
    return orjson.dumps(
        [
            {"role": m.role, "parts": [{"type": "text", "content": m.content or ""}]}
            for m in chat.messages
        ]
    ).decode()


def _output_text(choices: list[dict[str, Any]]) -> str:
    out = []
    for choice in choices:
        message = choice.get("message") or {}
        text = message.get("content") if message else choice.get("text")
        out.append(
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": text or ""}],
                "finish_reason": choice.get("finish_reason"),
            }
        )
    return orjson.dumps(out).decode()
