"""Engine throughput: sluicegate's engine against transformers, same prompts, same output lengths.

Rows, each in its own subprocess per dtype (a fresh interpreter, so memory is that row's):

  (a) `model.generate`, one request at a time (run at concurrency 1 only; (b) at c=1 is (a));
  (b) `model.generate` on static batches, left-padded, batch = the concurrency;
  (c) transformers' continuous batching: an `init_continuous_batching` manager, its paged cache,
      `max_requests_per_batch` = the concurrency, transformers' other defaults;
  (d) sluicegate's `Engine` as a worker builds it (its step-time target included), driven
      synchronously: requests added as they arrive, `step()` until every one has ended;
      `max_num_seqs` = the concurrency;
  (d-fixed) row (d) without a step-time target: prefill fills the fixed token budget;
  (d-sdpa) row (d) with the decodes' attention in SDPA over runs of rows, not the CPU kernel;
  (d-eager) row (d) with every step eager: no CUDA graphs for decode-only steps (a CPU has none);
  (f) row (d) with every request under a JSON-schema constraint (engine_rows.py);
  (g) row (d) with a retrieval client embedding 512-token documents through the same engine,
      8 queued at any time while decodes run (`max_num_seqs` = c + 8, so the documents do not
      take the streams' places): the decodes' ITL beside embeddings.

At concurrency c a *wave* is c requests submitted together; a cell runs ceil(max(c, --requests)
/ c) waves one after another, after an untimed warm-up wave of c other prompts, 16 tokens each
(engine_workload.warmup_size). With `--arrivals poisson --rate R`, `--requests` requests arrive
instead as a Poisson process of R per second, every fourth one a long document (400-800 tokens)
among the 30-180-token chat prompts, so prefill keeps meeting running decodes; c is then the
engine's `max_num_seqs`. Every row sees the same prompts and arrival times, greedy, and exactly
`--max-new-tokens` tokens per request: EOS is generated as a token and nothing stops ((a)/(b)
unset EOS in the model's generation config, (c) eos_token_id=-1, (d) ignore_eos). The last
column shows the per-request counts each row reported (finish events for (d)).

`--cancel-fraction F` has that share of the engine rows' requests cancelled by their client
after a random number of tokens, `--deadline-fraction F` that share given a deadline of
`--deadline-ms`; the goodput table then shows tokens generated, sent and committed, and
throughput with and without them (engine_stats.py says what each column counts).

Both paged caches are sized to the workload by default (c x the longest request, in each one's
block size), so RSS compares the engines rather than their default budgets: `--num-kv-blocks 0`
gives the engine its own default (a 2 GiB budget), `--cb-num-blocks 0` gives transformers its
own (on CPU, 60% of free RAM).

    .venv/bin/python bench/engine_throughput.py --quick       # smoke run, well under 2 min
    .venv/bin/python bench/engine_throughput.py               # full table, both dtypes
    .venv/bin/python bench/engine_throughput.py --rows a,c,d --dtype float32 --concurrency 8,32
    .venv/bin/python bench/engine_throughput.py --rows d,d-fixed --arrivals poisson --rate 1 \
        --requests 40 --concurrency 32 --dtype bfloat16 --cancel-fraction 0.2

With `--compare TREE`, row (e) is row (d) run from another source tree (another checkout of this
repository, say the commit before a change), and the ratios add engine / engine-before: before
vs after, in one run; with row (g) it also runs (e-g), row (g) from that tree. `--repeats N`
runs every row N times, the rows taking turns (d, e, d, e, ...) so a slow spell of a shared
machine falls on both, and shows each cell's median run by tok/s. The modules: engine_workload
(prompts, arrivals), engine_hf_rows (a-c), engine_rows and engine_drive (the engine rows),
engine_stats, engine_cells (one row's process), engine_tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tree whose engine a cell runs: this one, or another for row (e) of `--compare`
TREE = Path(os.environ.get("SLUICE_BENCH_TREE", ROOT))
if str(TREE) not in sys.path:
    sys.path.insert(0, str(TREE))

from engine_cells import matmul_gflops, median_runs, run_cell, spawn_cell  # noqa: E402
from engine_rows import ENGINE_KWARGS, ENGINE_ROWS  # noqa: E402
from engine_tables import ROWS, print_tables  # noqa: E402

QUICK = {"concurrency": "1,8", "max_new_tokens": 16, "dtype": "bfloat16", "requests": 1}


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arrivals", choices=("waves", "poisson"), default="waves")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    p.add_argument("--cancel-fraction", type=float, default=0.0, help="share cancelled mid-stream")
    p.add_argument("--deadline-fraction", type=float, default=0.0, help="share given --deadline-ms")
    p.add_argument("--deadline-ms", type=float, default=2000.0)
    p.add_argument("--seed", type=int, default=0, help="arrivals, cancels and deadlines")


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cb-num-blocks",
        type=int,
        default=None,
        help="transformers CB cache blocks (default: fitted to the workload; "
        "0: transformers' own sizing, 60%% of free RAM on CPU)",
    )
    p.add_argument("--cb-max-batch-tokens", type=int, default=None)
    for name in ENGINE_KWARGS:
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help="engine setting, passed only if the engine accepts it"
            + (
                " (default: fitted to the workload; 0: the engine's default)"
                if "kv" in name
                else ""
            ),
        )
    p.add_argument(
        "--step-time-target",
        type=float,
        default=None,
        help="seconds, rows d/e/f (default: the worker's; 0: none); d-fixed never has one",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="c=1,8; 16 tokens; bfloat16; 1 request")
    p.add_argument(
        "--rows", default="a,b,c,d", help="which rows: a,b,c,d,d-fixed,d-sdpa,d-eager,f,g"
    )
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--dtype", default="bfloat16,float32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=4, help="at least this many per concurrency")
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write every cell's results to this file")
    _add_workload_arguments(p)
    _add_engine_arguments(p)
    p.add_argument("--repeats", type=int, default=1, help="runs of every row, taking turns")
    p.add_argument("--compare", metavar="TREE", help="row (e): row (d) from this source tree")
    p.add_argument("--cell", choices=sorted(ROWS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if p.get_default(name) == getattr(args, name):
                setattr(args, name, value)
    args.concurrency = sorted({int(c) for c in str(args.concurrency).split(",")})
    args.rows = [r for r in args.rows.split(",") if r]
    if args.compare and args.cell is None:
        compared = ["e", "e-g"] if "g" in args.rows else ["e"]
        args.rows += [r for r in compared if r not in args.rows]
    if args.cell is None and not args.compare and {"e", "e-g"} & set(args.rows):
        p.error("rows e and e-g run another tree's engine: give it with --compare TREE")
    if set(args.rows) - set(ROWS):
        p.error(f"unknown rows {sorted(set(args.rows) - set(ROWS))}; pick from {','.join(ROWS)}")
    shares = (args.cancel_fraction, args.deadline_fraction)
    if min(shares) < 0 or sum(shares) > 1 or args.rate <= 0:
        p.error("--cancel-fraction and --deadline-fraction: 0-1 together; --rate: above 0")
    plain = args.arrivals == "waves" and not (args.cancel_fraction or args.deadline_fraction)
    if not plain and set(args.rows) - set(ENGINE_ROWS):
        p.error(
            "Poisson arrivals, cancels and deadlines run the engine rows only "
            "(d, d-fixed, d-sdpa, d-eager, e, f)"
        )
    if args.cell is None:
        args.dtype = [d for d in args.dtype.split(",") if d]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cell is not None:
        run_cell(args)
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    gflops = {dtype: matmul_gflops(dtype, args.device) for dtype in args.dtype}
    print(
        f"engine_throughput: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, device {args.device}; rows {','.join(args.rows)}; "
        f"concurrency {args.concurrency}; >= {args.requests} requests per concurrency",
        flush=True,
    )
    rounds = [
        spawn_cell(args, row, dtype)
        for _ in range(args.repeats)
        for dtype in args.dtype
        for row in args.rows
    ]
    runs = median_runs(rounds)
    print_tables(args, runs, gflops)
    if args.json:
        cells = [
            {"row": r.row, "dtype": r.dtype, "failure": r.failure} | {"results": r.results}
            for r in runs
        ]
        Path(args.json).write_text(json.dumps({"gflops": gflops, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
