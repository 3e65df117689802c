"""Back-to-back requests of a tenant allowed one run at a time, on Redis.

One client of a tenant with `max_concurrent = 1` streams from a scripted upstream and sends its
next request the moment it reads the last one's `[DONE]`: a gateway that gives the slot back
only after its client heard the run end refuses some of them (429). For each gateway (this tree,
and every `--compare TREE`, taking turns round by round), the table gives the requests refused
and how long `[DONE]` trails the stream's last chunk (what giving the slot back first costs).

    .venv/bin/python bench/back_to_back.py
    .venv/bin/python bench/back_to_back.py --compare /tmp/before --rounds 2 --requests 200

Redis is 127.0.0.1:6379 (or `SLUICE_BENCH_REDIS_URL`), under a prefix of each gateway's own,
removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
from bench_tenants import API_KEY
from overhead_procs import ROOT, Processes, free_port
from redis import Redis

REDIS_URL = os.environ.get("SLUICE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
BODY = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def write_tenants(folder: Path) -> Path:
    from policies.auth import hash_key

    path = folder / "tenants.toml"
    path.write_text(f'[tenants.bench]\nmax_concurrent = 1\nkeys = ["{hash_key(API_KEY)}"]\n')
    return path


async def back_to_back(url: str, requests: int, max_tokens: int) -> tuple[int, list[float]]:
    """(requests refused, seconds from each stream's last chunk to its `[DONE]`)."""
    refused, gaps = 0, []
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:
        for _ in range(requests):
            body = {**BODY, "max_tokens": max_tokens}
            async with session.post(url, json=body, headers=headers) as resp:
                if resp.status == 429:
                    refused += 1
                    await resp.read()
                    continue
                assert resp.status == 200, await resp.text()
                last = time.perf_counter()
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        gaps.append(time.perf_counter() - last)
                    elif line.startswith(b"data:"):
                        last = time.perf_counter()
    return refused, gaps


def one_gateway(procs: Processes, upstream: str, tenants: Path, tree: Path, args) -> tuple:
    """Start a gateway from `tree`, run the client against it, stop it; its Redis keys go."""
    port, prefix = free_port(), f"sluice-bench-b2b-{uuid.uuid4().hex[:8]}:"
    command = ["-m", "gateway.cli", "serve", "--upstream", f"scripted={upstream}"]
    command += ["--tenants", str(tenants), "--port", str(port)]
    command += ["--redis-url", REDIS_URL, "--redis-prefix", prefix]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    name = f"gateway-{port}"
    proc = procs.spawn(name, command, cwd=tree, env=env)
    try:
        procs.wait_ready(name, proc, f"http://127.0.0.1:{port}/healthz")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return asyncio.run(back_to_back(url, args.requests, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        redis = Redis.from_url(REDIS_URL)
        keys = list(redis.scan_iter(match=f"{prefix}*"))
        if keys:
            redis.delete(*keys)
        redis.close()


def report(results: dict[str, tuple[int, int, list[float]]]) -> None:
    print("one tenant, max_concurrent 1, on Redis; each request sent as the last one's [DONE]")
    print("is read. gap: the stream's last chunk to its [DONE], ms")
    print(f"{'gateway':24s} | requests refused | gap p50    p90    p99")
    print("-" * 66)
    for name, (sent, refused, gaps) in results.items():
        q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [float("nan")] * 99
        print(
            f"{name:24s} | {sent:8d} {refused:7d} | {q[49] * 1000:7.2f} {q[89] * 1000:6.2f} "
            f"{q[98] * 1000:6.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="per gateway and round")
    p.add_argument("--rounds", type=int, default=1, help="the gateways take turns")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=5.0, help="the upstream's, per token")
    p.add_argument("--compare", action="append", default=[], metavar="TREE")
    args = p.parse_args()
    trees = {"gateway": ROOT} | {f"compare:{Path(t).name}": Path(t).resolve() for t in args.compare}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        procs = Processes(folder)
        try:
            port = free_port()
            command = ["-m", "testkit.scripted_upstream", "--port", str(port)]
            upstream = procs.spawn("upstream", [*command, "--delay-ms", str(args.delay_ms)])
            upstream_url = f"http://127.0.0.1:{port}/v1"
            procs.wait_ready("upstream", upstream, f"{upstream_url}/models")
            tenants = write_tenants(folder)
            results: dict[str, tuple[int, int, list[float]]] = {n: (0, 0, []) for n in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    refused, gaps = one_gateway(procs, upstream_url, tenants, tree, args)
                    sent, was_refused, all_gaps = results[name]
                    results[name] = (sent + args.requests, was_refused + refused, all_gaps + gaps)
        finally:
            procs.stop_all()
    report(results)


if __name__ == "__main__":
    main()
