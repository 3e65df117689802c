"""The soak's verdict: what was read back, judged against the design's promises, as table rows.

Pure functions of what the clients saw (`Observed`) and what the processes told afterwards
(soak_gather.py), so a row can be shown to fail on made-up data. A row with `ok` None is a
figure, not an invariant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from soak_clients import KINDS
from soak_gather import POOLED, TERMINAL, Footprint, Ledger, RunTold, WorkerTokens
from soak_observed import COUNTED, Observed

MIB = 1024 * 1024
GROWTH = 1.10  # a gateway's RSS and descriptors may end at most 10% above their warm-up values


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    value: str
    ok: bool | None = None  # None: a figure
    detail: tuple[str, ...] = ()  # what failed, printed under the table


def runs(observed: Observed, told: dict[str, RunTold]) -> list[Row]:
    """Every run reached one terminal state, both replicas say the same one, and it is what
    its client saw (a completed stream, a cancel's answer, a drop the grace may have ended)."""
    started = len(observed.runs)
    once = [r for r in observed.runs if _one_terminal(told.get(r))]
    agree = [r for r in once if told[r].statuses[0] in observed.runs[r].expect]
    not_once = tuple(
        f"{r}: {told[r].statuses if r in told else None}" for r in observed.runs if r not in once
    )
    disagree = tuple(
        f"{r} ({observed.runs[r].kind}): {told[r].statuses[0]}, "
        f"expected {sorted(observed.runs[r].expect)}"
        for r in once
        if r not in agree
    )
    statuses = Counter(told[r].statuses[0] for r in once)
    return [
        Row("runs started", str(started)),
        Row(
            "runs in one terminal state (both replicas agree)",
            f"{len(once)}/{started}",
            len(once) == started,
            not_once,
        ),
        Row(
            "terminal state is what its client saw",
            f"{len(agree)}/{started}",
            len(agree) == started,
            disagree,
        ),
        Row("runs by terminal state", ", ".join(f"{s} {n}" for s, n in sorted(statuses.items()))),
    ]


def _one_terminal(told: RunTold | None) -> bool:
    return told is not None and len(set(told.statuses)) == 1 and told.statuses[0] in TERMINAL


def usage(observed: Observed, told: dict[str, RunTold], ledger: Ledger) -> list[Row]:
    """Exactly one usage record per run, none for a run nobody started, each with the run's own
    terminal status. A run may be in the Redis stream and in a fallback file (its write to
    Redis timed out, yet landed): the ledger's reader counts it once, so that is no double
    bill, if both say the same; it is counted apart."""
    in_stream = Counter(r.run_id for r in ledger.stream)
    in_files = Counter(r.run_id for r in ledger.files)
    billed = ledger.billed()
    missing = [r for r in observed.runs if r not in billed]
    twice = [r for r in billed if in_stream[r] > 1 or in_files[r] > 1]
    unknown = [r for r in billed if r not in observed.runs]
    both = [r for r in billed if in_stream[r] and in_files[r]]
    unlike = [r for r in both if {x for x in ledger.files if x.run_id == r} != {billed[r]}]
    wrong = [r for r, rec in billed.items() if r in told and rec.status != told[r].statuses[0]]
    value = f"{len(billed)} for {len(observed.runs)} runs (stream {len(ledger.stream)}, files "
    value += f"{len(ledger.files)}; missing {len(missing)}, twice {len(twice)}, "
    value += f"unknown {len(unknown)})"
    detail = tuple(
        f"{what}: {run_id}"
        for what, runs in (("missing", missing), ("twice", twice), ("unknown", unknown))
        for run_id in runs
    )
    return [
        Row("usage records, exactly one per run", value, not (missing or twice or unknown), detail),
        Row(
            "runs in the stream and a fallback file (the reader counts one)",
            f"{len(both)}, alike {len(both) - len(unlike)}",
            not unlike,
            tuple(f"unlike: {r}" for r in unlike),
        ),
        Row(
            "usage record's status is the run's",
            f"{len(billed) - len(wrong)}/{len(billed)}",
            not wrong,
            tuple(wrong),
        ),
    ]


def tokens(ledger: Ledger, counted: WorkerTokens) -> list[Row]:
    """The ledger bills what the workers generated: exactly, but for the killed worker's last
    moments (its counter died with it; see WorkerTokens)."""
    billed = sum(r.generated_tokens for r in ledger.billed().values())
    made = counted.total
    diff = billed - made
    value = f"{billed} billed, {made:.0f} generated (diff {diff:+.0f}"
    value += f", allowed ±{counted.allowance:.0f} for the kill)" if counted.victim else ")"
    ok = abs(diff) <= counted.allowance if counted.victim else diff == 0
    return [Row("generated tokens: ledger == workers' counters", value, ok)]


def texts(observed: Observed, told: dict[str, RunTold]) -> list[Row]:
    """A stream read to its finish (across resumes, on either replica, merged or not) has the
    stored run's text."""
    rows = []
    for name, kinds in (("resumed", ("resume",)), ("other", ("plain", "slow", "cancel"))):
        read = [
            s
            for s in observed.runs.values()
            if s.kind in kinds and s.text is not None and (s.kind != "resume" or s.resumes)
        ]
        same = [s for s in read if s.run_id in told and told[s.run_id].text == s.text]
        rows.append(
            Row(
                f"{name} streams' text == stored text",
                f"{len(same)}/{len(read)}",
                len(same) == len(read) and bool(read),
            )
        )
    return rows


def greedy(observed: Observed, told: dict[str, RunTold], strict: bool = True) -> list[Row]:
    """Greedy runs of one prompt say the same, whichever worker (or both, across a kill) made
    them; a run that ended early said the start of it. An invariant only where `strict`: on
    the tiny model its wide logits leave no near ties; on a real model a batch of another
    shape (other runs beside it, a prompt from the prefix cache) rounds a little differently,
    and a near tie can flip (no engine promises batch invariance), so there it is a figure."""
    by_prompt: dict[int, list[tuple[str, RunTold]]] = {}
    for run_id, seen in observed.runs.items():
        if run_id in told:
            by_prompt.setdefault(seen.prompt, []).append((run_id, told[run_id]))
    agree = total = 0
    differ: list[str] = []
    for runs_of in by_prompt.values():
        whole = Counter(t.text for _, t in runs_of if t.statuses[0] == "completed")
        if not whole:
            continue
        reference = whole.most_common(1)[0][0] or ""
        for run_id, t in runs_of:
            total += 1
            text = t.text or ""
            same = text == reference if t.statuses[0] == "completed" else reference.startswith(text)
            agree += same
            if not same:
                differ.append(
                    f"{run_id} ({observed.runs[run_id].kind}, {t.statuses[0]}): "
                    + _first_difference(reference, text)
                )
    value = f"{agree}/{total}" + ("" if strict else " (a figure on this model)")
    ok = agree == total if strict else None
    return [Row("greedy runs of one prompt say the same", value, ok, tuple(differ))]


def _first_difference(reference: str, text: str) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(reference, text, strict=False)) if a != b),
        min(len(reference), len(text)),
    )
    near = slice(max(0, at - 20), at + 20)
    return (
        f"char {at} of {len(text)} (the others' {len(reference)}): "
        f"{text[near]!r} where they say {reference[near]!r}"
    )


def kv(stats: dict[str, dict]) -> list[Row]:
    value = ", ".join(f"{s['kv_blocks_used']} of {s['kv_blocks_total']}" for s in stats.values())
    idle = all(s["running"] == s["waiting"] == s["kv_blocks_used"] == 0 for s in stats.values())
    return [Row("KV blocks used after, per worker (none running)", value, idle)]


def footprint(name: str, base: Footprint, end: Footprint, bounds: dict[str, int]) -> list[Row]:
    """A gateway's RSS and its own descriptors (files, pipes, listening and client sockets) end
    within 10% of their values after warm-up (a drop is no leak). Its pooled connections are
    kept at the pool's peak (aiohttp takes pooled connections first in, first out, and the
    pool's probes every second touch each one, so none idles out; redis-py keeps idle ones,
    even those a restarted Redis closed, until it hands them out): those are held to `bounds`
    (per peer kind), set by the load's concurrency, far below what a connection leaked per run
    would reach. The ledger file opens once, the first time Redis is away, and stays open."""
    changed = [
        f"{k} {c0} → {c1}"
        for k in sorted(set(base.kinds.values()) | set(end.kinds.values()))
        if k not in POOLED and (c0 := base.count(k)) != (c1 := end.count(k))
    ]
    own = f"{base.own} → {end.own}" + (f" ({', '.join(changed)})" if changed else "")
    pooled = ", ".join(f"{k} {base.count(k)} → {end.count(k)} (≤ {bounds[k]})" for k in POOLED)
    closed = sum(1 for fd in end.gone if end.kinds[fd] in POOLED)
    pooled += f"; {closed} closed by their peer" if closed else ""
    growth = (end.rss / base.rss - 1) * 100
    gone = tuple(f"fd {fd}: was {what}" for fd, what in sorted(end.gone.items()))
    return [
        Row(
            f"gateway {name} RSS after warm-up → end",
            f"{base.rss / MIB:.1f} → {end.rss / MIB:.1f} MiB ({growth:+.1f}%)",
            end.rss <= base.rss * GROWTH,
        ),
        Row(
            f"gateway {name} own fds after warm-up → end",
            own,
            end.own <= base.own * GROWTH and end.count("ledger file") <= 1,
            gone,
        ),
        Row(
            f"gateway {name} pooled connections",
            pooled,
            all(end.count(k) <= bounds[k] for k in POOLED),
            gone,
        ),
    ]


def contract(observed: Observed) -> list[Row]:
    """Nothing a client should never see: a 5xx but a retried 503, a broken frame, an error
    frame a run's ending did not call for, a resume that skips or repeats."""
    problems = tuple(observed.problems)
    return [Row("answers outside the contract", str(len(problems)), not problems, problems)]


def coverage(observed: Observed) -> list[Row]:
    """Every kind of client ran (else the invariants above prove less than they say)."""
    kinds = Counter(s.kind for s in observed.runs.values())
    value = ", ".join(f"{k} {kinds[k]}" for k in KINDS)
    resumed = sum(1 for s in observed.runs.values() if s.resumes)
    merged = sum(1 for s in observed.runs.values() if s.merged)
    return [
        Row("runs per kind of client", value, all(kinds[k] for k in KINDS)),
        Row("streams resumed / merged for a slow reader", f"{resumed} / {merged}"),
        *(Row(what, str(observed.counts[what])) for what in COUNTED),
    ]


def table(rows: Iterable[Row]) -> str:
    rows = list(rows)
    width = max(len(r.name) for r in rows)
    value_width = max(len(r.value) for r in rows)
    lines = [
        f"{'check':<{width}}  {'value':<{value_width}}  result",
        "-" * (width + value_width + 10),
    ]
    for r in rows:
        verdict = "" if r.ok is None else ("ok" if r.ok else "FAIL")
        lines.append(f"{r.name:<{width}}  {r.value:<{value_width}}  {verdict}".rstrip())
    return "\n".join(lines)
