"""`sluice audit` (read the audit log) and `sluice tenants push | pull` (move the tenants
between the tenants file and Redis). Both read the stores the gateway writes: the file beside
the tenants file, or Redis under `--redis-prefix`."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import tomlkit
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.admin.audit import AuditLog, AuditRecord, FileAuditLog, RedisAuditLog, audit_path
from gateway.admin.tenant_doc import BadField
from gateway.admin.tenant_store_redis import RedisTenantStore
from gateway.cli.usage import parse_since
from policies.keys_cli import DEFAULT_TENANTS_FILE
from policies.tenants import TenantsFileError
from policies.tenants_file import write_document

_ENV = os.environ


def _add_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tenants",
        default=_ENV.get("SLUICE_TENANTS") or DEFAULT_TENANTS_FILE,
        help="the tenants TOML file (default: $SLUICE_TENANTS, else ./tenants.toml)",
    )
    p.add_argument(
        "--redis-url",
        default=_ENV.get("SLUICE_REDIS_URL"),
        help="the Redis the gateways share (default: $SLUICE_REDIS_URL; `tenants` needs it)",
    )
    p.add_argument(
        "--redis-prefix",
        default=_ENV.get("SLUICE_REDIS_PREFIX") or "sluice:",
        help="key prefix in Redis (default: $SLUICE_REDIS_PREFIX, else 'sluice:')",
    )


def audit_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice audit", description="Print the audit log.")
    p.add_argument(
        "--since", type=parse_since, help="records since: 24h, 7d, … or ISO-8601 (UTC if naive)"
    )
    p.add_argument(
        "--tenants-store",
        choices=("file", "redis"),
        default=_ENV.get("SLUICE_TENANTS_STORE") or "file",
        help="where the gateways keep tenants (and audit records): file (beside --tenants; the "
        "default) or redis (default: $SLUICE_TENANTS_STORE)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_store_flags(p)
    return p


def tenants_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice tenants", description="Move tenants file ⇄ Redis.")
    sub = p.add_subparsers(dest="action", required=True)
    push = sub.add_parser("push", help="store the tenants file in Redis (replicas reload it)")
    pull = sub.add_parser("pull", help="write the tenants in Redis to the tenants file")
    for parser in (push, pull):
        _add_store_flags(parser)
    return p


def _line(record: AuditRecord) -> str:
    d = record.to_dict()
    change = f"{orjson.dumps(d['before']).decode()} -> {orjson.dumps(d['after']).decode()}"
    return f"{d['at']}  {d['who']}  {d['action']}  {d['target']}  {change}"


async def _with_redis(url: str, use: Callable[[Redis], Awaitable[Any]]) -> Any:
    client = Redis.from_url(url)
    try:
        return await use(client)
    finally:
        await client.aclose()


def audit_main(argv: list[str]) -> int:
    args = audit_parser().parse_args(argv)

    async def read(log: AuditLog) -> list[AuditRecord]:
        return await log.read(args.since)

    try:
        if args.tenants_store == "redis":
            if not args.redis_url:
                print("sluice audit: --tenants-store redis needs --redis-url", file=sys.stderr)
                return 2
            prefix = args.redis_prefix
            records = asyncio.run(
                _with_redis(args.redis_url, lambda r: read(RedisAuditLog(r, prefix)))
            )
        else:
            records = asyncio.run(read(FileAuditLog(audit_path(args.tenants))))
    except (OSError, RedisError, ValueError) as exc:
        print(f"sluice audit: {exc}", file=sys.stderr)
        return 1
    for record in records:
        print(orjson.dumps(record.to_dict()).decode() if args.json else _line(record))
    return 0


async def _push(redis: Redis, args: argparse.Namespace) -> str:
    store = RedisTenantStore(redis, args.redis_prefix, args.tenants)
    text = await asyncio.to_thread(Path(args.tenants).read_text, encoding="utf-8")
    await store.push(text)
    who = f"cli:{getpass.getuser()}"
    record = AuditRecord(who, "tenants.push", store.doc_key, "*", {}, {"from": args.tenants})
    await RedisAuditLog(redis, args.redis_prefix).append(record)
    return f"pushed {args.tenants} to {store.doc_key}; every gateway reloads it"


async def _pull(redis: Redis, args: argparse.Namespace) -> str:
    store = RedisTenantStore(redis, args.redis_prefix, args.tenants)
    text, _ = await store.text()
    if text is None:
        raise ValueError(f"no tenants stored at {store.doc_key}")
    await asyncio.to_thread(write_document, Path(args.tenants), tomlkit.parse(text))
    return f"wrote the tenants of {store.doc_key} to {args.tenants}"


def tenants_main(argv: list[str]) -> int:
    args = tenants_parser().parse_args(argv)
    if not args.redis_url:
        print(f"sluice tenants {args.action}: needs --redis-url", file=sys.stderr)
        return 2
    action = _push if args.action == "push" else _pull
    try:
        said = asyncio.run(_with_redis(args.redis_url, lambda r: action(r, args)))
    except (BadField, TenantsFileError) as exc:
        print(f"sluice tenants {args.action}: {args.tenants}: {exc}", file=sys.stderr)
        return 1
    except (OSError, RedisError, ValueError) as exc:
        print(f"sluice tenants {args.action}: {exc}", file=sys.stderr)
        return 1
    print(said, file=sys.stderr)
    return 0


def record_key_change(action: str, key: str, tenant: str, tenants_file: str) -> None:
    """`sluice keys create | revoke`'s audit record, in the log beside the tenants file."""
    before, after = ({}, {"id": key}) if action == "key.create" else ({"id": key}, {})
    record = AuditRecord(f"cli:{getpass.getuser()}", action, key, tenant, before, after)
    asyncio.run(FileAuditLog(audit_path(tenants_file)).append(record))
