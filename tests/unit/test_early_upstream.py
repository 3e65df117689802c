"""On Redis, a run whose opening can refuse nothing (no Idempotency-Key, a tenant without
limits), or is all but sure not to (a tenant far from its limits, policies/headroom.py), sends
its upstream request before the opening's round trip is back, and the two overlap
(gateway/runs/early_upstream.py); the client still hears of the run only once its record is
written. Where the opening fails, or the run ends before its first step, the stream begun is
closed (the work upstream aborted) and nothing is left behind."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import tomlkit

from adapters.requests import ChatRequest, Message
from gateway.app_keys import FLOWS, OPENER, QUOTAS, RUNS
from gateway.app_keys import METRICS as METRICS_KEY
from gateway.metrics import GatewayMetrics
from gateway.runs.deadlines import Deadlines
from gateway.runs.driver import RunDriver
from gateway.runs.early_upstream import EarlyUpstream
from gateway.runs.spec import RunSpec
from gateway.runs.status import Phase, RunStatus
from gateway.state.run_store import RunRecord, StoreUnavailable
from gateway.state.run_store_memory import MemoryRunStore
from policies.quotas import QuotaLimits, QuotaRequest
from policies.tenants_file import create_key
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events, stream_text
from tests.support.waiting import until

PIECES = [f"{i} " for i in range(6)]
ON_REDIS = pytest.mark.parametrize("store_settings", ["redis"], indirect=True)


class Recorded(ScriptedAdapter):
    """Its streams' entries and the opener's replies in one order."""

    def __init__(self, order: list[str], delay: float = 0.0) -> None:
        super().__init__("scripted", text_script(PIECES, delay=delay))
        self.order = order

    async def stream(self, request, request_id):
        self.order.append("upstream")
        async for batch in super().stream(request, request_id):
            yield batch


def record_openings(app, order: list[str]) -> None:
    """Each opening's reply into `order` (the app has started: its opener exists)."""
    opener = app[OPENER]
    real = opener.open

    async def open_recorded(*args):
        opening = await real(*args)
        order.append("opened")
        return opening

    opener.open = open_recorded


async def stream(client, headers=AUTH, **extra) -> list:
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=headers)
    assert resp.status == 200, await resp.text()
    return [e.json() for e in sse_events(await resp.read())[:-1]]


@ON_REDIS
async def test_a_run_that_can_be_refused_nothing_goes_upstream_before_it_is_recorded(
    aiohttp_client, store_settings
):
    order: list[str] = []
    app = gateway_app([Recorded(order)], **store_settings)
    client = await aiohttp_client(app)
    record_openings(app, order)
    assert stream_text(await stream(client)) == "".join(PIECES)
    assert order == ["upstream", "opened"]


@ON_REDIS
async def test_a_run_with_a_key_to_claim_waits_for_its_opening(aiohttp_client, store_settings):
    """A key held by another run answers from that run: nothing may have gone upstream."""
    order: list[str] = []
    app = gateway_app([Recorded(order)], **store_settings)
    client = await aiohttp_client(app)
    record_openings(app, order)
    keyed = {**AUTH, "Idempotency-Key": "early-1"}
    assert stream_text(await stream(client, keyed)) == "".join(PIECES)
    assert order == ["opened", "upstream"]


def limited_tenant(tmp_path, **limits) -> tuple[str, dict[str, str]]:
    """A tenants file with one tenant, `acme`, with `limits`; and its key's headers."""
    path = tmp_path / "tenants.toml"
    path.write_text(tomlkit.dumps({"tenants": {"acme": limits}}), encoding="utf-8")
    key, _ = create_key(path, "acme")
    return str(path), {"Authorization": f"Bearer {key}"}


def early_counts(app) -> dict[str, float]:
    counter = app[METRICS_KEY].early_upstreams
    return {o: counter.labels(o)._value.get() for o in ("kept", "closed")}


@ON_REDIS
@pytest.mark.parametrize(
    ("limits", "second", "kept"),
    [
        ({"rpm": 100, "tpm": 100000, "max_concurrent": 8}, ["upstream", "opened"], 1),
        ({"rpm": 2}, ["opened", "upstream"], 0),  # one used: 2 of 2 is past the margin
    ],
    ids=["far-from-its-limits", "near-its-limit"],
)
async def test_a_limited_tenant_goes_early_only_when_its_usage_is_known_to_be_far_from_them(
    aiohttp_client, store_settings, tmp_path, limits, second, kept
):
    """Its first run waits for its admission (nothing known of its usage here); the next goes
    upstream first only if that admission's report puts it far from every limit."""
    path, headers = limited_tenant(tmp_path, **limits)
    order: list[str] = []
    app = gateway_app([Recorded(order)], tenants=path, api_key=[], **store_settings)
    client = await aiohttp_client(app)
    record_openings(app, order)
    for _ in range(2):
        assert stream_text(await stream(client, headers)) == "".join(PIECES)
    assert order == ["opened", "upstream", *second]
    assert early_counts(app) == {"kept": kept, "closed": 0}


@ON_REDIS
async def test_a_guess_that_misses_closes_the_stream_begun_and_answers_the_refusal(
    aiohttp_client, store_settings, tmp_path
):
    """Another replica took the tenant's last requests after this one last heard: the run went
    upstream early, the admission refuses it; the stream is closed (its work aborted), the
    client gets the 429 the limit gives, and nothing is left held. The tenant's next run waits
    for its opening."""
    path, headers = limited_tenant(tmp_path, rpm=4)
    order: list[str] = []
    adapter = Recorded(order, delay=0.05)
    app = gateway_app([adapter], tenants=path, api_key=[], **store_settings)
    client = await aiohttp_client(app)
    record_openings(app, order)
    assert stream_text(await stream(client, headers)) == "".join(PIECES)
    await until(lambda: not app[RUNS].drivers, "the first run to settle")
    limits = QuotaLimits(rpm=4)
    for n in range(3):  # another replica's admissions, on the same Redis
        await app[QUOTAS].admit(QuotaRequest("acme", f"elsewhere-{n}", 10, limits))
    order.clear()
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=headers)
    assert resp.status == 429
    error = (await resp.json())["error"]
    assert error["code"] == "rate_limit_exceeded" and "requests" in error["message"]
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert order == ["upstream"]
    closed = [run for run, aborted in adapter.aborted.items() if aborted]
    assert len(closed) == 1  # the early stream: its work upstream stopped
    assert early_counts(app) == {"kept": 0, "closed": 1}
    assert not app[RUNS].drivers
    assert app[FLOWS].of(adapter).in_flight == 0
    assert not app[OPENER].headroom.roomy(QuotaRequest("acme", "next", 10, limits))


@ON_REDIS
@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["first-batch-read", "first-batch-waited"])
async def test_an_opening_that_fails_closes_the_stream_begun_and_leaves_nothing(
    aiohttp_client, store_settings, delay
):
    order: list[str] = []
    adapter = Recorded(order, delay=delay)
    app = gateway_app([adapter], **store_settings)
    client = await aiohttp_client(app)

    async def away(*args):
        raise StoreUnavailable("redis is away")

    app[OPENER].open = away
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "overloaded"
    assert order == ["upstream"]
    assert list(adapter.aborted.values()) == [True]  # closed: the work there stopped
    assert not app[RUNS].drivers
    assert app[FLOWS].of(adapter).in_flight == 0  # its place went back


async def test_a_run_ended_before_its_first_step_closes_the_stream_begun():
    """Its driver never reads it: the driver closes it as it ends."""
    adapter, driver = await driver_reading_early(delay=0.05)
    assert driver.cancel("client")
    outcome = await driver.run()
    assert outcome.terminal.cause == "cancel:client"
    assert adapter.aborted == {"run-1": True}


async def test_a_stop_unconfirmed_while_the_first_batch_is_awaited_closes_the_stream():
    """An upstream that cannot abort in-band has its stream closed (the driver's own cancel of
    its task, which reaches the first batch's task): the run ends as cancelled, not as a
    shutdown."""
    adapter, driver = await driver_reading_early(delay=5.0, abortable=False, confirm_timeout=0.05)
    task = driver.start()
    await until(lambda: driver.phase is Phase.STREAMING, "the driver to read its stream")
    assert driver.cancel("client")
    outcome = await asyncio.wait_for(task, 5.0)
    assert outcome.terminal.cause == "cancel:client"
    assert adapter.aborted == {"run-1": True}


async def test_a_driver_reads_its_early_stream_as_the_adapters_own():
    adapter, driver = await driver_reading_early(delay=0.0)
    assert len(adapter.requests) == 1  # the request left in this step
    outcome = await driver.run()
    assert outcome.terminal.status is RunStatus.COMPLETED
    assert outcome.generated_tokens == len(PIECES)
    frames = [orjson.loads(event[1]) for event in await driver.store.read("run-1", 0)]
    text = "".join(c["delta"].get("content") or "" for f in frames for c in f.get("choices", ()))
    assert text == "".join(PIECES)
    assert adapter.aborted == {"run-1": False}


async def test_an_empty_early_stream_ends_the_readers_loop():
    adapter = ScriptedAdapter("scripted", lambda request: [])
    early = EarlyUpstream(adapter, chat_request(), "run-1")
    assert [batch async for batch in early] == []
    await asyncio.wait_for(early.aclose(), 1.0)


def chat_request() -> ChatRequest:
    return ChatRequest("scripted", [Message("user", "hi")], stream=True)


async def driver_reading_early(
    delay: float, *, abortable: bool = True, confirm_timeout: float = 5.0
) -> tuple[ScriptedAdapter, RunDriver]:
    store = MemoryRunStore()
    await store.create(RunRecord("run-1", "t", "scripted", 0.0))
    adapter = ScriptedAdapter("scripted", text_script(PIECES, delay=delay), abortable=abortable)
    request = chat_request()
    spec = RunSpec("run-1", request, adapter, "t", deadlines=Deadlines())
    early = EarlyUpstream(adapter, request, "run-1")
    driver = RunDriver(
        spec, store, metrics=GatewayMetrics(), confirm_timeout=confirm_timeout, early=early
    )
    return adapter, driver
