"""The worker pool's routing: prefix-cache hit rate, throughput and TTFT, and a worker killed.

A multi-turn workload: `--systems` system prompts (a few hundred tokens each), `--convs`
conversations on each, `--turns` turns per conversation. A turn's request is the system prompt,
every earlier turn (the user's message and the assistant's actual reply, read from the previous
answer's stream) and a new user message; `--max-tokens` is small and temperature 0, so the work
is mostly prefill and the replies reproducible. C clients each take the next conversation of a
`--seed`-shuffled list and drive it turn by turn, so C conversations on different system prompts
are always in flight together and the router has to keep them apart. One API key: one tenant,
so every request may share every cached prefix.

Each row gets a fresh `sluice serve` (fresh caches; bench/pool_serve.py), one after another,
warmed up (every member has taken a step) before it is measured:

- `single`: 1 worker at concurrency C/2, the same load per worker as the pool rows;
- `affinity`, `least_load`, `random` (`--pool-routing`): 2 workers at concurrency C.

Columns: the prefix-cache hit rate (the workers' own `/v1/stats`: hits / queries, summed over
the members, deltas over the measured run); hit / oracle; completed requests/s and generated
tokens/s; TTFT p50/p95 (client side: request sent → first content chunk) and p95 / single.
A second table says where hits and time went (see `detail_table`); `--trace` routes requests
one at a time to learn each one's member and counts the routes that lost a cached prefix.

The oracle is the hit rate if every request went to the member holding its longest cached
prefix. It is measured, not computed: it is the `single` row's own hit rate, where one member
holds every prefix (its KV cache holds the whole workload, checked and printed, so nothing is
evicted). What it still misses no router could hit: each prompt's first appearance, the tail
that does not fill a block, and a prompt admitted while the same prefix is still being computed
for another request. The single row runs half as many clients, so its arrivals overlap a little
less; replies can differ by a token between rows (a cached prefix changes the floating-point
path), so the workloads are the same up to that.

Workers are pinned: with `--worker-threads` T (default: half the cores), worker i runs T
threads on cores [i*T, (i+1)*T), the single worker on the first T, so "one worker" has the same
cores in every row; `--no-pin` leaves them to the scheduler (on 2 cores a lone worker then gets
both, which the pool's workers cannot). The gateway and this script share the cores.

The kill run (`--no-kill` leaves it out): affinity, 2 workers, `--kill-concurrency` clients each
streaming `--kill-rounds` requests of `--kill-tokens` tokens (temperature 0), half of them on
one system prompt and half on another, so each group sits on one member (checked: the member's
`running` count just before the kill). When the first group's streams of the middle round are
halfway through, its worker (the serve child whose command line holds `workers.cli`) gets
SIGKILL. Reported: requests, client-visible errors (not 200, or an error frame), runs migrated
(`sluice_run_migrations_total` by outcome), and the stall: the largest inter-chunk gap of each
cut stream (on the killed worker, sent before the kill and still streaming) against the
inter-chunk gaps of the streams not cut (p50, p99, max).

    .venv/bin/python bench/pool.py                    # default model, about 6 minutes
    .venv/bin/python bench/pool.py --model tiny       # the tiny test model, under 2 minutes
    .venv/bin/python bench/pool.py --routings affinity --trace --no-kill
    .venv/bin/python bench/pool.py --convs 4 --turns 6 --concurrency 8 --no-kill
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from pool_serve import ROOT, Serve, Stream, other_cpu, stream_chat, user

ROUTINGS = ("affinity", "least_load", "random")
HIT_TARGET = 0.90  # affinity's hit rate / the oracle's, at least
P95_TARGET = 1.3  # affinity's TTFT p95 / the single warm worker's, at most
NAMES = ("Orion", "Vega", "Lyra", "Atlas", "Nova", "Rigel", "Sirius", "Altair", "Deneb", "Mira")
_WORD_TEXT = (
    "order account invoice garden tool shears blade handle warranty return refund delivery "
    "parcel address customer support policy replace repair steel wooden battery charger hose "
    "nozzle pump seed soil spring summer winter price discount member card payment week "
    "morning evening branch store online stock size colour model serial number label box "
    "manual safety glove mower trimmer rake shovel spade pruner ladder bucket fence shed "
    "always never politely briefly clearly first then check confirm explain offer apologise "
    "escalate record ask answer quote list mention avoid keep update cancel schedule"
)
WORDS = _WORD_TEXT.split()
STORY_PROMPTS = (
    "Write a long story about a lighthouse keeper.",
    "Explain how a compiler works, step by step, in detail.",
    "List everything you know about the history of tea.",
    "Describe a walk through a busy market in the morning.",
)


# -- the workload -------------------------------------------------------------------------------


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def system_prompt(rng: random.Random, i: int, words: int) -> str:
    head = f"You are {NAMES[i % len(NAMES)]}, assistant number {i} of a garden tool shop. Rules:"
    rules = []
    while sum(len(r.split()) for r in rules) < words:
        rules.append(f"{len(rules) + 1}. {sentence(rng, rng.randint(8, 16))}")
    return " ".join([head, *rules])


@dataclass(slots=True)
class Conversation:
    system_id: int
    system: str
    users: list[str]  # one new user message per turn


def build_workload(args: argparse.Namespace) -> list[Conversation]:
    """`systems` x `convs` conversations in a seeded order; the same for every row."""
    rng = random.Random(args.seed)
    systems = [system_prompt(rng, i, args.system_words) for i in range(args.systems)]
    convs = [
        Conversation(
            i, s, [f"Turn {t + 1}: {sentence(rng, args.user_words)}" for t in range(args.turns)]
        )
        for i, s in enumerate(systems)
        for _ in range(args.convs)
    ]
    rng.shuffle(convs)
    return convs


# -- the routing rows ---------------------------------------------------------------------------


async def drive(serve: Serve, session, convs: list[Conversation], clients: int, trace: bool):
    """C clients, each driving the next conversation turn by turn: every turn's Stream, a bound
    on the workload's distinct tokens (each conversation's last prompt and reply), and with
    `trace` the member each request went to, as (conversation, system prompt, turn, member,
    every member's in-flight requests just before) in routing order."""
    queue = list(reversed(list(enumerate(convs))))
    done: list[Stream] = []
    routes: list[tuple] = []
    distinct = 0
    lock = asyncio.Lock()

    async def traced(body: dict, key: tuple[int, int, int]) -> Stream:
        """Routed one at a time: the member is the one whose routed count grew by the time the
        stream's headers came (they come when the member has queued the request)."""
        async with lock:
            before, answered = await serve.metrics(session), asyncio.Event()
            task = asyncio.create_task(stream_chat(session, serve.base, body, None, answered))
            await answered.wait()
            after = await serve.metrics(session)
            grew = [
                k[1]
                for k, v in after.items()
                if k[0] == "sluice_member_requests_total" and v > before.get(k, 0)
            ]
            busy = {k[1]: v for k, v in before.items() if k[0] == "sluice_pool_member_in_flight"}
            routes.append((*key, grew[0] if grew else "?", busy))
        return await task

    async def client() -> None:
        nonlocal distinct
        while queue:
            i, conv = queue.pop()
            messages = [{"role": "system", "content": conv.system}]
            for turn, text in enumerate(conv.users):
                messages.append(user(text))
                body = {"model": serve.model, "messages": messages, "max_tokens": serve.max_tokens}
                if trace:
                    s = await traced(body, (i, conv.system_id, turn))
                else:
                    s = await stream_chat(session, serve.base, body)
                s.turn = turn
                done.append(s)
                if not s.ok:
                    break
                messages.append({"role": "assistant", "content": s.text})
            distinct += s.prompt + s.tokens

    await asyncio.gather(*(client() for _ in range(clients)))
    return done, distinct, routes


def route_losses(routes: list[tuple]) -> str:
    """Where a pool's routing lost prefix hits, from the traced routes: first turns sent to a
    member that had not seen their system prompt although another had, and later turns moved
    off the member of their conversation's previous turn, split by whether that member then had
    more than AFFINITY_SLACK (2) requests in flight above the other (a load spill) or not."""
    seen: dict[int, set[str]] = {}
    last: dict[int, str] = {}
    firsts = lost_system = later = spilled = moved = 0
    for conv, system, turn, member, busy in routes:
        members = seen.setdefault(system, set())
        if turn == 0:
            firsts += 1
            lost_system += bool(members) and member not in members
        else:
            later += 1
            if member != last[conv]:
                moved += 1
                spilled += busy.get(last[conv], 0) - min(busy.values()) > 2
        members.add(member)
        last[conv] = member
    return (
        f"first turns sent where their system prompt was not, though cached elsewhere: "
        f"{lost_system}/{firsts}; later turns moved off their conversation's member: "
        f"{moved}/{later} ({spilled} with that member > 2 in flight above the other)"
    )


async def routing_row(args, name: str, workers: int, clients: int, convs, logdir) -> dict:
    """One fresh `sluice serve`, warmed up, then the workload measured on it."""
    serve = Serve(args, name, workers, "affinity" if name == "single" else name, logdir)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            await serve.start(session)
            await serve.warm_up(session)
            before = await serve.stats(session, steps=True), await serve.metrics(session)
            loads: list[tuple[int, ...]] = []
            sampler = asyncio.create_task(serve.sample_load(session, loads))
            with other_cpu(serve) as others:
                began = time.perf_counter()
                streams, distinct, routes = await drive(serve, session, convs, clients, args.trace)
                wall = time.perf_counter() - began
            sampler.cancel()
            after = await serve.stats(session, steps=True), await serve.metrics(session)
    finally:
        serve.stop()
    row = summarise(name, workers, clients, streams, wall, before, after)
    row.update(distinct=distinct, others=others["cores"], imbalance=imbalance(loads))
    row["losses"] = route_losses(routes) if routes and workers > 1 else None
    row["kv_tokens"] = next(iter(after[0].values()))["kv_blocks_total"] * args.block_size
    return row


def summarise(name, workers, clients, streams, wall, before, after) -> dict:
    """The row's numbers from its streams and the deltas of the members' stats and metrics."""
    (stats0, metrics0), (stats1, metrics1) = before, after

    def grew(key: str) -> dict[str, float]:
        return {m: stats1[m][key] - stats0.get(m, {}).get(key, 0) for m in stats1}

    def counted(sample: str) -> dict[str, float]:
        return {k[1]: v - metrics0.get(k, 0) for k, v in metrics1.items() if k[0] == sample}

    hits, queries = grew("prefix_cache_hits"), grew("prefix_cache_queries")
    step_s, step_n = grew("step_s"), grew("step_n")
    ok = [s for s in streams if s.ok]
    return {
        "name": name,
        "workers": workers,
        "clients": clients,
        "requests": len(streams),
        "errors": len(streams) - len(ok),
        "hit": sum(hits.values()) / max(1, sum(queries.values())),
        "member_hit": {m: hits[m] / max(1, queries[m]) for m in hits},
        "routed": counted("sluice_member_requests_total"),
        "affinity_routes": sum(counted("sluice_pool_affinity_routes_total").values()),
        "req_s": len(ok) / wall,
        "tok_s": sum(s.tokens for s in ok) / wall,
        "ttft": sorted(s.ttft for s in ok),
        "ttft_first": sorted(s.ttft for s in ok if s.turn == 0),
        "ttft_later": sorted(s.ttft for s in ok if s.turn > 0),
        "wall": wall,
        "step_ms": 1000 * sum(step_s.values()) / max(1, sum(step_n.values())),
        "busy": sum(step_s.values()) / wall / workers,
    }


def imbalance(loads: list[tuple[int, ...]]) -> dict[str, float]:
    """Of the load samples of a 2-member pool: the mean |a - b|, and the share of samples where
    one member was idle while the other had at least 2 requests."""
    pairs = [s for s in loads if len(s) == 2]
    if not pairs:
        return {"mean_gap": 0.0, "idle_share": 0.0}
    idle = sum(min(s) == 0 and max(s) >= 2 for s in pairs)
    return {
        "mean_gap": sum(abs(a - b) for a, b in pairs) / len(pairs),
        "idle_share": idle / len(pairs),
    }


def pct(values: list[float], q: float) -> float:
    """Nearest rank on sorted values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def routing_table(rows: list[dict]) -> str:
    single = rows[0]
    oracle, base_p95 = single["hit"], pct(single["ttft"], 95)
    head = (
        f"{'routing':<11}{'workers':>8}{'C':>4}{'reqs':>6} | {'hit rate':>8} {'hit/oracle':>10} | "
        f"{'req/s':>6} {'tok/s':>6} | TTFT ms p50 {'p95':>6} {'p95/single':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p95 = pct(r["ttft"], 95)
        lines.append(
            f"{r['name']:<11}{r['workers']:>8}{r['clients']:>4}{r['requests']:>6} | "
            f"{r['hit']:>8.1%} {r['hit'] / oracle:>10.2f} | "
            f"{r['req_s']:>6.2f} {r['tok_s']:>6.1f} | "
            f"{pct(r['ttft'], 50) * 1000:>11.0f} {p95 * 1000:>6.0f} {p95 / base_p95:>10.2f}"
        )
    lines += ["", detail_table(rows)]
    lines += [f"{r['name']:<11}{r['losses']}" for r in rows if r["losses"]]
    fits = "no eviction" if single["distinct"] <= single["kv_tokens"] else "EVICTION POSSIBLE"
    lines.append(
        f"oracle = the single worker's hit rate; the workload holds at most {single['distinct']:,} "
        f"distinct tokens, its KV cache {single['kv_tokens']:,} ({fits})"
    )
    affinity = next((r for r in rows if r["name"] == "affinity"), None)
    if affinity:
        ratio, p95 = affinity["hit"] / oracle, pct(affinity["ttft"], 95) / base_p95
        hit_text = f"affinity hit rate >= {HIT_TARGET:.0%} of the oracle: {ratio:.2f}"
        p95_text = f"affinity TTFT p95 <= {P95_TARGET}x the single warm worker's: {p95:.2f}"
        for met, text in ((ratio >= HIT_TARGET, hit_text), (p95 <= P95_TARGET, p95_text)):
            lines.append(f"{'met' if met else 'NOT MET':>7}  {text}")
    return "\n".join(lines)


def detail_table(rows: list[dict]) -> str:
    """Where a row's hits and time went: requests and hit rate per member, affinity's routes off
    the least loaded, TTFT p95 of first turns and later ones, the members' load imbalance, their
    mean engine step and busy share (step time / wall, per worker), and the cores that other
    processes kept busy meanwhile."""
    head = (
        f"{'routing':<11}{'routed':>8} {'member hits':>11} {'aff.':>4} | TTFT p95 turn 1 "
        f"{'later':>6} | load |a-b| {'one idle':>8} | step ms {'busy':>5} | other cores "
        f"{'wall s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        members = sorted(r["routed"])
        routed = "/".join(f"{r['routed'][m]:.0f}" for m in members)
        hits = "/".join(f"{r['member_hit'].get(m, 0):.0%}" for m in members)
        lines.append(
            f"{r['name']:<11}{routed:>8} {hits:>11} {r['affinity_routes']:>4.0f} | "
            f"{pct(r['ttft_first'], 95) * 1000:>15.0f} {pct(r['ttft_later'], 95) * 1000:>6.0f} | "
            f"{r['imbalance']['mean_gap']:>10.2f} {r['imbalance']['idle_share']:>8.0%} | "
            f"{r['step_ms']:>7.0f} {r['busy']:>5.0%} | {r['others']:>11.2f} {r['wall']:>6.0f}"
        )
    return "\n".join(lines)


# -- the kill run -------------------------------------------------------------------------------


async def place_groups(serve: Serve, session, systems: list[str]) -> tuple[str, str, str, str]:
    """Two system prompts whose first requests went to different members: (prompt, member) x 2."""
    placed: dict[str, str] = {}
    for system in systems:
        before = await serve.metrics(session)
        body = {"model": serve.model, "max_tokens": 1, "messages": [
            {"role": "system", "content": system}, user(STORY_PROMPTS[0])]}  # fmt: skip
        await stream_chat(session, serve.base, body)
        after = await serve.metrics(session)
        member = next(
            k[1]
            for k in after
            if k[0] == "sluice_member_requests_total" and after[k] > before.get(k, 0)
        )
        placed.setdefault(member, system)
        if len(placed) == 2:
            (m_a, s_a), (m_b, s_b) = placed.items()
            return s_a, m_a, s_b, m_b
    sys.exit("kill run: every system prompt went to the same member")


async def kill_run(args, systems: list[str], logdir: Path) -> dict:
    serve = Serve(args, "kill", 2, "affinity", logdir)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            await serve.start(session)
            await serve.warm_up(session)
            sys_a, member_a, sys_b, _ = await place_groups(serve, session, systems)
            victim = serve.worker_procs()[member_a]
            metrics0 = await serve.metrics(session)
            result = await kill_streams(serve, session, sys_a, sys_b, member_a, victim)
            await asyncio.sleep(1.5)
            metrics1 = await serve.metrics(session)
    finally:
        serve.stop()
    result["migrations"] = {
        k[1]: metrics1[k] - metrics0.get(k, 0)
        for k in metrics1
        if k[0] == "sluice_run_migrations_total"
    }
    return result


async def kill_streams(serve, session, sys_a, sys_b, member_a, victim) -> dict:
    """C clients, `kill_rounds` streams each; SIGKILL `victim` when the first group's streams of
    the middle round are halfway through."""
    args = serve.args
    groups: dict[str, list[Stream]] = {"a": [], "b": []}
    middle = (args.kill_rounds - 1) // 2
    state: dict = {}

    async def client(i: int) -> None:
        group, system = ("a", sys_a) if i % 2 == 0 else ("b", sys_b)
        for r in range(args.kill_rounds):
            prompt = STORY_PROMPTS[(i // 2 + r) % len(STORY_PROMPTS)] + f" (client {i}, round {r})"
            body = {"model": serve.model, "max_tokens": args.kill_tokens,
                    "messages": [{"role": "system", "content": system}, user(prompt)]}  # fmt: skip
            groups[group].append(s := Stream(sent=time.perf_counter()))
            await stream_chat(session, serve.base, body, s)

    async def killer() -> None:
        size = (args.kill_concurrency + 1) // 2  # streams of group a per round
        while True:
            live = groups["a"][middle * size : (middle + 1) * size]
            if (
                len(live) == size
                and sum(len(s.chunks) for s in live) >= size * args.kill_tokens / 2
            ):
                break
            await asyncio.sleep(0.01)
        state["running"] = (await serve.stats(session))[member_a]["running"]
        victim.send_signal(signal.SIGKILL)
        state["killed"] = time.perf_counter()

    await asyncio.gather(killer(), *(client(i) for i in range(args.kill_concurrency)))
    t = state["killed"]
    everything = groups["a"] + groups["b"]
    # cut: on the killed member (group a), sent before the kill, still streaming after it
    cut = [s for s in groups["a"] if s.sent < t and (not s.chunks or s.chunks[-1] > t)]
    uncut_gaps = [g for s in everything if s not in cut for g in s.gaps()]
    return {
        "member": member_a,
        "killed_after": t - min(s.sent for s in everything),
        "running": state["running"],
        "requests": len(everything),
        "errors": [s.error or f"status {s.status}" for s in everything if not s.ok],
        "cut": len(cut),
        "cut_errors": sum(not s.ok for s in cut),
        "cut_gaps": sorted(max([s.chunks[0] - s.sent if s.chunks else 0, *s.gaps()]) for s in cut),
        "uncut": [pct(uncut_gaps, q) for q in (50, 99, 100)],
    }


def kill_table(k: dict, args: argparse.Namespace) -> str:
    mig = k["migrations"]
    lines = [
        f"kill: affinity, 2 workers, C={args.kill_concurrency}, {args.kill_rounds} streams per "
        f"client of {args.kill_tokens} tokens; SIGKILL {k['member']} at {k['killed_after']:.1f} s, "
        f"{k['running']} streams running on it, {k['cut']} cut",
    ]
    head = (
        f"{'requests':>8} {'errors':>6} {'cut':>4} | migrated continued {'failed':>6} "
        f"{'not_cont.':>9} | stall ms: cut max gap p50 {'max':>6} | uncut gap p50 {'p99':>6} "
        f"{'max':>6}"
    )
    gaps = k["cut_gaps"]
    lines += [head, "-" * len(head)]
    lines.append(
        f"{k['requests']:>8} {len(k['errors']):>6} {k['cut']:>4} | "
        f"{mig.get('continued', 0):>18.0f} "
        f"{mig.get('failed', 0):>6.0f} {mig.get('not_continuable', 0):>9.0f} | "
        f"{pct(gaps, 50) * 1000:>25.0f} {(max(gaps) if gaps else float('nan')) * 1000:>6.0f} | "
        f"{k['uncut'][0] * 1000:>13.0f} {k['uncut'][1] * 1000:>6.0f} {k['uncut'][2] * 1000:>6.0f}"
    )
    if k["errors"]:
        lines.append(f"client-visible errors ({k['cut_errors']} of them on cut streams): "
                     f"{sorted(set(k['errors']))}")  # fmt: skip
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default', 'tiny', or a local HF folder")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--systems", type=int, default=4, help="system prompts")
    p.add_argument("--convs", type=int, default=2, help="conversations per system prompt")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--system-words", type=int, help="words per system prompt (200; tiny: 60)")
    p.add_argument("--user-words", type=int, help="words per user message (30; tiny: 10)")
    p.add_argument("--max-tokens", type=int, default=8, help="per turn (the reply)")
    p.add_argument("--concurrency", type=int, default=4, help="C: clients of the 2-worker rows")
    p.add_argument("--routings", default=",".join(ROUTINGS), help="pool rows, comma-separated")
    p.add_argument("--worker-threads", type=int, help="threads per worker (half the cores)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin workers")
    p.add_argument("--no-kill", dest="kill", action="store_false", help="leave out the kill run")
    p.add_argument("--kill-tokens", type=int, default=64, help="max tokens of the kill run")
    p.add_argument("--kill-rounds", type=int, default=2, help="streams per client, kill run")
    p.add_argument("--kill-concurrency", type=int, default=8, help="clients of the kill run")
    p.add_argument(
        "--trace",
        action="store_true",
        help="route one request at a time to see which member "
        "each went to, and say where hits were lost (slows arrivals a little)",
    )
    p.add_argument("--logdir", help="keep the gateways' logs here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=7, help="the workload's text and interleaving")
    p.add_argument("--port", type=int, default=8793)
    args = p.parse_args(argv)
    tiny = args.model == "tiny"
    args.system_words = args.system_words or (60 if tiny else 200)
    args.user_words = args.user_words or (10 if tiny else 30)
    args.worker_threads = args.worker_threads or max(1, len(os.sched_getaffinity(0)) // 2)
    from workers.config import WorkerConfig  # the workers' block size, for the KV check

    args.block_size = WorkerConfig().block_size
    return args


def model_path(name: str) -> str:
    if name != "tiny":
        return name
    sys.path.insert(0, str(ROOT))  # testkit/ is not installed
    from testkit.tiny_model import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="sluice-tiny-"))))


async def run_all(args: argparse.Namespace, logdir: Path) -> None:
    convs = build_workload(args)
    c = args.concurrency
    print(
        f"model {args.model} | {args.systems} system prompts x {args.convs} conversations x "
        f"{args.turns} turns = {len(convs) * args.turns} requests per row | {args.max_tokens} max "
        f"tokens | C={c} | {args.worker_threads} thread(s) per worker"
        + (", pinned" if args.pin else ""),
        flush=True,
    )
    rows = [await routing_row(args, "single", 1, max(1, c // 2), convs, logdir)]
    for name in args.routings.split(","):
        print(f"  {rows[-1]['name']} done in {rows[-1]['wall']:.0f} s", file=sys.stderr)
        rows.append(await routing_row(args, name, 2, c, convs, logdir))
    print("\n" + routing_table(rows), flush=True)
    if args.kill:
        systems = list(dict.fromkeys(conv.system for conv in convs))
        print("\n" + kill_table(await kill_run(args, systems, logdir), args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    args.model_path = model_path(args.model)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-pool-") as tmp:
        logdir = Path(args.logdir or tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        try:
            asyncio.run(run_all(args, logdir))
        except KeyboardInterrupt:
            return 130
    print(f"\n(the whole run took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
