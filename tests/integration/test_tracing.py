"""Traces of runs (docs/tracing.md), exported over real OTLP/HTTP to a receiver in the test: a
run is one span after the GenAI conventions, its upstream call carries the run span as its
`traceparent`, a client's `traceparent` is honoured, a fallback is an event, sampling and the
content opt-in hold, histograms carry the trace as an exemplar in an OpenMetrics scrape, and a
gateway without the flag exports nothing and never loads the tracing code."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import tomlkit
from openai import APIStatusError, AsyncOpenAI
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from gateway.app_keys import OPENER
from gateway.state.run_store import StoreUnavailable
from policies.tenants_file import create_key
from testkit.otlp_receiver import otlp_receiver, span_named
from testkit.scripted_upstream import UpstreamState, make_app
from tests.support.gateway import API_KEY, gateway_app

CLIENT_KIND = 3  # SpanKind.SPAN_KIND_CLIENT in OTLP
ERROR = {"error": {"message": "upstream internal detail", "type": "server_error"}}
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # export within 20 ms, not 5 s
    with otlp_receiver() as receiver:
        yield receiver


def traced_app(url: str, receiver, **settings):
    return gateway_app(
        upstream=[f"{m}={url}" for m in ("scripted", "first", "second")],
        models={"chat": {"targets": ["first", "second"]}},
        otlp_endpoint=receiver.endpoint,
        **settings,
    )


async def openai_client(aiohttp_client, app, key: str = API_KEY):
    client = await aiohttp_client(app)
    return client, AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


async def stream_chat(api: AsyncOpenAI, model: str = "scripted", **extra) -> str:
    """One streamed run to its end; its completion id."""
    stream = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], stream=True, **extra
    )
    ids = {chunk.id async for chunk in stream}
    (run_id,) = ids
    return run_id


async def test_a_run_is_one_client_span_after_the_genai_conventions(
    upstream, receiver, aiohttp_client, store_settings
):
    """On Redis the upstream call leaves before the run's opening is back (it can refuse
    nothing here, gateway/runs/early_upstream.py): the span opens first, and the call carries
    it all the same."""
    state, url = upstream
    _, api = await openai_client(aiohttp_client, traced_app(url, receiver, **store_settings))
    run_id = await stream_chat(
        api, max_tokens=3, temperature=0.5, stream_options={"include_usage": True}
    )
    span = await receiver.wait(lambda s: span_named(s, "chat scripted"), "the run's span")
    assert span.kind == CLIENT_KIND
    assert span.parent_id == ""  # no caller's traceparent: a root
    a = span.attributes
    assert {k: v for k, v in a.items() if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "sluicegate",
        "gen_ai.request.model": "scripted",
        "gen_ai.request.max_tokens": 3,
        "gen_ai.request.temperature": 0.5,  # given; top_p was not, so it is not recorded
        "gen_ai.response.model": "scripted",
        "gen_ai.response.id": run_id,
        "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 3,
    }
    assert a["sluice.run_id"] == run_id
    assert a["sluice.tenant"] == "default"
    assert a["sluice.status"] == "completed"
    assert a["sluice.tail_tokens"] == 0
    assert 0 <= a["sluice.queue_wait_s"] <= a["sluice.ttft_s"] <= span.seconds < 30
    assert "sluice.cancel_source" not in a
    # the upstream call carried the run span as its parent, sampled
    (record,) = state.records
    assert record.headers["traceparent"] == f"00-{span.trace_id}-{span.span_id}-01"


@pytest.mark.parametrize("store_settings", ["redis"], indirect=True)
async def test_a_run_whose_opening_failed_after_its_call_left_ends_its_span_an_error(
    upstream, receiver, aiohttp_client, store_settings
):
    state, url = upstream
    app = traced_app(url, receiver, **store_settings)
    _, api = await openai_client(aiohttp_client, app)

    async def away(*args):
        raise StoreUnavailable("redis is away")

    app[OPENER].open = away
    with pytest.raises(APIStatusError) as refused:
        await stream_chat(api, max_tokens=2)
    assert refused.value.status_code == 503
    span = await receiver.wait(lambda s: span_named(s, "chat scripted"), "the run's span")
    assert span.attributes["error.type"] == "StoreUnavailable"
    (record,) = state.records  # the call that left early, closed: it carried the span
    assert record.headers["traceparent"] == f"00-{span.trace_id}-{span.span_id}-01"


async def test_a_callers_traceparent_makes_the_run_its_child(upstream, receiver, aiohttp_client):
    state, url = upstream
    _, api = await openai_client(aiohttp_client, traced_app(url, receiver))
    caller = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    await stream_chat(api, max_tokens=2, extra_headers={"traceparent": caller})
    span = await receiver.wait(lambda s: span_named(s, "chat scripted"), "the run's span")
    assert (span.trace_id, span.parent_id) == (CALLER_TRACE, CALLER_SPAN)
    assert state.records[0].headers["traceparent"].startswith(f"00-{CALLER_TRACE}-{span.span_id}")


async def test_a_fallback_is_an_event_on_the_run_span(upstream, receiver, aiohttp_client):
    state, url = upstream
    state.status_for["first"] = (503, ERROR)
    _, api = await openai_client(aiohttp_client, traced_app(url, receiver))
    await stream_chat(api, "chat", max_tokens=2)
    span = await receiver.wait(lambda s: span_named(s, "chat chat"), "the alias run's span")
    assert span.attributes["gen_ai.request.model"] == "chat"
    assert span.attributes["gen_ai.response.model"] == "second"
    assert ("sluice.fallback", {"target": "first", "reason": "unavailable"}) in span.events
    # both targets' calls name the one run span as their parent
    parents = {r.headers["traceparent"] for r in state.records}
    assert parents == {f"00-{span.trace_id}-{span.span_id}-01"}


async def test_a_retry_on_another_pool_member_is_an_event(receiver, aiohttp_server, aiohttp_client):
    """Two members serve `scripted`, one answering 503: whichever run lands on it first is
    retried on the other, and its span says so; its one span is the parent of both calls."""
    broken, healthy = UpstreamState(), UpstreamState()
    broken.status_for["scripted"] = (503, ERROR)
    urls = [
        f"http://127.0.0.1:{(await aiohttp_server(make_app(st))).port}/v1"
        for st in (broken, healthy)
    ]
    app = gateway_app(upstream=[f"scripted={u}" for u in urls], otlp_endpoint=receiver.endpoint)
    _, api = await openai_client(aiohttp_client, app)
    run_id = None
    for i in range(20):  # the pool routes by prompt: vary it until one lands on the 503
        stream = await api.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": f"Hi {i}"}],
            stream=True,
            max_tokens=1,
        )
        ids = {chunk.id async for chunk in stream}
        if broken.records:
            (run_id,) = ids
            break
    assert run_id is not None, "no run was routed to the failing member"

    def retried(spans):
        return next((s for s in spans if s.attributes.get("sluice.run_id") == run_id), None)

    span = await receiver.wait(retried, "the retried run's span")
    (event,) = [e for e in span.events if e[0] == "sluice.retry"]
    assert event[1] == {"member": "scripted", "reason": "unavailable"}
    calls = [r.headers["traceparent"] for r in (*broken.records, *healthy.records[-1:])]
    assert set(calls) == {f"00-{span.trace_id}-{span.span_id}-01"}


async def test_a_cancelled_run_says_who_cancelled_it(upstream, receiver, aiohttp_client):
    state, url = upstream
    state.delay_ms = 50
    client, api = await openai_client(aiohttp_client, traced_app(url, receiver))
    stream = await api.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=500
    )
    first = await anext(stream)
    resp = await client.post(
        f"/v1/chat/completions/{first.id}/cancel", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert resp.status == 200
    await stream.close()
    span = await receiver.wait(lambda s: span_named(s, "chat scripted"), "the run's span")
    assert span.attributes["sluice.status"] == "cancelled"
    assert span.attributes["sluice.cancel_source"] == "client"
    assert span.attributes["sluice.tail_tokens"] >= 0


async def test_histograms_carry_the_trace_as_an_exemplar_in_openmetrics(
    upstream, receiver, aiohttp_client
):
    _, url = upstream
    client, api = await openai_client(aiohttp_client, traced_app(url, receiver))
    await stream_chat(api, max_tokens=2)
    span = await receiver.wait(lambda s: span_named(s, "chat scripted"), "the run's span")
    resp = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert resp.content_type == "application/openmetrics-text"
    families = {f.name: f for f in om_families(await resp.text())}
    for name in ("sluice_ttft_seconds", "sluice_e2e_seconds"):
        exemplars = [s.exemplar for s in families[name].samples if s.exemplar is not None]
        assert [e.labels for e in exemplars] == [{"trace_id": span.trace_id}], name
    # a plain scrape is Prometheus text as before, without exemplars
    plain = await client.get("/metrics")
    assert plain.content_type == "text/plain"
    text = await plain.text()
    assert "trace_id" not in text
    assert any(f.name == "sluice_ttft_seconds" for f in text_string_to_metric_families(text))


async def test_ratio_zero_exports_nothing_and_says_so_downstream(
    upstream, receiver, aiohttp_client
):
    state, url = upstream
    client, api = await openai_client(
        aiohttp_client, traced_app(url, receiver, trace_sample_ratio=0.0)
    )
    await stream_chat(api, max_tokens=2)
    await client.close()  # the app's cleanup exports whatever is left, before it returns
    assert receiver.posts == 0
    # the upstream hears the decision: not sampled, so its spans are not recorded either
    assert state.records[0].headers["traceparent"].endswith("-00")


async def test_content_is_recorded_only_for_a_tenant_that_opts_in(
    upstream, receiver, aiohttp_client, tmp_path
):
    _, url = upstream
    path = tmp_path / "tenants.toml"
    tenants = {"open": {"trace_content": True}, "closed": {}}
    path.write_text(tomlkit.dumps({"tenants": tenants}), encoding="utf-8")
    keys = {name: create_key(path, name)[0] for name in tenants}
    app = traced_app(url, receiver, tenants=str(path), api_key=[])
    client = await aiohttp_client(app)
    for key in keys.values():
        api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
        await stream_chat(api, max_tokens=2)

    def both(spans):
        runs = {s.attributes.get("sluice.tenant"): s for s in spans if s.name == "chat scripted"}
        return runs if len(runs) == 2 else None

    runs = await receiver.wait(both, "both tenants' spans")
    opened = runs["open"].attributes
    assert '"content":"Hi"' in opened["gen_ai.input.messages"]
    assert '"content":"tok0 tok1 "' in opened["gen_ai.output.messages"]
    closed = runs["closed"].attributes
    assert "gen_ai.input.messages" not in closed and "gen_ai.output.messages" not in closed


async def test_without_the_flag_no_traceparent_goes_upstream(upstream, aiohttp_client):
    state, url = upstream
    _, api = await openai_client(aiohttp_client, gateway_app(upstream=[f"scripted={url}"]))
    caller = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    await stream_chat(api, max_tokens=2, extra_headers={"traceparent": caller})
    assert "traceparent" not in state.records[0].headers


@pytest.mark.process  # a fresh interpreter
def test_without_the_flag_the_tracing_code_is_never_loaded():
    """In a fresh interpreter (this one has loaded it for the tests above): an app built without
    --otlp-endpoint serves a run and has imported neither the tracing modules nor the
    OpenTelemetry SDK's tracing and exporter (redis-py may load OpenTelemetry's metrics API)."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from aiohttp.test_utils import TestClient, TestServer
        from testkit.scripted_adapter import ScriptedAdapter, text_script
        from tests.support.gateway import AUTH, chat_body, gateway_app

        async def main():
            adapter = ScriptedAdapter("scripted", text_script(["hi"]))
            async with TestClient(TestServer(gateway_app([adapter]))) as client:
                resp = await client.post(
                    "/v1/chat/completions", json=chat_body(stream=True), headers=AUTH
                )
                assert resp.status == 200, resp.status
                assert b"[DONE]" in await resp.read()
            assert adapter.requests[0].trace is None
            loaded = [
                m for m in sys.modules
                if m in ("common.tracing", "gateway.tracing.run_trace", "workers.tracing")
                or m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))
            ]
            print("loaded:", loaded)

        asyncio.run(main())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "loaded: []"
