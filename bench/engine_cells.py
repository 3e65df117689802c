"""One cell of the engine benchmark (a row in one dtype, every concurrency) in its own process.

The parent spawns `engine_throughput.py --cell ROW` (a fresh interpreter, so memory is that
row's), reads back the lines it marks `@cell` (one JSON summary per concurrency), and keeps the
median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_drive import EMBED_BACKLOG, EMBED_TOKENS, Embedded, drive
from engine_hf_rows import make_cb_manager, run_cb, run_generate
from engine_rows import (
    COMPARED_ROWS,
    EMBED_ROWS,
    ENGINE_KWARGS,
    bench_grammar,
    engine_settings,
    make_engine,
)
from engine_stats import summarize
from engine_workload import (
    Arrival,
    build_prompts,
    document_prompt,
    mixed_prompts,
    plan,
    warmup_size,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).with_name("engine_throughput.py")
CELL_MARK = "@cell "
PASSED_ON = (  # the parent's settings every cell gets, when set
    "model",
    "threads",
    "cb_num_blocks",
    "cb_max_batch_tokens",
    *ENGINE_KWARGS,
    "step_time_target",
    "arrivals",
    "rate",
    "cancel_fraction",
    "deadline_fraction",
    "deadline_ms",
    "seed",
)


def open_row(row: str, model: Any, tokenizer: Any, args: argparse.Namespace, c: int, prompts):
    """(run arrivals, close, settings used, row (g)'s embedding client) for this row at
    concurrency c."""
    if row in ("a", "b"):

        def run_hf(arrivals: list[Arrival], tag: str, n: int) -> list:
            return run_generate(model, tokenizer, [a.prompt for a in arrivals], n)

        return run_hf, lambda: None, {}, None
    if row == "c":
        manager = make_cb_manager(model, args, c, prompts)
        cfg = manager.continuous_batching_config
        settings = {k: getattr(cfg, k) for k in ("num_blocks", "page_size", "max_batch_tokens")}
        settings.update(max_requests_per_batch=c, attn=model.config._attn_implementation)

        def run_manager(arrivals: list[Arrival], tag: str, n: int) -> list:
            return run_cb(manager, [a.prompt for a in arrivals], n, tag)

        def close() -> None:
            manager.stop(block=True, timeout=30)

        return run_manager, close, settings, None
    engine, used = make_engine(model, tokenizer, engine_settings(row, args, c, prompts))
    grammar = bench_grammar(engine, tokenizer) if row == "f" else None
    embedded = None
    if row in EMBED_ROWS:
        documents = [document_prompt(tokenizer, k)[:EMBED_TOKENS] for k in range(16)]
        embedded = Embedded(engine, documents, "embed")
        used["embed_backlog"] = EMBED_BACKLOG

    def run_engine(arrivals: list[Arrival], tag: str, n: int) -> list:
        return drive(engine, arrivals, n, tag, grammar, embedded)

    return run_engine, lambda: None, used, embedded


def reset_peak_rss() -> None:
    """Give freed heap back and restart the kernel's RSS high-water mark (VmHWM), so each
    concurrency reports its own peak; without /proc the peak is the process's so far."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_runs(row: str, arrivals: list[Arrival], c: int, poisson: bool) -> list[list[Arrival]]:
    """Poisson: one run of every arrival; waves: `c` requests at a time ((a): one), each wave
    submitted at once when the one before has finished."""
    if poisson:
        return [arrivals]
    size = 1 if row == "a" else c
    waves = [arrivals[i : i + size] for i in range(0, len(arrivals), size)]
    return [[Arrival(0.0, a.prompt, a.cancel_after, a.deadline_s) for a in w] for w in waves]


def run_cell(args: argparse.Namespace) -> None:
    """Child process: load the model, run the row at each concurrency, print one line each."""
    import torch

    from workers.model_loader import load_model, resolve_model_path

    row = args.cell
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(resolve_model_path(args.model), args.device, args.dtype)
    # a tied embedding is one parameter, used once as a matmul (the output head)
    gflop_per_token = 2 * sum(p.numel() for p in model.parameters()) / 1e9
    if row in ("a", "b"):  # NOTE: like ignore_eos: EOS is generated as a token, nothing stops
        model.generation_config.eos_token_id = None
    for c in args.concurrency:
        if (row == "a" and c != 1) or (row == "b" and c == 1 and "a" in args.rows):
            continue  # (a) is one at a time; (b) at c=1 is (a) again
        poisson = args.arrivals == "poisson"
        count = args.requests if poisson else math.ceil(max(c, args.requests) / c) * c
        warm, warm_tokens = warmup_size(c)
        prompts = (mixed_prompts if poisson else build_prompts)(tokenizer, count + warm)
        prompts, warmup = prompts[:count], prompts[count:]  # warm-up prompts are not reused
        arrivals = plan(prompts, args, args.rate if poisson else None)
        reset_peak_rss()
        run, close, settings, embedded = open_row(row, model, tokenizer, args, c, prompts + warmup)
        try:
            run([Arrival(0.0, p) for p in warmup], "warmup", warm_tokens)
            if embedded is not None:  # the timed runs' embeddings only
                embedded.inputs = embedded.tokens = 0
            traces, started = [], time.perf_counter()
            for w, wave in enumerate(timed_runs(row, arrivals, c, poisson)):
                traces.extend(run(wave, f"c{c}w{w}", args.max_new_tokens))
            wall = time.perf_counter() - started
        finally:
            close()
        result = summarize(traces, wall, args.max_new_tokens)
        result.update(row=row, concurrency=c, dtype=args.dtype, wall_s=wall, settings=settings)
        result["rss_mib"] = peak_rss_mib()
        result["gflop_per_token"] = gflop_per_token
        result["prompt_tokens"] = [min(map(len, prompts)), max(map(len, prompts))]
        result["threads"] = torch.get_num_threads()
        if embedded is not None:
            result["embedded"] = {"inputs": embedded.inputs, "tokens": embedded.tokens}
        result["step_time_target_s"] = settings.get("step_time_target_s")
        print(CELL_MARK + json.dumps(result, default=str), flush=True)


def matmul_gflops(dtype_name: str, device: str = "cpu", repeats: int = 10) -> float:
    """Best of `repeats` timings of a square matmul (3 back to back) on `device`: 1024 wide on
    a CPU (this process's threads), 8192 on a GPU, where a smaller one is launch-bound."""
    import torch

    dtype, size = getattr(torch, dtype_name), 8192 if device == "cuda" else 1024
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.matmul(a, b)
    sync()
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(3):
            torch.matmul(a, b)
        sync()
        best = min(best, (time.perf_counter() - started) / 3)
    return 2 * size**3 / best / 1e9


@dataclass(slots=True)
class CellRun:
    row: str
    dtype: str
    results: list[dict[str, Any]]
    failure: str | None = None


def spawn_cell(args: argparse.Namespace, row: str, dtype: str) -> CellRun:
    """Run one row in one dtype in a fresh interpreter; its stdout lines marked @cell are JSON."""
    cmd = [sys.executable, str(SCRIPT), "--cell", row, "--dtype", dtype]
    cmd += ["--rows", ",".join(args.rows), "--concurrency", ",".join(map(str, args.concurrency))]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--requests", str(args.requests)]
    cmd += ["--device", args.device]
    for name in PASSED_ON:
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    if row in COMPARED_ROWS:
        env["SLUICE_BENCH_TREE"] = str(Path(args.compare).resolve())
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CELL_MARK)]
    results = [json.loads(ln[len(CELL_MARK) :]) for ln in lines]
    took = time.perf_counter() - started
    print(f"  ({row}) {dtype}: {took:.0f} s", file=sys.stderr, flush=True)
    failure = None
    if proc.returncode != 0:
        failure = f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-3:])
    return CellRun(row, dtype, results, failure)


def median_runs(rounds: list[CellRun]) -> list[CellRun]:
    """One run per (row, dtype): per concurrency, the repeat with the median tok/s."""
    merged: dict[tuple[str, str], CellRun] = {}
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for run in rounds:
        first = merged.setdefault((run.row, run.dtype), CellRun(run.row, run.dtype, []))
        first.failure = first.failure or run.failure
        for res in run.results:
            cells.setdefault((run.row, run.dtype, res["concurrency"]), []).append(res)
    for (row, dtype, _), found in cells.items():
        found.sort(key=lambda res: res["tok_s"])
        merged[(row, dtype)].results.append(found[(len(found) - 1) // 2])
    for run in merged.values():
        run.results.sort(key=lambda res: res["concurrency"])
    return list(merged.values())
