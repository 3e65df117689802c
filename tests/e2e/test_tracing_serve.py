"""Traces through a real `sluice serve --otlp-endpoint` and the worker process it starts, on the
tiny model: the worker's span is the child of the run's span (one trace), with its own facts
from the stream it produced, and its queue, prefill and decode laid out beneath it."""

from __future__ import annotations

import pytest
from openai import OpenAI

from testkit.otlp_receiver import otlp_receiver, span_named
from tests.support.serve import serving

KEY = "sk-sluice-e2e-tracing"
SERVER_KIND = 2  # SpanKind.SPAN_KIND_SERVER in OTLP


@pytest.fixture(scope="module")
def traced(tiny_model_dir):
    with otlp_receiver() as receiver:
        flags = ("--otlp-endpoint", receiver.endpoint)
        env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
        with serving(tiny_model_dir, *flags, key=KEY, env=env) as gateway:
            yield gateway, receiver


def one_trace(spans):
    """The run's span, its worker's span and the worker's three phases, once all arrived."""
    run, worker = span_named(spans, "chat "), span_named(spans, "generate ")
    if run is None or worker is None:
        return None
    phases = {s.name: s for s in spans if s.parent_id == worker.span_id}
    return (run, worker, phases) if len(phases) == 3 else None


def test_the_worker_span_is_the_child_of_the_run_span(traced):
    gateway, receiver = traced
    client = OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    run, worker, phases = receiver.wait_sync(one_trace, "the run's and the worker's spans")

    assert (run.service, worker.service) == ("sluicegate", "sluicegate-worker")
    assert worker.trace_id == run.trace_id
    assert worker.parent_id == run.span_id  # the run span made the worker call
    assert worker.kind == SERVER_KIND
    w, r = worker.attributes, run.attributes
    assert w["gen_ai.usage.input_tokens"] == r["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert w["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert w["gen_ai.response.finish_reasons"] == r["gen_ai.response.finish_reasons"]
    assert 0 <= w["sluice.worker.queue_s"] <= w["sluice.worker.ttft_s"] <= worker.seconds
    assert w["sluice.request_id"] == r["sluice.run_id"]
    # the worker's time lies within the run's; its phases follow one another within it
    assert run.start_ns <= worker.start_ns <= worker.end_ns <= run.end_ns
    queue, prefill, decode = phases["queue"], phases["prefill"], phases["decode"]
    assert worker.start_ns == queue.start_ns
    assert queue.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns
    assert decode.end_ns == worker.end_ns
