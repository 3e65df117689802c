"""`sluice usage`: totals per tenant and model from the usage ledger (Redis, or a JSONL file)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from datetime import UTC, datetime

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.state.ledger import JsonlLedger, RedisLedger, UsageLedger, default_usage_file, totals

DEFAULT_USAGE_FILE = str(default_usage_file())
COLUMNS = (
    "tenant",
    "model",
    "runs",
    "completed",
    "cancelled",
    "timed_out",
    "failed",
    "prompt",
    "generated",
    "sent",
    "tail",
)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_since(text: str, now: float | None = None) -> float:
    """Unix time from `24h`, `7d`, `30m`, … (that long ago) or ISO-8601 (naive means UTC)."""
    if m := _AGO.fullmatch(text.strip()):
        return (time.time() if now is None else now) - float(m[1]) * _UNITS[m[2]]
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration like 24h or 7d nor an ISO-8601 time"
        ) from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice usage", description=__doc__)
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument(
        "--since", type=parse_since, help="runs ended since: 24h, 7d, … or ISO-8601 (UTC if naive)"
    )
    p.add_argument("--redis-url", help="read the Redis ledger (default: $SLUICE_REDIS_URL)")
    p.add_argument("--redis-prefix", help="key prefix in Redis (default 'sluice:')")
    p.add_argument(
        "--usage-file",
        help="the JSONL ledger (with Redis: what this host kept while Redis was away; default "
        "sluicegate/usage.jsonl in $XDG_STATE_HOME, else in ~/.local/state)",
    )
    return p


def format_table(rows: list[dict]) -> str:
    cells = [list(COLUMNS), *([str(row[c]) for c in COLUMNS] for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = []
    for line in cells:
        # names left-aligned, numbers right-aligned under their heads
        text = [v.ljust(w) for v, w in zip(line[:2], widths[:2], strict=True)]
        text += [v.rjust(w) for v, w in zip(line[2:], widths[2:], strict=True)]
        lines.append("  ".join(text).rstrip())
    return "\n".join(lines)


async def _rows(ledger: UsageLedger, since: float | None, tenant: str | None) -> list[dict]:
    try:
        return totals([r async for r in ledger.read(since=since, tenant=tenant)])
    finally:
        await ledger.close()


async def _read_redis(url: str, prefix: str, fallback: str, args: argparse.Namespace) -> list[dict]:
    """The Redis Stream, plus the records this host kept in its file while Redis was away."""
    client = Redis.from_url(url)
    try:
        ledger = RedisLedger(client, prefix=prefix, fallback=JsonlLedger(fallback))
        return await _rows(ledger, args.since, args.tenant)
    finally:
        await client.aclose()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    env = os.environ
    redis_url = args.redis_url or env.get("SLUICE_REDIS_URL")
    try:
        path = args.usage_file or env.get("SLUICE_USAGE_FILE")
        if redis_url:
            prefix = args.redis_prefix or env.get("SLUICE_REDIS_PREFIX") or "sluice:"
            fallback = path or str(default_usage_file(redis=True))
            rows = asyncio.run(_read_redis(redis_url, prefix, fallback, args))
        else:
            path = path or DEFAULT_USAGE_FILE
            if not os.path.exists(path):  # an empty table alone would hide a mistyped path
                print(f"sluice usage: no ledger file at {path}", file=sys.stderr)
            rows = asyncio.run(_rows(JsonlLedger(path), args.since, args.tenant))
    except (OSError, RedisError, ValueError) as exc:
        print(f"sluice usage: {exc}", file=sys.stderr)
        return 1
    print(format_table(rows))
    return 0
