"""Engine throughput: sluicegate's engine against transformers, same prompts, same output lengths.

Four rows, each in its own subprocess per dtype (a fresh interpreter, so memory is that row's):

  (a) `model.generate`, one request at a time (run at concurrency 1 only; (b) at c=1 is (a));
  (b) `model.generate` on static batches, left-padded, batch = the concurrency;
  (c) transformers' continuous batching: an `init_continuous_batching` manager, its paged cache,
      `max_requests_per_batch` = the concurrency, transformers' other defaults;
  (d) sluicegate's `Engine` (built by `make_engine`), driven synchronously: add the requests,
      `step()` until `has_unfinished()` is false; `max_num_seqs` = the concurrency;
  (f) row (d) with every request under a JSON-schema constraint (llguidance's per-step mask,
      workers/grammar_mask.py): an array of at least 10,000 mid-size objects, so no request
      completes its JSON before `--max-new-tokens` and the workload is the same as (d)'s.

At concurrency c a *wave* is c requests submitted together; a cell runs ceil(max(c, --requests)
/ c) waves one after another, after an untimed warm-up wave on other prompts. Every row sees the
same prompts (request k gets prompt k: a task x audience chat, 30-180 tokens), greedy, and
exactly `--max-new-tokens` tokens per request: EOS is generated as a token and nothing stops
((a)/(b) unset EOS in the model's generation config, (c) eos_token_id=-1, (d) ignore_eos). The
last column shows the per-request counts each row reported (finish events for (d)).

  tok/s      output tokens / wall time of the timed waves (prefill included)
  TTFT       wave submitted -> the request's first token
  ITL        gap between a request's consecutive token deliveries (a delivery of k tokens counts
             k times, gap / k); (a)/(b) stamp each step through a `generate` streamer, (c) uses
             the manager's own per-token stamps (`record_timestamps=True`), (d) the engine's
             text events, stamped when `step()` returns
  %peak      0.27 GFLOP/token x tok/s / best 1024^3 torch.matmul GFLOP/s in that dtype
  RSS MiB    peak RSS (VmHWM, reset before each concurrency) of the row's process, model included

Both paged caches are sized to the workload by default (c x the longest request, in each one's
block size), so RSS compares the engines rather than their default budgets: `--num-kv-blocks 0`
gives the engine its own default (a 2 GiB budget), `--cb-num-blocks 0` gives transformers its
own (on CPU, 60% of free RAM).

    .venv/bin/python bench/engine_throughput.py --quick       # smoke run, well under 2 min
    .venv/bin/python bench/engine_throughput.py               # full table, both dtypes
    .venv/bin/python bench/engine_throughput.py --rows a,c,d --dtype float32 --concurrency 8,32

With `--compare TREE`, row (e) is row (d) run from another source tree (another checkout of this
repository, say the commit before a change), and the ratios add engine / engine-before: before
vs after, in one run. `--repeats N` runs every row N times, the rows taking turns (d, e, d, e,
...) so a slow spell of a shared machine falls on both, and shows each cell's median run by
tok/s.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# the tree whose engine a cell runs: this one, or another for row (e) of `--compare`
TREE = Path(os.environ.get("SLUICE_BENCH_TREE", ROOT))
if str(TREE) not in sys.path:
    sys.path.insert(0, str(TREE))

GFLOP_PER_TOKEN = 0.27  # ~2 x 135M parameters, SmolLM2-135M
ROWS = {
    "a": "generate, one at a time",
    "b": "generate, static batch",
    "c": "transformers CB",
    "d": "sluicegate engine",
    "e": "engine, --compare tree",
    "f": "engine + JSON schema",
}
BENCH_ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "maxLength": 12},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number"},
        "kind": {"enum": ["book", "food", "toy"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["sku", "qty", "price", "kind"],
    "additionalProperties": False,
}
BENCH_SCHEMA = {"type": "array", "items": BENCH_ITEM, "minItems": 10_000}
CELL_MARK = "@cell "
# transformers' FIFO scheduler admits no new prefill while less than this share of its cache is free
CB_SAFETY_MARGIN = 0.15
ENGINE_KWARGS = ("num_kv_blocks", "block_size", "max_num_batched_tokens")
QUICK = {"concurrency": "1,8", "max_new_tokens": 16, "dtype": "bfloat16", "requests": 1}

SYSTEM = "You are a concise, accurate assistant. Answer in plain prose."
AUDIENCES = ("a beginner", "an expert", "a child", "a manager", "a student", "an engineer")
TASKS = (  # NOTE: lengths alternate so the first few prompts (all that c=1 runs) are mixed too
    "Say hello.",
    "I am planning a week-long trip to Japan in spring. I like food, old temples and quiet "
    "places, and I dislike crowds. Suggest a rough itinerary, which cities to stay in, how to "
    "get between them, and a couple of dishes I should not miss.",
    "What is the capital of France?",
    "Here are my notes from today's project meeting. Turn them into a short summary with "
    "decisions, open questions and action items, each with an owner.\n\n- Ana: the data "
    "migration is two weeks late because the legacy export drops rows with empty dates; she "
    "wants to patch the exporter rather than clean the data afterwards.\n- Ben disagrees, says "
    "patching the exporter risks the billing job that shares it; proposes a cleanup script.\n"
    "- We agreed to try Ben's script on last month's export first and compare row counts.\n"
    "- Chloe asked who owns the new dashboard; nobody answered. Budget review moved to Friday.\n"
    "- Dan will ask finance whether the cloud credits expire in June or in December.",
    "Give me three tips for better sleep.",
    "A small bakery sells bread, croissants and cakes. Sales were flat last year, rent went up "
    "by ten percent, and a chain store opened across the street. The owner has a loyal morning "
    "crowd but few customers after noon. Write a short, practical plan with five concrete "
    "steps the owner could try over the next three months, each with a way to tell whether it "
    "is working, and note one risk for each step.",
    "Explain what a hash table is and when you would use one.",
    "Here is some Python code:\n\ndef f(xs):\n    out = []\n    for x in xs:\n        if x % 2 "
    "== 0:\n            out.append(x * x)\n    return out\n\nWhat does it do? Rewrite it as a "
    "list comprehension, add type hints, and explain any edge cases worth testing.",
    "Compare TCP and UDP.",
    "Write a short poem about the sea at night, with a calm mood and simple words.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in a few sentences, then say what the play is "
    "really about and why people still read it today.",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Describe how a bill becomes a law in a parliamentary system, step by step, and mention "
    "where it can fail along the way.",
    "What is 17 times 23? Show your working.",
    "Write a friendly two-paragraph email to a colleague asking to move our Tuesday meeting to "
    "Thursday afternoon because of a conflicting dentist appointment, and offer two times.",
)


# -- workload and statistics -----------------------------------------------------------------------


def build_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` distinct chat prompts (task x audience), rendered with the model's template."""
    from workers.chat import render_prompt

    prompts = []
    for k in range(count):
        task = TASKS[k % len(TASKS)]
        audience = AUDIENCES[(k // len(TASKS)) % len(AUDIENCES)]
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"For {audience}: {task}"},
        ]
        prompts.append(render_prompt(tokenizer, messages))
    return prompts


def make_waves(prompts: list[list[int]], concurrency: int) -> list[list[list[int]]]:
    return [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class Trace:
    """One request's timeline: when its wave was submitted and when its tokens arrived."""

    submitted: float
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens)
    tokens: int = 0  # output tokens as counted by the row's own completion report
    error: str | None = None

    def ttft(self) -> float | None:
        return self.deliveries[0][0] - self.submitted if self.deliveries else None

    def itls(self) -> list[float]:
        gaps = []
        for (t0, _), (t1, k) in zip(self.deliveries, self.deliveries[1:], strict=False):
            gaps.extend([(t1 - t0) / k] * k)
        return gaps


def summarize(traces: list[Trace], wall: float, expected: int) -> dict[str, Any]:
    ttfts = [t for t in (tr.ttft() for tr in traces) if t is not None]
    itls = [g for tr in traces for g in tr.itls()]
    counts = sorted({tr.tokens for tr in traces})
    errors = [tr.error for tr in traces if tr.error]

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000

    return {
        "requests": len(traces),
        "tokens": sum(tr.tokens for tr in traces),
        "tok_s": sum(tr.tokens for tr in traces) / wall if wall > 0 else 0.0,
        "ttft_p50": ms(percentile(ttfts, 50)),
        "ttft_p99": ms(percentile(ttfts, 99)),
        "itl_p50": ms(percentile(itls, 50)),
        "itl_p99": ms(percentile(itls, 99)),
        "counts_ok": counts == [expected] and not errors,
        "counts": counts,
        "errors": errors[:3],
    }


# -- the four rows ---------------------------------------------------------------------------------


def _stamp_streamer() -> Any:
    """A `generate` streamer that stamps each decoding step (the first `put` is the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class StepStamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value: Any) -> None:
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    return StepStamps()


def run_generate(model: Any, tokenizer: Any, wave: list[list[int]], max_new: int) -> list[Trace]:
    """One `generate` call over the wave, left-padded (the cell unset EOS in the model's config)."""
    import torch

    enc = tokenizer.pad({"input_ids": wave}, padding_side="left", return_tensors="pt")
    streamer = _stamp_streamer()
    submitted = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            enc["input_ids"].to(model.device),
            attention_mask=enc["attention_mask"].to(model.device),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
        )
    new = out.shape[1] - enc["input_ids"].shape[1]
    deliveries = [(t, 1) for t in streamer.times]
    return [Trace(submitted, list(deliveries), tokens=new) for _ in wave]


def make_cb_manager(model: Any, args: argparse.Namespace, concurrency: int, prompts: list) -> Any:
    """A started manager: greedy, EOS off, at most `concurrency` requests per batch."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = ContinuousBatchingConfig(max_requests_per_batch=concurrency)
    if args.cb_num_blocks is None:  # NOTE: headroom for the scheduler's safety margin
        fitted = fitted_blocks(prompts, args.max_new_tokens, config.page_size, concurrency)
        margin = CB_SAFETY_MARGIN if config.safety_margin is None else config.safety_margin
        config.num_blocks = math.ceil(fitted / (1 - margin))
    elif args.cb_num_blocks > 0:
        config.num_blocks = args.cb_num_blocks
    if args.cb_max_batch_tokens:
        config.max_batch_tokens = args.cb_max_batch_tokens
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=-1,
        pad_token_id=model.generation_config.pad_token_id,
    )
    manager = model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=config
    )
    manager.warmup()
    manager.start()
    return manager


def run_cb(manager: Any, wave: list[list[int]], max_new: int, tag: str) -> list[Trace]:
    """Add the wave, wait for every result; token times come from the manager's own stamps."""
    submitted = time.perf_counter()
    ids = [
        manager.add_request(
            p,
            request_id=f"{tag}-{i}",
            max_new_tokens=max_new,
            record_timestamps=True,
            eos_token_id=-1,
        )
        for i, p in enumerate(wave)
    ]
    results: dict[str, Any] = {}
    deadline = time.monotonic() + 600
    while len(results) < len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            results[out.request_id] = out
        elif out is None and not manager.is_running():
            break
    traces = []
    for request_id in ids:
        out = results.get(request_id)
        trace = Trace(submitted)
        if out is None:
            trace.error = "no result"
        else:
            trace.tokens, trace.error = len(out.generated_tokens), out.error
            trace.deliveries = [(t, 1) for t in out.timestamps or []]
        traces.append(trace)
    return traces


def make_engine(model: Any, tokenizer: Any, args: argparse.Namespace) -> Any:
    """The engine with those of `args`' engine settings its constructor accepts (before and after
    the paged-KV rewrite); settings left as None keep the engine's defaults."""
    from workers.engine import Engine

    accepted = inspect.signature(Engine.__init__).parameters
    wanted = {"max_num_seqs": args.max_num_seqs}
    wanted.update({name: getattr(args, name, None) for name in ENGINE_KWARGS})
    kwargs = {k: v for k, v in wanted.items() if v is not None and k in accepted}
    return Engine(model, tokenizer, **kwargs)


def bench_grammar(engine: Any, tokenizer: Any) -> Any:
    """Row (f)'s compiled grammar (compiled once: the cost measured is the per-step mask)."""
    from workers.grammar import GrammarCompiler, grammar_source
    from workers.output_spec import ResponseFormat

    compiler = GrammarCompiler(tokenizer, engine.vocab_size, engine.stop_ctx.eos_token_ids)
    fmt = ResponseFormat("json_schema", BENCH_SCHEMA, "bench")
    return compiler.build(grammar_source(fmt, None))


def run_engine(
    engine: Any, wave: list[list[int]], max_new: int, tag: str, grammar: Any = None
) -> list[Trace]:
    """Add the wave and step until done; text events carry `tokens`, finish events the count."""
    from workers.request import EngineRequest

    try:
        from workers.sampling_params import SamplingParams
    except ImportError:  # a --compare tree from before the module's rename
        from workers.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    submitted = time.perf_counter()
    traces = {f"{tag}-{i}": Trace(submitted) for i in range(len(wave))}
    for (request_id, _), prompt in zip(traces.items(), wave, strict=True):
        constraint = () if grammar is None else (grammar,)  # an older tree has no grammar field
        engine.add_request(EngineRequest(request_id, prompt, params, *constraint))
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            trace = traces[out.request_id]
            for line in out.events:
                # the engine's typed lines (or, in an older tree, their dicts)
                event = line.wire() if hasattr(line, "wire") else line
                if event["type"] == "text" and event["tokens"]:
                    trace.deliveries.append((now, event["tokens"]))
                elif event["type"] == "finish":
                    trace.tokens += event["completion_tokens"]
                elif event["type"] == "error":
                    trace.error = event["code"]
    return list(traces.values())


# -- one cell: a row in one dtype, every concurrency -----------------------------------------------


def fitted_blocks(prompts: list[list[int]], max_new: int, block: int, concurrency: int) -> int:
    """KV blocks for `concurrency` of the longest request: the workload fits, nothing spare."""
    return concurrency * math.ceil((max(map(len, prompts)) + max_new) / block)


def engine_settings(args: argparse.Namespace, concurrency: int, prompts: list) -> dict[str, Any]:
    """max_num_seqs = the concurrency; the KV cache sized to the workload unless told otherwise
    (`--num-kv-blocks 0`: the engine's own default sizing)."""
    from workers.engine import Engine

    settings = {name: getattr(args, name) for name in ENGINE_KWARGS}
    settings["max_num_seqs"] = concurrency
    if settings["num_kv_blocks"] is None:
        default_block = inspect.signature(Engine.__init__).parameters.get("block_size")
        block = args.block_size or getattr(default_block, "default", None)
        if isinstance(block, int):
            settings["num_kv_blocks"] = fitted_blocks(
                prompts, args.max_new_tokens, block, concurrency
            )
    elif settings["num_kv_blocks"] == 0:
        settings["num_kv_blocks"] = None
    return settings


def open_row(row: str, model: Any, tokenizer: Any, args: argparse.Namespace, c: int, prompts):
    """(run one wave, close, settings used) for this row at concurrency c."""
    if row in ("a", "b"):
        return (lambda wave, tag, n: run_generate(model, tokenizer, wave, n)), lambda: None, {}
    if row == "c":
        manager = make_cb_manager(model, args, c, prompts)
        cfg = manager.continuous_batching_config
        settings = {k: getattr(cfg, k) for k in ("num_blocks", "page_size", "max_batch_tokens")}
        settings.update(max_requests_per_batch=c, attn=model.config._attn_implementation)

        def close() -> None:
            manager.stop(block=True, timeout=30)

        return (lambda wave, tag, n: run_cb(manager, wave, n, tag)), close, settings
    settings = engine_settings(args, c, prompts)
    engine = make_engine(model, tokenizer, argparse.Namespace(**settings))
    accepted = inspect.signature(type(engine).__init__).parameters
    used = {k: v for k, v in settings.items() if v is not None and k in accepted}
    grammar = bench_grammar(engine, tokenizer) if row == "f" else None
    return (lambda wave, tag, n: run_engine(engine, wave, n, tag, grammar)), lambda: None, used


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


def run_cell(args: argparse.Namespace) -> None:
    """Child process: load the model, run the row at each concurrency, print one line each."""
    import torch

    from workers.model_loader import load_model, resolve_model_path

    row = args.cell
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(resolve_model_path(args.model), args.device, args.dtype)
    if row in ("a", "b"):  # NOTE: like ignore_eos: EOS is generated as a token, nothing stops
        model.generation_config.eos_token_id = None
    for c in args.concurrency:
        if (row == "a" and c != 1) or (row == "b" and c == 1 and "a" in args.rows):
            continue  # (a) is one at a time; (b) at c=1 is (a) again
        count = math.ceil(max(c, args.requests) / c) * c
        prompts = build_prompts(tokenizer, count + min(c, 2))
        prompts, warmup = prompts[:count], prompts[count:]  # warm-up prompts are not reused
        reset_peak_rss()
        run, close, settings = open_row(row, model, tokenizer, args, c, prompts + warmup)
        try:
            run(warmup, "warmup", 4)
            traces, started = [], time.perf_counter()
            for w, wave in enumerate(make_waves(prompts, 1 if row == "a" else c)):
                traces.extend(run(wave, f"c{c}w{w}", args.max_new_tokens))
            wall = time.perf_counter() - started
        finally:
            close()
        result = summarize(traces, wall, args.max_new_tokens)
        result.update(row=row, concurrency=c, dtype=args.dtype, wall_s=wall, settings=settings)
        result["rss_mib"] = peak_rss_mib()
        result["prompt_tokens"] = [min(map(len, prompts)), max(map(len, prompts))]
        result["threads"] = torch.get_num_threads()
        print(CELL_MARK + json.dumps(result, default=str), flush=True)


# -- the parent: spawn cells, print tables ---------------------------------------------------------


def matmul_gflops(dtype_name: str, size: int = 1024, repeats: int = 10) -> float:
    """Best of `repeats` timings of a size^3 matmul (3 back to back) in this process's threads."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.matmul(a, b)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(3):
            torch.matmul(a, b)
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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cell", row, "--dtype", dtype]
    cmd += ["--rows", ",".join(args.rows), "--concurrency", ",".join(map(str, args.concurrency))]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--requests", str(args.requests)]
    cmd += ["--device", args.device]
    for name in ("model", "threads", "cb_num_blocks", "cb_max_batch_tokens", *ENGINE_KWARGS):
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    if row == "e":
        env["SLUICE_BENCH_TREE"] = str(Path(args.compare).resolve())
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CELL_MARK)]
    results = [json.loads(ln[len(CELL_MARK) :]) for ln in lines]
    took = time.perf_counter() - started
    print(f"  ({row}) {ROWS[row]}, {dtype}: {took:.0f} s", file=sys.stderr, flush=True)
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


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def _line(label: str, res: dict[str, Any], gflops: float) -> str:
    peak = GFLOP_PER_TOKEN * res["tok_s"] / gflops * 100
    check = f"{res['counts']} ok" if res["counts_ok"] else f"MISMATCH {res['counts']}"
    if res["errors"]:
        check += f" errors {res['errors']}"
    return (
        f"{label:<28}{res['concurrency']:>4}{res['requests']:>6}{res['tok_s']:>9.1f}"
        f"{_fmt(res['ttft_p50']):>10}{_fmt(res['ttft_p99']):>8}"
        f"{_fmt(res['itl_p50'], '.1f'):>9}{_fmt(res['itl_p99'], '.1f'):>8}"
        f"{peak:>6.1f}%{res['rss_mib']:>9.0f}  {check}"
    )


def print_tables(args: argparse.Namespace, runs: list[CellRun], gflops: dict[str, float]) -> None:
    head = (
        f"{'row':<28}{'c':>4}{'reqs':>6}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}"
        f"{'ITL p50':>9}{'p99':>8}{'%peak':>7}{'RSS MiB':>9}  tokens/request"
    )
    for dtype in args.dtype:
        mine = [r for r in runs if r.dtype == dtype]
        print(
            f"\n== {dtype} | {args.max_new_tokens} new tokens/request, greedy | matmul "
            f"{gflops[dtype]:.1f} GFLOP/s | times in ms =="
        )
        print(head)
        for run in mine:
            label = f"({run.row}) {ROWS[run.row]}"
            for res in run.results:
                print(_line(label, res, gflops[dtype]))
            if run.failure:
                print(f"{label:<28} FAILED {run.failure}")
        if "a" in args.rows and "b" in args.rows and 1 in args.concurrency:
            print("(b) at c=1 is (a): not run twice")
        for run in mine:
            if run.results and run.row in "cdef":
                last = run.results[-1]
                shown = " ".join(f"{k}={v}" for k, v in last["settings"].items())
                print(f"({run.row}) settings at c={last['concurrency']}: {shown}")
        print_ratios(args, mine)


def print_ratios(args: argparse.Namespace, runs: list[CellRun]) -> None:
    by = {(r.row, res["concurrency"]): res["tok_s"] for r in runs for res in r.results}
    cols = args.concurrency
    print(f"\n{'tok/s ratio':<32}" + "".join(f"{'c=' + str(c):>9}" for c in cols))
    base = by.get(("a", 1))
    lines = {
        "engine / transformers CB": [(by.get(("d", c)), by.get(("c", c))) for c in cols],
        "engine / generate (a, c=1)": [(by.get(("d", c)), base) for c in cols],
        "engine / engine of --compare": [(by.get(("d", c)), by.get(("e", c))) for c in cols],
        "JSON schema / free (f / d)": [(by.get(("f", c)), by.get(("d", c))) for c in cols],
        "transformers CB / generate (a)": [(by.get(("c", c)), base) for c in cols],
    }
    for name, pairs in lines.items():
        cells = [f"{n / d:>8.2f}x" if n and d else f"{'n/a':>9}" for n, d in pairs]
        print(f"{name:<32}" + "".join(cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="c=1,8; 16 tokens; bfloat16; 1 request")
    p.add_argument("--rows", default="a,b,c,d", help="which rows: a,b,c,d,f")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--dtype", default="bfloat16,float32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=4, help="at least this many per concurrency")
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write every cell's results to this file")
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
    if args.compare and args.cell is None and "e" not in args.rows:
        args.rows.append("e")
    if set(args.rows) - set(ROWS):
        p.error(f"unknown rows {sorted(set(args.rows) - set(ROWS))}; pick from a,b,c,d,e,f")
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
    gflops = {dtype: matmul_gflops(dtype) for dtype in args.dtype}
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
