"""The usage ledger: one record per ended run, read back by time and tenant, summed per tenant
and model, and shown by `sluice usage`. Both backends run the same table: a JSONL file and a
real Redis Stream."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.cli.usage import COLUMNS, format_table, parse_since
from gateway.state.ledger import JsonlLedger, RedisLedger, UsageRecord, totals
from tests.support.redis_scratch import REDIS_URL, scratch_redis

ROOT = Path(__file__).resolve().parents[2]


def make_record(
    run_id: str = "run-1",
    tenant: str = "acme",
    model: str = "m",
    status: str = "completed",
    ended_at: float = 1_700_000_000.0,
    prompt: int = 10,
    generated: int = 20,
    sent: int = 20,
    tail: int = 0,
) -> UsageRecord:
    return UsageRecord(
        run_id=run_id,
        tenant=tenant,
        principal="key_0123456789ab",
        model=model,
        status=status,
        finish_reason="stop" if status == "completed" else None,
        cancel_source="client" if status == "cancelled" else None,
        prompt_tokens=prompt,
        generated_tokens=generated,
        sent_tokens=sent,
        tail_tokens=tail,
        ttft_s=0.05,
        e2e_s=1.25,
        ended_at=ended_at,
    )


@pytest.fixture
async def redis_prefix():
    async with scratch_redis() as scratch:
        yield scratch


@pytest.fixture(params=["jsonl", "redis"])
async def ledger(request, tmp_path):
    if request.param == "jsonl":  # no Redis at all: it runs in the fast tier
        led = JsonlLedger(tmp_path / "usage.jsonl")
        yield led
        await led.close()
        return
    async with scratch_redis() as (client, prefix):
        led = RedisLedger(client, prefix=prefix)
        yield led
        await led.close()


async def read_all(ledger, **kw) -> list[UsageRecord]:
    return [r async for r in ledger.read(**kw)]


# --- records ---


def test_a_record_round_trips_through_json():
    rec = make_record(status="cancelled", tail=3)
    assert UsageRecord.from_json(rec.to_json()) == rec
    assert UsageRecord.from_json(rec.to_json().decode()) == rec


def test_fields_a_newer_writer_added_are_ignored():
    raw = make_record().to_json()[:-1] + b',"cost_usd":0.1}'
    assert UsageRecord.from_json(raw) == make_record()


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="queued"):
        make_record(status="queued")


# --- both ledgers ---


async def test_records_round_trip_in_append_order(ledger):
    now = time.time()
    recs = [
        make_record("r1", ended_at=now - 5),
        make_record("r2", tenant="globex", status="failed", ended_at=now - 4),
        make_record("r3", status="timed_out", ended_at=now - 3),
    ]
    for r in recs:
        await ledger.append(r)
    assert await read_all(ledger) == recs


async def test_read_filters_by_since_and_tenant(ledger):
    now = time.time()
    old = make_record("old", ended_at=now - 7200)
    recent_acme = make_record("acme-1", ended_at=now - 60)
    recent_globex = make_record("globex-1", tenant="globex", ended_at=now - 30)
    for r in (old, recent_acme, recent_globex):
        await ledger.append(r)
    assert await read_all(ledger, since=now - 3600) == [recent_acme, recent_globex]
    assert await read_all(ledger, tenant="acme") == [old, recent_acme]
    assert await read_all(ledger, since=now - 3600, tenant="globex") == [recent_globex]
    assert await read_all(ledger, tenant="nobody") == []


async def test_redis_read_pages_through_a_long_stream(redis_prefix):
    client, prefix = redis_prefix
    led = RedisLedger(client, prefix=prefix)
    led.PAGE = 7
    now = time.time()
    recs = [make_record(f"r{i}", ended_at=now) for i in range(30)]
    for r in recs:
        await led.append(r)
    assert await read_all(led, since=now - 1) == recs


async def test_a_record_appended_twice_is_read_and_billed_once(redis_prefix):
    """The client resends an XADD whose reply was lost: the stream holds the run twice."""
    client, prefix = redis_prefix
    led = RedisLedger(client, prefix=prefix)
    record = make_record("r1", ended_at=time.time())
    for _ in range(2):
        await led.append(record)
    assert await client.xlen(led.key) == 2
    assert await read_all(led) == [record]
    assert totals(await read_all(led))[0]["runs"] == 1


async def test_redis_ledger_trims_to_about_maxlen(redis_prefix):
    client, prefix = redis_prefix
    led = RedisLedger(client, prefix=prefix, maxlen=10)
    for i in range(500):
        await led.append(make_record(f"r{i}"))
    length = await client.xlen(f"{prefix}usage")
    assert 10 <= length < 500  # MAXLEN ~ trims whole nodes, so a little over maxlen is normal


async def test_jsonl_ledger_appends_to_an_existing_file_and_reads_a_missing_one(tmp_path):
    path = tmp_path / "usage.jsonl"
    assert await read_all(JsonlLedger(path)) == []
    first = JsonlLedger(path)
    await first.append(make_record("r1"))
    await first.close()
    second = JsonlLedger(path)
    await second.append(make_record("r2"))
    await second.close()
    assert [r.run_id for r in await read_all(JsonlLedger(path))] == ["r1", "r2"]
    assert path.read_bytes().count(b"\n") == 2


async def test_jsonl_skips_a_torn_last_line_but_names_a_bad_one_inside(tmp_path):
    path = tmp_path / "usage.jsonl"
    good = make_record().to_json() + b"\n"
    path.write_bytes(good + good[:40])
    assert await read_all(JsonlLedger(path)) == [make_record()]
    path.write_bytes(good + b"not json\n" + good)
    with pytest.raises(ValueError, match=r"usage\.jsonl:2"):
        await read_all(JsonlLedger(path))


# --- totals ---


def test_totals_sum_per_tenant_and_model_with_runs_per_status():
    recs = [
        make_record("1", prompt=10, generated=20, sent=20),
        make_record("2", status="cancelled", prompt=5, generated=9, sent=6, tail=3),
        make_record("3", status="timed_out", prompt=7, generated=0, sent=0),
        make_record("4", model="m2", status="failed", prompt=1, generated=2, sent=2),
        make_record("5", tenant="globex", prompt=100, generated=50, sent=50),
    ]
    assert totals(recs) == [
        {
            "tenant": "acme",
            "model": "m",
            "runs": 3,
            "completed": 1,
            "cancelled": 1,
            "timed_out": 1,
            "failed": 0,
            "prompt": 22,
            "generated": 29,
            "sent": 26,
            "tail": 3,
        },
        {
            "tenant": "acme",
            "model": "m2",
            "runs": 1,
            "completed": 0,
            "cancelled": 0,
            "timed_out": 0,
            "failed": 1,
            "prompt": 1,
            "generated": 2,
            "sent": 2,
            "tail": 0,
        },
        {
            "tenant": "globex",
            "model": "m",
            "runs": 1,
            "completed": 1,
            "cancelled": 0,
            "timed_out": 0,
            "failed": 0,
            "prompt": 100,
            "generated": 50,
            "sent": 50,
            "tail": 0,
        },
    ]
    assert totals([]) == []


# --- sluice usage ---


def test_since_takes_durations_and_iso_times():
    now = 1_700_000_000.0
    assert parse_since("24h", now) == now - 86400
    assert parse_since("7d", now) == now - 7 * 86400
    assert parse_since("30m", now) == now - 1800
    assert parse_since("2023-11-14T22:13:20Z") == now
    assert parse_since("2023-11-14T22:13:20") == now  # naive means UTC
    assert parse_since("2023-11-15T00:13:20+02:00") == now


def sluice_usage(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "usage", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean | (env or {}),
        timeout=60,
    )


def table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.strip().splitlines()]


HEADER = list(COLUMNS)


def recent_records() -> list[UsageRecord]:
    now = time.time()
    return [
        make_record("old", ended_at=now - 7200, prompt=1000),  # outside --since 1h
        make_record("a1", ended_at=now - 60, prompt=10, generated=20, sent=20),
        make_record("a2", status="cancelled", ended_at=now - 50, generated=9, sent=6, tail=3),
        make_record("g1", tenant="globex", model="m2", status="failed", ended_at=now - 40),
    ]


EXPECTED = [
    HEADER,
    ["acme", "m", "2", "1", "1", "0", "0", "20", "29", "26", "3"],
    ["globex", "m2", "1", "0", "0", "0", "1", "10", "20", "20", "0"],
]


@pytest.mark.process
def test_usage_cli_prints_totals_from_a_jsonl_file(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_bytes(b"".join(r.to_json() + b"\n" for r in recent_records()))
    done = sluice_usage("--usage-file", str(path), "--since", "1h")
    assert done.returncode == 0, done.stderr
    assert table_rows(done.stdout) == EXPECTED
    done = sluice_usage("--since", "1h", "--tenant", "globex", env={"SLUICE_USAGE_FILE": str(path)})
    assert table_rows(done.stdout) == [EXPECTED[0], EXPECTED[2]]


@pytest.mark.process
async def test_usage_cli_prints_totals_from_a_redis_ledger(redis_prefix, tmp_path):
    client, prefix = redis_prefix
    led = RedisLedger(client, prefix=prefix)
    for r in recent_records():
        await led.append(r)
    done = sluice_usage("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--since", "1h")
    assert done.returncode == 0, done.stderr
    assert table_rows(done.stdout) == EXPECTED
    # SLUICE_REDIS_URL also selects Redis over any file
    nowhere = str(tmp_path / "none.jsonl")
    env = {"SLUICE_REDIS_URL": REDIS_URL}
    done = sluice_usage("--redis-prefix", prefix, "--usage-file", nowhere, env=env)
    acme = ["acme", "m", "3", "2", "1", "0", "0", "1020", "49", "46", "3"]  # "old" counted too
    assert table_rows(done.stdout)[1] == acme


@pytest.mark.process
def test_usage_cli_refuses_a_bad_since_and_names_it():
    done = sluice_usage("--since", "yesterday")
    assert done.returncode == 2
    assert "yesterday" in done.stderr


def test_format_table_aligns_columns():
    rows = totals([make_record(), make_record(tenant="a-long-tenant-name")])
    lines = format_table(rows).splitlines()
    assert len({len(line) for line in lines}) == 1  # numbers right-aligned under their heads
    assert lines[0].index("model") == len("a-long-tenant-name  ")
