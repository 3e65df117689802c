"""End to end, fair sharing (design §12): a real `sluice serve` on the tiny model whose worker
runs two sequences at once (so the gateway sends it four), a tenants file with two tenants,
and the official `openai` client. One tenant floods; the other's requests overtake the flood's
queued runs, in the gateway's queue and then in the engine, which preempts a flood sequence for
them; its `service_tier` is checked against its tiers and echoed in every chunk; a run queued in
the gateway is retrievable and cancellable like any other."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.local_worker import free_port
from policies.auth import hash_key
from tests.support.processes import stop, wait_ready
from tests.support.serve import local_worker_url, serve_command
from tests.support.waiting import until_sync

NOISY, QUIET = "sk-sluice-e2e-noisy", "sk-sluice-e2e-quiet"
TENANTS = f"""\
[tenants.noisy]
keys = ["{hash_key(NOISY)}"]

[tenants.quiet]
tiers = ["default", "priority"]
keys = ["{hash_key(QUIET)}"]
"""
FLOOD = 8  # streams the noisy tenant keeps open: 2 running, 2 waiting in the engine, 4 here
LONG = 900  # tokens a flood stream asks for (of a 1024-token context): still going when the
# test is done with it
PROMPT = [{"role": "user", "content": "Tell me everything."}]


@dataclass
class Served:
    root: str
    base_url: str

    def client(self, key: str) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0)

    def metrics(self, url: str | None = None) -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"{url or self.root}/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def queued(self, tenant: str) -> float:
        key = ("sluice_flow_queue_depth", (("tenant", tenant), ("tier", "default")))
        return self.metrics().get(key, 0.0)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    tenants = tmp_path_factory.mktemp("fairness-e2e") / "tenants.toml"
    tenants.write_text(TENANTS)
    port = free_port()
    command = serve_command(tiny_model_dir, port, "sk-sluice-e2e-unused", "--tenants", str(tenants))
    command += ["--ping-interval", "0.5", "--disconnect-grace", "1"]
    # serve reads SLUICE_MAX_NUM_SEQS and hands it to the local worker: two sequences at once
    env = {**os.environ, "SLUICE_LOG_LEVEL": "warning", "SLUICE_MAX_NUM_SEQS": "2"}
    env["SLUICE_SHUTDOWN_TIMEOUT"] = "2"
    proc = subprocess.Popen(command, env=env)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/readyz")
        yield Served(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1")
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def model(served) -> str:
    (only,) = served.client(QUIET).models.list().data
    return only.id


@dataclass
class Flood:
    """The noisy tenant's streams, each counting the tokens it has received."""

    tokens: list[int] = field(default_factory=lambda: [0] * FLOOD)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def started(self) -> int:
        return sum(1 for t in self.tokens if t)


async def flood(served: Served, model: str) -> Flood:
    out = Flood()
    client = AsyncOpenAI(base_url=served.base_url, api_key=NOISY, max_retries=0)

    async def one(i: int) -> None:
        # lengths apart, so that no two of the flood's runs end in the same engine step
        length = LONG - 37 * i
        stream = await client.chat.completions.create(
            model=model, messages=PROMPT, max_tokens=length, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.tokens[i] += 1

    out.tasks = [asyncio.create_task(one(i)) for i in range(FLOOD)]
    return out


async def stop_flood(out: Flood) -> None:
    for task in out.tasks:
        task.cancel()
    await asyncio.gather(*out.tasks, return_exceptions=True)


async def wait_for(check, what: str, within: float = 30.0) -> None:
    """Poll a condition on the served processes from inside the test's event loop."""
    await asyncio.to_thread(until_sync, check, what, within)


def test_the_quiet_tenants_requests_overtake_a_flood_and_preempt_it(served, model):
    async def scenario() -> None:
        noisy = await flood(served, model)
        await wait_for(lambda: served.queued("noisy") >= 3, "the flood to queue in the gateway")
        quiet = AsyncOpenAI(base_url=served.base_url, api_key=QUIET, max_retries=0)
        for tier in ("default", "priority"):
            waiting = FLOOD - noisy.started()
            stream = await quiet.chat.completions.create(
                model=model,
                messages=PROMPT,
                max_tokens=8,
                temperature=0,
                stream=True,
                service_tier=tier,
            )
            chunks = [chunk async for chunk in stream]
            assert {c.service_tier for c in chunks} == {tier}
            assert chunks[-1].choices[0].finish_reason == "length"
            # it arrived behind the flood's queued runs and finished before they all started
            assert FLOOD - noisy.started() >= 2 and waiting >= 3
        await stop_flood(noisy)

    asyncio.run(scenario())
    worker = served.metrics(local_worker_url(served.root))
    preempted = {
        k[1][0][1]: v for k, v in worker.items() if k[0] == "sluice_worker_preemptions_total"
    }
    assert preempted["fairness"] >= 1 and preempted["priority"] >= 1
    gateway = served.metrics()
    served_tokens = {
        dict(k[1])["tenant"]: v
        for k, v in gateway.items()
        if k[0] == "sluice_tenant_tokens_served_total"
    }
    assert served_tokens["quiet"] == 16


def test_a_tier_the_tenant_may_not_use_is_refused_naming_the_field(served, model):
    with pytest.raises(openai.BadRequestError) as refused:
        served.client(NOISY).chat.completions.create(
            model=model, messages=PROMPT, max_tokens=2, service_tier="priority"
        )
    assert refused.value.body["param"] == "service_tier"
    assert refused.value.code == "service_tier_not_allowed"


def test_a_run_queued_in_the_gateway_is_retrievable_and_cancellable(served, model):
    auth = {"Authorization": f"Bearer {NOISY}"}
    body = {"model": model, "messages": PROMPT, "max_tokens": 4, "stream": True}

    async def scenario() -> None:
        noisy = await flood(served, model)
        await wait_for(lambda: served.queued("noisy") >= 4, "the flood to queue in the gateway")
        async with (
            httpx.AsyncClient(base_url=served.root, headers=auth, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as stream,
        ):
            # its headers come within a heartbeat interval, with its id, while it waits
            run_id = stream.headers["x-sluice-run-id"]
            run = (await http.get(f"/v1/chat/completions/{run_id}")).json()
            assert (run["status"], run["service_tier"]) == ("queued", "default")
            cancel = await http.post(f"/v1/chat/completions/{run_id}/cancel")
            assert cancel.json()["status"] == "cancelled"
            events = [line async for line in stream.aiter_lines() if line.startswith("data:")]
            assert '"code":"cancelled"' in events[0] and events[-1] == "data: [DONE]"
        await stop_flood(noisy)

    asyncio.run(scenario())
    until_sync(lambda: served.queued("noisy") == 0, "the queue to empty once the clients left")
