"""Per-tenant limits (design §5) through the real app, from a tenants TOML file with real keys:
concurrency as the worker itself sees it, rpm and tpm exact across two replicas sharing Redis,
refunds, slots freed by cancelled, failed and timed-out runs, the token budget, model and
max_tokens policy, the quota metrics and headers, and key revocation. Where the store matters a
test runs on the in-process store and on a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import aiohttp
import pytest
import tomlkit
from prometheus_client.parser import text_string_to_metric_families

from adapters.events import ErrorEvent, Finish, TextDelta, Usage
from adapters.requests import ChatRequest
from adapters.worker_client import WorkerAdapter
from gateway.app_keys import AUTH, QUOTAS, RUNS, SETTINGS
from gateway.credentials import tenants_config
from policies.auth import hash_key, key_id
from policies.quotas import estimate_prompt_tokens
from policies.tenants_file import create_key, list_keys, revoke_key
from testkit.scripted_adapter import ScriptedAdapter
from tests.support.gateway import chat_body, gateway_app, sse_events
from tests.support.waiting import until
from tests.support.worker_process import Worker, running_worker

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
TENANT = "acme"
PROMPT = "Hi"  # chat_body's one user message
RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


# -- fixtures and helpers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    log_dir = tmp_path_factory.mktemp("tenant-limits-worker")
    with running_worker(tiny_model_dir, log_dir, "--max-num-seqs", "16") as started:
        yield started


def write_tenants(tmp_path: Path, **fields) -> tuple[Path, dict[str, str]]:
    """A tenants file with one tenant and these fields, plus one key made by `create_key`;
    returns the file and the bearer header of that key."""
    path = tmp_path / "tenants.toml"
    path.write_text(tomlkit.dumps({"tenants": {TENANT: fields}}), encoding="utf-8")
    key, _ = create_key(path, TENANT)
    return path, bearer(key)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def gateway(aiohttp_client, store_settings: dict, path: Path, adapters: list, **settings):
    app = gateway_app(
        adapters=adapters, tenants=str(path), api_key=[], **store_settings, **settings
    )
    return await aiohttp_client(app)


def reservation(max_tokens: int, n: int = 1, prompt: str = PROMPT) -> int:
    """What admission reserves against tpm and the budget, computed as the gateway does."""
    return estimate_prompt_tokens([("user", prompt)]) + max_tokens * n


def exact_script(request: ChatRequest) -> list:
    """Uses exactly what was reserved (no refund, so no timing in the arithmetic): the prompt
    estimate and every max token of every choice."""
    prompt = estimate_prompt_tokens([(m.role, m.content or "") for m in request.messages])
    tokens = request.max_tokens or 16
    steps: list = [TextDelta("x" * tokens, index=i, tokens=tokens) for i in range(request.n)]
    steps += [Finish("length", index=i) for i in range(request.n)]
    return [*steps, Usage(prompt, tokens * request.n)]


def short_script(request: ChatRequest) -> list:
    """Three tokens, whatever max_tokens says (most of the reservation comes back), the last two
    after a pause that keeps the run live while a test looks at it."""
    return [TextDelta("a "), 0.3, TextDelta("b "), TextDelta("c"), Finish("stop"), Usage(5, 3)]


async def post(client, headers: dict[str, str], **body) -> aiohttp.ClientResponse:
    return await client.post("/v1/chat/completions", json=chat_body(**body), headers=headers)


async def error_of(resp: aiohttp.ClientResponse) -> dict:
    return (await resp.json())["error"]


async def rejections(client) -> dict[str, float]:
    """`sluice_quota_rejections_total` by limit, parsed from /metrics: the limits that refused
    (every limit's series is there from the start, at 0)."""
    text = await (await client.get("/metrics")).text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "sluice_quota_rejections":
            for sample in family.samples:
                if sample.name == "sluice_quota_rejections_total" and sample.value:
                    counts[sample.labels["limit"]] = sample.value
    return counts


async def admitted_soon(client, headers, seconds: float = 3.0, **body) -> aiohttp.ClientResponse:
    """Retry a request while it is refused with a 429 (a refusal consumes nothing), for at most
    `seconds`: long enough for a run's settlement, far shorter than the 60 s window or the
    hour-long slot TTL that would hold the capacity if nothing gave it back."""
    deadline = time.monotonic() + seconds
    while True:
        resp = await post(client, headers, **body)
        if resp.status != 429 or time.monotonic() > deadline:
            return resp
        resp.release()
        await asyncio.sleep(0.02)  # NOTE: polling the capacity coming back, within `seconds`


def assert_rate_limited(resp: aiohttp.ClientResponse, error: dict, limit: str) -> None:
    assert resp.status == 429, error
    assert (error["type"], error["code"]) == (limit, "rate_limit_exceeded"), error
    assert f"Rate limit reached for {limit}" in error["message"]
    assert int(resp.headers["retry-after"]) >= 1


# -- 1. concurrency, as the worker sees it ---------------------------------------------------------


async def _worker_stats(worker: Worker, session: aiohttp.ClientSession) -> dict:
    async with session.get(f"{worker.url}/v1/stats") as resp:
        return await resp.json()


async def test_max_concurrent_caps_what_the_worker_holds(
    aiohttp_client, store_settings, worker, tmp_path
):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{worker.url}/v1/model") as resp:
            model = (await resp.json())["id"]
        path, auth = write_tenants(tmp_path, max_concurrent=4, rpm=1000, tpm=1_000_000)
        client = await gateway(aiohttp_client, store_settings, path, [WorkerAdapter(worker.url)])
        peak, polls, stop = 0, 0, asyncio.Event()

        async def watch() -> None:
            nonlocal peak, polls
            while not stop.is_set():
                stats = await _worker_stats(worker, session)
                peak = max(peak, stats["running"] + stats["waiting"])
                polls += 1
                await asyncio.sleep(0.003)  # NOTE: sampling the worker while requests run

        async def one() -> tuple[int, Mapping[str, str], dict | list]:
            body = chat_body(model, stream=True, max_tokens=200, temperature=0)
            resp = await client.post("/v1/chat/completions", json=body, headers=auth)
            if resp.status == 200:
                return 200, resp.headers, sse_events(await resp.read())
            return resp.status, resp.headers, await error_of(resp)

        watcher = asyncio.create_task(watch())
        await until(lambda: polls > 0, "the watcher's first look")
        answers = await asyncio.gather(*(one() for _ in range(50)))
        stop.set()
        await watcher

        ran = [(h, events) for status, h, events in answers if status == 200]
        refused = [(h, error) for status, h, error in answers if status != 200]
        assert polls > 20
        # never above the cap, and the cap was reached: the bound is not vacuous
        assert peak == 4, f"the worker held at most {peak} of this tenant's requests at once"
        assert len(ran) >= 4
        assert len(ran) + len(refused) == 50
        for headers, events in ran:
            assert events[-1].data == "[DONE]"
            assert "error" not in events[-2].json()
            assert headers["x-ratelimit-limit-requests"] == "1000"
            assert headers["x-ratelimit-limit-tokens"] == "1000000"
            assert {"x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens"} <= set(
                headers
            )
        for headers, error in refused:
            assert (error["type"], error["code"]) == ("concurrency", "rate_limit_exceeded")
            assert headers["retry-after"] == "1"
        assert (await rejections(client)) == {"concurrency": len(refused)}

        async def idle() -> bool:
            stats = await _worker_stats(worker, session)
            return (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == (0, 0, 0)

        await until(idle, "the worker to hold nothing")


# -- 2. rpm and tpm, exact across replicas ---------------------------------------------------------


async def replicas(aiohttp_client, store_settings, path, script) -> list:
    """Two replicas sharing Redis; on the in-process store (one replica by design), one."""
    count = 2 if store_settings else 1
    return [
        await gateway(aiohttp_client, store_settings, path, [ScriptedAdapter("scripted", script)])
        for _ in range(count)
    ]


async def fire(clients: list, headers, count: int, **body) -> list[aiohttp.ClientResponse]:
    """`count` requests at once, alternating between the replicas."""
    return await asyncio.gather(
        *(post(clients[i % len(clients)], headers, **body) for i in range(count))
    )


async def total_rejections(clients: list) -> dict[str, float]:
    total: dict[str, float] = {}
    for client in clients:
        for limit, value in (await rejections(client)).items():
            total[limit] = total.get(limit, 0) + value
    return total


async def test_rpm_is_exact_across_replicas(aiohttp_client, store_settings, tmp_path):
    path, auth = write_tenants(tmp_path, rpm=10)
    clients = await replicas(aiohttp_client, store_settings, path, short_script)
    answers = await fire(clients, auth, 30, max_tokens=8)
    ok = [r for r in answers if r.status == 200]
    assert len(ok) == 10
    # every admission saw its own place in the window: 9, 8, … 0 remaining, each once
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == list(range(10))
    for resp in ok:
        assert resp.headers["x-ratelimit-limit-requests"] == "10"
        assert "x-ratelimit-limit-tokens" not in resp.headers
    for resp in answers:
        if resp.status != 200:
            assert_rate_limited(resp, await error_of(resp), "requests")
            assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert await total_rejections(clients) == {"requests": 20}


async def test_tpm_is_exact_across_replicas(aiohttp_client, store_settings, tmp_path):
    max_tokens, n, fits = 40, 2, 4
    cost = reservation(max_tokens, n)
    tpm = fits * cost + cost - 1  # room for `fits` requests and not one token more
    path, auth = write_tenants(tmp_path, tpm=tpm)
    clients = await replicas(aiohttp_client, store_settings, path, exact_script)
    answers = await fire(clients, auth, 30, max_tokens=max_tokens, n=n)
    ok = [r for r in answers if r.status == 200]
    assert len(ok) == fits
    for resp in ok:
        assert len((await resp.json())["choices"]) == n
    remaining = sorted(int(r.headers["x-ratelimit-remaining-tokens"]) for r in ok)
    assert remaining == [tpm - k * cost for k in range(fits, 0, -1)]
    for resp in answers:
        if resp.status != 200:
            assert_rate_limited(resp, await error_of(resp), "tokens")
    assert await total_rejections(clients) == {"tokens": 30 - fits}


async def test_a_request_larger_than_tpm_can_never_pass(aiohttp_client, store_settings, tmp_path):
    path, auth = write_tenants(tmp_path, tpm=reservation(100) - 1)
    (client, *_) = await replicas(aiohttp_client, store_settings, path, exact_script)
    resp = await post(client, auth, max_tokens=100)
    error = await error_of(resp)
    assert_rate_limited(resp, error, "tokens")
    assert "can never pass" in error["message"]


# -- 3. refunds ------------------------------------------------------------------------------------


async def test_unused_tokens_are_refunded_when_the_run_settles(
    aiohttp_client, store_settings, tmp_path
):
    max_tokens = 500
    cost = reservation(max_tokens)
    used = 5 + 3  # the short script's usage: prompt 5, completion 3
    tpm = cost + 20  # one reservation fits; two never do; one plus what a run used does
    assert used <= 20 < cost
    path, auth = write_tenants(tmp_path, tpm=tpm)
    client = await gateway(
        aiohttp_client, store_settings, path, [ScriptedAdapter("scripted", short_script)]
    )
    first = await post(client, auth, stream=True, max_tokens=max_tokens)
    assert first.status == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == str(tpm - cost)
    await first.content.readuntil(b"\n\n")  # the run is live and holds its reservation
    second = await post(client, auth, stream=True, max_tokens=max_tokens)
    assert_rate_limited(second, await error_of(second), "tokens")
    events = sse_events(await first.read())
    assert events[-1].data == "[DONE]"
    # Refunded before the ending was written: the next request passes at once (without the
    # refund the reservation would stay in the window for 60 s).
    again = await post(client, auth, stream=True, max_tokens=max_tokens)
    assert again.status == 200, await again.text()
    assert again.headers["x-ratelimit-remaining-tokens"] == str(tpm - used - cost)
    assert sse_events(await again.read())[-1].data == "[DONE]"


async def test_a_completed_runs_slot_is_free_when_its_client_reads_done(
    aiohttp_client, store_settings, tmp_path
):
    """A client allowed one run at a time sends its next request the moment it reads `[DONE]`:
    never refused (the slot goes back before the ending is written), and its tokens were
    refunded by then as well."""
    path, auth = write_tenants(tmp_path, max_concurrent=1, tpm=10_000)
    client = await gateway(
        aiohttp_client, store_settings, path, [ScriptedAdapter("scripted", short_script)]
    )
    remaining = []
    for _ in range(5):
        resp = await post(client, auth, stream=True, max_tokens=500)
        assert resp.status == 200, await resp.text()
        remaining.append(int(resp.headers["x-ratelimit-remaining-tokens"]))
        assert sse_events(await resp.read())[-1].data == "[DONE]"
    used = 5 + 3  # the short script's usage: prompt 5, completion 3
    reserved = reservation(500)
    assert remaining == [10_000 - used * n - reserved for n in range(5)]
    assert (await rejections(client)).get("concurrency", 0) == 0


# -- 4. cancelled, failed and timed-out runs free their slot ---------------------------------------


def ending_script(request: ChatRequest) -> list:
    """By `user`: a long stream (to cancel), one that fails mid-stream, one that stalls past the
    inter-token deadline; anyone else gets a short answer."""
    if request.user == "long":
        return [step for i in range(100) for step in (0.05, TextDelta(f"{i} "))]
    if request.user == "fail":
        return [TextDelta("a "), 0.3, ErrorEvent("upstream_error", "The upstream failed.")]
    if request.user == "stall":
        return [TextDelta("a "), 30.0, TextDelta("b ")]
    return [TextDelta("ok"), Finish("stop"), Usage(5, 1)]


@pytest.mark.parametrize(
    ("user", "status", "code", "settings"),
    [
        ("long", "cancelled", "cancelled", {}),
        ("fail", "failed", "upstream_error", {}),
        ("stall", "timed_out", "timeout", {"inter_token_timeout": 0.6}),
    ],
)
async def test_an_ended_run_frees_its_concurrency_slot(
    aiohttp_client, store_settings, tmp_path, user, status, code, settings
):
    path, auth = write_tenants(tmp_path, max_concurrent=1)
    adapter = ScriptedAdapter("scripted", ending_script)
    client = await gateway(aiohttp_client, store_settings, path, [adapter], **settings)
    first = await post(client, auth, stream=True, user=user)
    assert first.status == 200
    run_id = sse_events(await first.content.readuntil(b"\n\n"))[0].json()["id"]
    busy = await post(client, auth)
    error = await error_of(busy)
    assert_rate_limited(busy, error, "concurrency")
    assert busy.headers["retry-after"] == "1"
    if user == "long":
        cancel = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=auth)
        assert (await cancel.json())["status"] == "cancelled"
    events = sse_events(await first.read())
    assert events[-1].data == "[DONE]"
    assert events[-2].json()["error"]["code"] == code
    run = await (await client.get(f"/v1/chat/completions/{run_id}", headers=auth)).json()
    assert run["status"] == status
    # Without the release the slot stays taken for the slot TTL (an hour): no retry could pass.
    nxt = await admitted_soon(client, auth)
    assert nxt.status == 200
    assert (await nxt.json())["choices"][0]["message"]["content"] == "ok"
    assert (await rejections(client)).get("concurrency", 0) >= 1


# -- 5. the token budget ---------------------------------------------------------------------------


async def test_a_spent_budget_is_insufficient_quota_until_the_period_ends(
    aiohttp_client, store_settings, tmp_path
):
    period, max_tokens = 2, 30
    path, auth = write_tenants(
        tmp_path, budget_tokens=reservation(max_tokens), budget_period=period
    )
    adapter = ScriptedAdapter("scripted", exact_script)
    client = await gateway(aiohttp_client, store_settings, path, [adapter])
    now = [(time.time() // period + 1) * period + 0.1]  # early in a period (epoch-aligned)
    client.app[QUOTAS].clock = lambda: now[0]  # the quotas' clock, driven by the test
    first = await post(client, auth, max_tokens=max_tokens)
    assert first.status == 200
    spent = await post(client, auth, max_tokens=max_tokens)
    assert spent.status == 429
    error = await error_of(spent)
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert "budget" in error["message"]
    reset = period - now[0] % period
    assert 1 <= int(spent.headers["retry-after"]) <= math.ceil(reset) + 1
    assert int(spent.headers["retry-after"]) <= period
    assert await rejections(client) == {"budget": 1}
    now[0] += reset + 0.05  # the next period
    renewed = await post(client, auth, max_tokens=max_tokens)
    assert renewed.status == 200


# -- 6. policy answers, metrics and headers --------------------------------------------------------


async def test_model_and_max_tokens_policy_and_the_quota_metrics(
    aiohttp_client, store_settings, tmp_path
):
    cap = 64
    path, auth = write_tenants(tmp_path, models=["script*"], max_tokens=cap, rpm=3, tpm=10_000)
    allowed = ScriptedAdapter("scripted", exact_script)  # no refunds: exact remaining tokens
    hidden = ScriptedAdapter("secret", exact_script)
    client = await gateway(aiohttp_client, store_settings, path, [allowed, hidden])

    denied = await post(client, auth, model="secret")
    assert denied.status == 403
    error = await error_of(denied)
    assert (error["code"], error["param"]) == ("model_not_allowed", "model")
    assert hidden.requests == []

    too_many = await post(client, auth, max_tokens=cap + 1)
    assert too_many.status == 400
    error = await error_of(too_many)
    assert (error["type"], error["param"]) == ("invalid_request_error", "max_tokens")
    assert "max_tokens" in error["message"] and str(cap) in error["message"]
    newer_name = await post(client, auth, max_completion_tokens=cap + 1)
    assert newer_name.status == 400
    assert (await error_of(newer_name))["param"] == "max_completion_tokens"  # the field sent

    for _ in range(2):
        capped = await post(client, auth)  # no max_tokens: the cap is the default
        assert capped.status == 200
        assert allowed.requests[-1].max_tokens == cap
    at_cap = await post(client, auth, max_tokens=cap)
    assert at_cap.status == 200
    assert at_cap.headers["x-ratelimit-remaining-requests"] == "0"
    assert at_cap.headers["x-ratelimit-remaining-tokens"] == str(10_000 - 3 * reservation(cap))

    over_rpm = await post(client, auth)
    assert_rate_limited(over_rpm, await error_of(over_rpm), "requests")
    assert await rejections(client) == {"model": 1, "requests": 1}

    models = await client.get("/v1/models", headers=auth)
    assert models.status == 200
    assert set(RATE_HEADERS) <= set(models.headers)
    assert models.headers["x-ratelimit-limit-requests"] == "3"
    assert models.headers["x-ratelimit-remaining-requests"] == "0"
    assert models.headers["x-ratelimit-limit-tokens"] == "10000"
    assert models.headers["x-ratelimit-reset-requests"].endswith("s")
    assert await rejections(client) == {"model": 1, "requests": 1}  # a GET consumes nothing


# -- 7. keys ---------------------------------------------------------------------------------------


async def test_a_revoked_key_is_a_401_and_the_file_holds_only_hashes(aiohttp_client, tmp_path):
    path, auth = write_tenants(tmp_path, rpm=100)
    kept, _ = create_key(path, TENANT)
    revoked_key = auth["Authorization"].removeprefix("Bearer ")
    client = await gateway(aiohttp_client, {}, path, [ScriptedAdapter("scripted", short_script)])
    text = path.read_text(encoding="utf-8")
    for key in (revoked_key, kept):
        assert key not in text
        assert (await post(client, bearer(key))).status == 200
    assert text.count('hash = "sha256:') == 2

    victim = key_id(hash_key(revoked_key))
    assert victim in [kid for kid, _, _ in list_keys(path)]
    assert revoke_key(path, victim)
    app = client.app
    app[AUTH].reload(tenants_config(app[SETTINGS]))

    refused = await post(client, auth)
    assert refused.status == 401
    assert (await error_of(refused))["code"] == "invalid_api_key"
    assert (await client.get("/v1/models", headers=auth)).status == 401
    assert (await post(client, bearer(kept))).status == 200
    text = path.read_text(encoding="utf-8")
    assert revoked_key not in text and kept not in text
    assert text.count('hash = "sha256:') == 1


# -- 8. a client gone during admission -------------------------------------------------------------


def storm_script(request: ChatRequest) -> list:
    if request.user == "hold":  # stays live while every slot is counted
        return [TextDelta("a "), 0.3, TextDelta("b"), Finish("stop"), Usage(5, 2)]
    return [TextDelta("a"), Finish("stop"), Usage(5, 1)]


@pytest.mark.parametrize("store_settings", ["redis"], indirect=True)
async def test_clients_gone_mid_admission_strand_no_slot(aiohttp_client, store_settings, tmp_path):
    """Clients that hang up at random moments, some while their admission is in flight (the
    handler is cancelled inside the quota script or the run's creation): every slot comes back."""
    slots = 25
    path, auth = write_tenants(tmp_path, max_concurrent=slots)
    adapter = ScriptedAdapter("scripted", storm_script)
    client = await gateway(aiohttp_client, store_settings, path, [adapter], disconnect_grace=0.05)
    rng = random.Random(7)

    async def hang_up(delay: float) -> None:
        request = asyncio.ensure_future(post(client, auth))
        await asyncio.sleep(delay)  # NOTE: the scenario: hanging up at a random moment
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            (await request).release()

    for _ in range(10):
        await asyncio.gather(*(hang_up(rng.uniform(0, 0.03)) for _ in range(slots)))
    runs = client.app[RUNS]

    def settled() -> bool:  # no run left, and no opening still in flight to start one
        # a run's task is named for it from its opening on (gateway/runs/life.py)
        openings = [t for t in asyncio.all_tasks() if t.get_name().startswith("run ")]
        return not runs.drivers and not openings

    await until(settled, "every abandoned run to settle")
    held = await asyncio.gather(*(post(client, auth, user="hold") for _ in range(slots)))
    assert [r.status for r in held] == [200] * slots
