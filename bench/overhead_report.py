"""The tables `gateway_overhead.py` prints: every relay side by side per cell, the targets met or
not, and what policies, safety windows and another source tree's gateway add."""

from __future__ import annotations

import argparse

from bench_tenants import SAFETY_WINDOW_CHARS, TOKEN_CHARS
from overhead_bench import FLOOR
from overhead_relays import POLICY_RELAYS, SAFETY_RELAYS, compare_name

# name: ((concurrency, delay ms), summary key, limit, "<=" or ">="). The relay's targets are
# ratios to what the parsing floor and going direct do in the same repeat: absolute times and
# CPU differ from host to host, the ratios much less.
TARGETS = {
    "gateway CPU per chunk / the floor's, 64 streams x 20 ms": (
        (64, 20.0), "gateway_cpu_over_floor", 1.2, "<="
    ),
    "gw-redis CPU per chunk / the floor's, 64 streams x 20 ms": (
        (64, 20.0), "gw-redis_cpu_over_floor", 1.2, "<="
    ),
    "gateway added TTFT p99 over the floor's, 64 streams x 20 ms": (
        (64, 20.0), "gateway_over_floor_p99_ms", 5, "<="
    ),
    "gw-redis added TTFT p99 over the floor's, 64 streams x 20 ms": (
        (64, 20.0), "gw-redis_over_floor_p99_ms", 5, "<="
    ),
    "gateway chunks/s / direct's, 16 streams x 0 ms": (
        (16, 0.0), "gateway_direct_rate", 0.7, ">="
    ),
    "gateway RSS MB, 64 streams x 20 ms": ((64, 20.0), "gateway_rss_mb", 150, "<="),
    "gw-redis CPU per chunk / gateway's, 64 streams x 20 ms": (
        (64, 20.0), "redis_cpu_ratio", 1.3, "<="
    ),
    "gw-redis TTFT p50 over gateway's, 64 streams x 20 ms": (
        (64, 20.0), "redis_added_ttft_p50_ms", 5, "<="
    ),
}  # fmt: skip


def _floor_key(key: str) -> str | None:
    """The floor's value beside a target's (its CPU, its chunk rate), where it has one."""
    if key.endswith(("_cpu_over_floor", "_over_floor_p99_ms")):
        return None  # the ratio or gap is to the floor already
    if key.endswith("_direct_rate"):
        return f"{FLOOR}_direct_rate"
    return key.replace("gateway", FLOOR) if key.startswith("gateway") else None


def verdicts(rows: list[dict]) -> list[dict]:
    by_cell = {(r["concurrency"], r["delay_ms"]): r for r in rows}
    out = []
    for name, (cell, key, limit, op) in TARGETS.items():
        if cell in by_cell and key in by_cell[cell]:
            value = by_cell[cell][key]
            met = value <= limit if op == "<=" else value >= limit
            floor = by_cell[cell].get(_floor_key(key))
            out.append(
                {"target": f"{name} {op} {limit:,}", "value": value, "met": met, "floor": floor}
            )
    return out


def table(rows: list[dict], args: argparse.Namespace) -> str:
    """One line per relay per cell: TTFT, what it adds over going direct and over the floor,
    throughput, the relay's CPU per 1,000 chunks and its resident memory after the cell."""
    head = (
        f"{'delay':>5} {'C':>3} {'relay':<14} | TTFT p50    p99 | added p50    p99 | "
        f"over floor p99 | chunks/s | CPU-ms/1k | RSS MB"
    )
    retained = f"after {args.retained:,} runs retained per gateway; " if args.retained else ""
    lines = [
        f"{args.chunks} chunks per stream; {retained}medians of {args.repeats} repeat(s). TTFT "
        f"in ms; 'added' = over direct, 'over floor' = over the parsing relay ({FLOOR}). CPU-ms "
        "per 1,000 content chunks and RSS, of the relay process.",
        head,
        "-" * len(head),
    ]
    for r in rows:
        cell = f"{r['delay_ms']:>5g} {r['concurrency']:>3}"
        lines.append(
            f"{cell} {'direct':<14} | {r['direct_p50_ms']:>8.1f} {r['direct_p99_ms']:>6.1f} | "
            f"{'':16} | {'':14} | {r['direct_chunks_s']:>8,.0f} |"
        )
        for t in r["targets"]:
            floor = r.get(f"{t}_over_floor_p99_ms")
            lines.append(
                f"{cell} {t:<14} | {r[f'{t}_p50_ms']:>8.1f} {r[f'{t}_p99_ms']:>6.1f} | "
                f"{r[f'{t}_added_p50_ms']:>+9.1f} {r[f'{t}_added_p99_ms']:>+6.1f} | "
                f"{'' if floor is None else format(floor, '+14.1f'):>14} | "
                f"{r[f'{t}_chunks_s']:>8,.0f} | {r[f'{t}_cpu']:>9.1f} | {r[f'{t}_rss_mb']:>6.0f}"
            )
    for v in verdicts(rows):
        floor = "" if v["floor"] is None else f"  ({FLOOR}: {v['floor']:,.1f})"
        status = "met" if v["met"] else "NOT MET"
        value = f"{v['value']:,.2f}" if abs(v["value"]) < 10 else f"{v['value']:,.1f}"
        lines.append(f"{status:>7}  {v['target']}: {value}{floor}")
    return "\n".join(lines)


def compare_table(rows: list[dict], trees: list[str]) -> str:
    """The gateway of this tree ("after") against each `--compare` tree's, cell by cell (and
    on Redis, where the run had it, the two gateways there)."""
    head = (
        f"{'delay':>5} {'C':>3} {'before':<14} | added TTFT p50 before  after | p99 before  after"
        f" | CPU-ms/1k before after ratio | RSS MB before after"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for tree in map(compare_name, trees):
            pairs = [(tree, "gateway"), (f"{tree}-redis", "gw-redis")]
            for name, this in pairs:
                if f"{name}_cpu" not in r:  # the Redis pair: only with --store redis
                    continue
                cb, ca = r[f"{name}_cpu"], r[f"{this}_cpu"]
                lines.append(
                    f"{r['delay_ms']:>5g} {r['concurrency']:>3} {name:<14} | "
                    f"{r[f'{name}_added_p50_ms']:>+21.1f} {r[f'{this}_added_p50_ms']:>+6.1f} | "
                    f"{r[f'{name}_added_p99_ms']:>+10.1f} {r[f'{this}_added_p99_ms']:>+6.1f} | "
                    f"{cb:>16.1f} {ca:>5.1f} {ca / cb:>5.2f} | "
                    f"{r[f'{name}_rss_mb']:>13.0f} {r[f'{this}_rss_mb']:>5.0f}"
                )
    return "\n".join(lines)


def safety_table(rows: list[dict]) -> str:
    """What the safety window adds over the same tenant without one, cell by cell: TTFT (and
    the hold the window itself implies: W characters at the stream's rate) and CPU per chunk."""
    head = (
        f"{'delay':>5} {'C':>3} {'window':<9} | added TTFT p50 {'p99':>7} | own hold {'+5ms':>6} "
        f"{'ok':>3} | CPU-ms/1k {'off':>6} {'this':>6} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for name in SAFETY_RELAYS[1:]:
            if f"{name}_cpu" not in r:
                continue
            p50 = r[f"{name}_added_p50_ms"] - r["window-off_added_p50_ms"]
            p99 = r[f"{name}_added_p99_ms"] - r["window-off_added_p99_ms"]
            hold = SAFETY_WINDOW_CHARS / TOKEN_CHARS * r["delay_ms"]
            off, this = r["window-off_cpu"], r[f"{name}_cpu"]
            ok = "yes" if p99 <= hold + 5 else "NO"
            lines.append(
                f"{r['delay_ms']:>5g} {r['concurrency']:>3} {name:<9} | {p50:>+14.1f} {p99:>+7.1f}"
                f" | {hold:>8.1f} {hold + 5:>6.1f} {ok:>3} | {off:>16.1f} {this:>6.1f} "
                f"{this / off:>6.2f}"
            )
    return "\n".join(lines)


def policies_table(rows: list[dict]) -> str:
    """What each policies-on gateway adds over the policies-off one, cell by cell."""
    head = (
        f"{'delay':>5} {'C':>3} {'policies on':<12} | added over gw: TTFT p50 {'p99':>7} | "
        f"CPU-ms/1k {'gw':>6} {'this':>6} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for name in POLICY_RELAYS:
            if f"{name}_cpu" not in r:
                continue
            p50 = r[f"{name}_added_p50_ms"] - r["gateway_added_p50_ms"]
            p99 = r[f"{name}_added_p99_ms"] - r["gateway_added_p99_ms"]
            gw, this = r["gateway_cpu"], r[f"{name}_cpu"]
            lines.append(
                f"{r['delay_ms']:>5g} {r['concurrency']:>3} {name:<12} | "
                f"{p50:>+23.1f} {p99:>+7.1f} | {gw:>16.1f} {this:>6.1f} {this / gw:>6.2f}"
            )
    return "\n".join(lines)
