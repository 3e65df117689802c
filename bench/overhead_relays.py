"""What `gateway_overhead.py` puts between the load generator and the scripted upstream: one
`Relay` per target, each a command line, the headers it wants and where it runs.

- `passthrough`: bare aiohttp byte copy (`bench/passthrough.py`);
- `parsing`: a minimal parsing relay on uvloop (`bench/parsing_relay.py`), the floor the
  gateway's targets are read against; `parse-asyncio`: the same on asyncio's loop, the
  gateway's;
- `gateway`: `sluice serve` on the in-process run store; `gw-redis`: the same on Redis (with
  `--limits`, both for a tenant with every limit on, far above what the bench asks);
- with `--policies`, `--safety` or `--compare`, the gateways those add.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from bench_tenants import API_KEY, jwt_token, write_safety_tenants_file, write_tenants_file
from overhead_procs import ROOT

FLOORS = ("passthrough", "parsing", "parse-asyncio")  # relays that keep nothing: no warm-up
POLICY_RELAYS = ("memory+key", "memory+jwt", "redis+key", "redis+jwt")
SAFETY_RELAYS = ("window-off", "chars", "sentence")  # the same tenant, with its policy varied
REDIS_URL = os.environ.get("SLUICE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Relay:
    command: list[str]
    headers: dict[str, str] = field(default_factory=lambda: dict(KEY_HEADERS))
    cwd: Path = ROOT
    pythonpath: str | None = None  # another source tree's, for `--compare`


def relays(args: argparse.Namespace, upstream_url: str, logdir: Path, prefix: str) -> dict:
    """Every relay this run measures, by name, in the order of the tables."""
    serve = ["-m", "gateway.cli", "serve", "--upstream", f"scripted={upstream_url}"]
    redis = ["--redis-url", REDIS_URL, "--redis-prefix", prefix]
    tenant = ["--api-key", API_KEY]
    if args.limits:  # every run reserves and is released, none refused
        tenant = ["--tenants", str(write_tenants_file(logdir))]
    out: dict[str, Relay] = {}
    if args.baseline:
        via = ["--upstream", upstream_url]
        out["passthrough"] = Relay([str(ROOT / "bench" / "passthrough.py"), *via])
        out["parsing"] = Relay([str(ROOT / "bench" / "parsing_relay.py"), *via])
        out["parse-asyncio"] = Relay([*out["parsing"].command, "--loop", "asyncio"])
    out["gateway"] = Relay([*serve, *tenant])
    if "redis" in args.store:
        out["gw-redis"] = Relay([*serve, *tenant, *redis])
    for tree in args.compare:
        path = Path(tree).resolve()
        out[compare_name(tree)] = Relay(out["gateway"].command, cwd=path, pythonpath=str(path))
        if "redis" in args.store:  # its gateway on Redis as well
            command = out["gw-redis"].command
            out[f"{compare_name(tree)}-redis"] = Relay(command, cwd=path, pythonpath=str(path))
    if args.policies:
        out |= policy_relays(serve, redis, logdir)
    if args.safety:
        for name in SAFETY_RELAYS:
            tenants = write_safety_tenants_file(logdir, name)
            out[name] = Relay([*serve, "--tenants", str(tenants)])
    return out


def policy_relays(serve: list[str], redis: list[str], logdir: Path) -> dict[str, Relay]:
    """Gateways with every tenant policy on, by API key or JWT, in-process or on Redis."""
    tenants = write_tenants_file(logdir)
    out = {}
    for name in POLICY_RELAYS:
        command = [
            *serve, "--tenants", str(tenants),
            "--usage-file", str(logdir / f"{name}-usage.jsonl"),
            *(redis if name.startswith("redis") else []),
        ]  # fmt: skip
        token = jwt_token() if name.endswith("jwt") else API_KEY
        out[name] = Relay(command, {"Authorization": f"Bearer {token}"})
    return out


def compare_name(tree: str) -> str:
    """The row name of the gateway run from another source tree: its folder's name."""
    return Path(tree).resolve().name
