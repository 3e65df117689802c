"""The engine benchmark's tables: one line per row and concurrency, the ratios between rows,
and what each engine row generated, sent and committed (goodput).

  %peak      GFLOP per token (2 x the model's parameters) x tok/s / the best square torch.matmul
             GFLOP/s in that dtype on the device (1024 wide on a CPU, 8192 on a GPU)
  RSS MiB    peak RSS (VmHWM, reset before each concurrency) of the row's process, model included
  ITL p99/p50  how much the slowest gaps exceed the typical one (prefill stalling decodes)
"""

from __future__ import annotations

import argparse
from typing import Any

from engine_cells import CellRun
from engine_rows import ENGINE_ROWS

GFLOP_PER_TOKEN = 0.27  # ~2 x 135M parameters, SmolLM2-135M: for cells that do not say theirs
ROWS = {
    "a": "generate, one at a time",
    "b": "generate, static batch",
    "c": "transformers CB",
    "d": "sluicegate engine",
    "d-fixed": "engine, no target",
    "d-sdpa": "engine, SDPA decodes",
    "d-eager": "engine, no graphs",
    "e": "engine, --compare tree",
    "f": "engine + JSON schema",
    "g": "engine + embeddings",
    "e-g": "(g), --compare tree",
}


def label(row: str) -> str:
    return f"({row}) {ROWS[row]}"


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def _line(label: str, res: dict[str, Any], gflops: float) -> str:
    peak = res.get("gflop_per_token", GFLOP_PER_TOKEN) * res["tok_s"] / gflops * 100
    check = f"{res['counts']} ok" if res["counts_ok"] else f"MISMATCH {res['counts']}"
    if res["errors"]:
        check += f" errors {res['errors']}"
    return (
        f"{label:<28}{res['concurrency']:>4}{res['requests']:>6}{res['tok_s']:>9.1f}"
        f"{_fmt(res['ttft_p50']):>10}{_fmt(res['ttft_p99']):>8}"
        f"{_fmt(res['itl_p50'], '.1f'):>9}{_fmt(res['itl_p99'], '.1f'):>8}"
        f"{_fmt(_ratio(res['itl_p99'], res['itl_p50']), '.2f'):>8}"
        f"{peak:>6.1f}%{res['rss_mib']:>9.0f}  {check}"
    )


def print_tables(args: argparse.Namespace, runs: list[CellRun], gflops: dict[str, float]) -> None:
    head = (
        f"{'row':<28}{'c':>4}{'reqs':>6}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}"
        f"{'ITL p50':>9}{'p99':>8}{'p99/p50':>8}{'%peak':>7}{'RSS MiB':>9}  tokens/request"
    )
    for dtype in args.dtype:
        mine = [r for r in runs if r.dtype == dtype]
        print(f"\n== {dtype} | {workload(args)} | matmul {gflops[dtype]:.1f} GFLOP/s | ms ==")
        print(head)
        for run in mine:
            for res in run.results:
                print(_line(label(run.row), res, gflops[dtype]))
            if run.failure:
                print(f"{label(run.row):<28} FAILED {run.failure}")
        if "a" in args.rows and "b" in args.rows and 1 in args.concurrency:
            print("(b) at c=1 is (a): not run twice")
        for run in mine:
            if run.results and run.row not in ("a", "b"):
                last = run.results[-1]
                shown = " ".join(f"{k}={v}" for k, v in last["settings"].items())
                print(f"({run.row}) settings at c={last['concurrency']}: {shown}")
        print_ratios(args, mine)
        print_goodput(mine)
        print_embeddings(mine)


def print_ratios(args: argparse.Namespace, runs: list[CellRun]) -> None:
    by = {(r.row, res["concurrency"]): res["tok_s"] for r in runs for res in r.results}
    cols = args.concurrency
    print(f"\n{'tok/s ratio':<36}" + "".join(f"{'c=' + str(c):>9}" for c in cols))
    base = by.get(("a", 1))
    lines = {
        "engine / transformers CB": [(by.get(("d", c)), by.get(("c", c))) for c in cols],
        "engine / generate (a, c=1)": [(by.get(("d", c)), base) for c in cols],
        "engine / engine of --compare": [(by.get(("d", c)), by.get(("e", c))) for c in cols],
        "target / fixed budget (d / d-fixed)": [
            (by.get(("d", c)), by.get(("d-fixed", c))) for c in cols
        ],
        "decode kernel / SDPA (d / d-sdpa)": [
            (by.get(("d", c)), by.get(("d-sdpa", c))) for c in cols
        ],
        "CUDA graphs / eager (d / d-eager)": [
            (by.get(("d", c)), by.get(("d-eager", c))) for c in cols
        ],
        "JSON schema / free (f / d)": [(by.get(("f", c)), by.get(("d", c))) for c in cols],
        "transformers CB / generate (a)": [(by.get(("c", c)), base) for c in cols],
    }
    for name, pairs in lines.items():
        cells = [f"{n / d:>8.2f}x" if n and d else f"{'n/a':>9}" for n, d in pairs]
        if any(n and d for n, d in pairs):
            print(f"{name:<36}" + "".join(cells))


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def workload(args: argparse.Namespace) -> str:
    """The table's heading: what every row was asked to do."""
    parts = [f"{args.max_new_tokens} new tokens/request, greedy"]
    if args.arrivals == "poisson":
        parts.append(f"Poisson arrivals {args.rate:g}/s, {args.requests} requests, mixed prompts")
    if args.cancel_fraction or args.deadline_fraction:
        parts.append(
            f"{args.cancel_fraction:.0%} cancelled mid-stream, {args.deadline_fraction:.0%} "
            f"with a {args.deadline_ms:g} ms deadline"
        )
    return " | ".join(parts)


def print_goodput(runs: list[CellRun]) -> None:
    """Engine rows: tokens generated, sent and committed, throughput with and without the
    requests their clients cancelled or let time out."""
    mine = [(run.row, res) for run in runs if run.row in ENGINE_ROWS for res in run.results]
    if not mine:
        return
    print(
        f"\n{'goodput':<28}{'c':>4}{'done':>6}{'cancel':>7}{'timeout':>8}{'generated':>10}"
        f"{'sent':>7}{'committed':>10}{'tok/s':>8}{'goodput/s':>10}"
    )
    for row, res in mine:
        o = res["outcomes"]
        print(
            f"{label(row):<28}{res['concurrency']:>4}{o['completed']:>6}{o['cancelled']:>7}"
            f"{o['timed_out']:>8}{res['generated']:>10}{res['sent']:>7}{res['committed']:>10}"
            f"{res['tok_s']:>8.1f}{res['goodput_tok_s']:>10.1f}"
        )


def print_embeddings(runs: list[CellRun]) -> None:
    """Row (g) beside row (d), and (e-g) beside (e) where `--compare` ran them: the decodes'
    inter-token gaps with embeddings computed in the same steps. The step budget (step_time.py):
    a step carrying prefill beside decodes runs at most ITL_RATIO times a decode-only step (or
    the target, where that is longer), so the typical gap may grow by up to that ratio and the
    slowest should not grow at all."""
    from workers.step_time import ITL_RATIO

    by = {(r.row, res["concurrency"]): res for r in runs for res in r.results}
    pairs = (("g", "d", "(g) / (d)"), ("e-g", "e", "(e-g) / (e), --compare"))
    cells = [
        (name, c, res, by.get((alone, c), {}))
        for embedded, alone, name in pairs
        for (row, c), res in sorted(by.items())
        if row == embedded
    ]
    if not cells:
        return
    print(
        f"\n{'embeddings beside decodes':<28}{'c':>4}{'ITL p50 d':>10}{'g':>7}{'g/d':>6}"
        f"{'p99 d':>8}{'g':>7}{'g/d':>6}{'budget':>8}{'inputs/s':>9}{'emb tok/s':>10}"
        f"{'chat tok/s d':>13}{'g':>7}  target"
    )
    for name, c, g, d in cells:
        embedded = g.get("embedded", {"inputs": 0, "tokens": 0})
        wall = g["wall_s"] or 1.0
        p50 = _ratio(g["itl_p50"], d.get("itl_p50"))
        p99 = _ratio(g["itl_p99"], d.get("itl_p99"))
        met = p50 is not None and p99 is not None and max(p50, p99) <= ITL_RATIO
        print(
            f"{name:<28}{c:>4}{_fmt(d.get('itl_p50'), '.1f'):>10}"
            f"{_fmt(g['itl_p50'], '.1f'):>7}{_fmt(p50, '.2f'):>6}"
            f"{_fmt(d.get('itl_p99'), '.1f'):>8}{_fmt(g['itl_p99'], '.1f'):>7}"
            f"{_fmt(p99, '.2f'):>6}{ITL_RATIO:>7.1f}x"
            f"{embedded['inputs'] / wall:>9.1f}{embedded['tokens'] / wall:>10.0f}"
            f"{_fmt(d.get('tok_s'), '.1f'):>13}{g['tok_s']:>7.1f}  {'met' if met else 'NOT MET'}"
        )
