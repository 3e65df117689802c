"""Per-step trace of the engine under the Poisson workload: which steps make the ITL tail.

Runs row (d) (or (d-fixed) with `--step-time-target 0`) of engine_throughput.py's Poisson plan
in this process and records, for every step: its decodes (and how many of them joined the decode
batch this step, which copies their past into the decode rows), prefill tokens, draft tokens, the
KV context its sequences attend over, preemptions, the step-time fit's predicted seconds against
the measured ones, the thread's CPU seconds, and garbage collections inside it.
Each token delivery's gap (as engine_stats.py counts ITL) is charged to the step that ended it;
the summary compares the steps behind the top 1% of gaps with all steps. With `--embed`, row (g)'s
retrieval client keeps embedding inputs queued beside the streams (their chunks are counted
apart from prefill), and the summary splits the steps by whether they carried one.

    .venv/bin/python bench/engine_steps.py --rate 2 --requests 48 --concurrency 16 \
        --dtype bfloat16 --cancel-fraction 0.2 --deadline-fraction 0.1 --deadline-ms 3000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TREE = Path(os.environ.get("SLUICE_BENCH_TREE", ROOT))
if str(TREE) not in sys.path:
    sys.path.insert(0, str(TREE))

from engine_drive import EMBED_TOKENS, Embedded, drive  # noqa: E402
from engine_rows import engine_settings, make_engine  # noqa: E402
from engine_stats import percentile  # noqa: E402
from engine_workload import (  # noqa: E402
    Arrival,
    document_prompt,
    mixed_prompts,
    plan,
    warmup_size,
)


@dataclass(slots=True)
class Step:
    decodes: int = 0
    prefill: int = 0
    embedding: int = 0  # tokens of embedding inputs' chunks (--embed)
    joins: int = 0  # decodes that did not decode the step before (copied into the decode rows)
    drafts: int = 0
    context: int = 0  # tokens already in the KV cache of the step's sequences
    preempted: int = 0
    predicted: float | None = None  # the fit's seconds for the step's tokens, before it ran
    decodes_predicted: float | None = None  # the fit's seconds for its decodes alone
    measured: float = 0.0  # seconds as the step budget measured them
    wall: float = 0.0  # Engine.step() as a whole
    cpu: float = 0.0  # this thread's CPU seconds in it: with --threads 1, the step's own work
    gc_s: float = 0.0
    gaps: list[float] = field(default_factory=list)  # per-token ITL gaps this step ended


class Tracer:
    """Wraps one engine's schedule, speculator and step to fill a `Step` per step."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.steps, self.cur = engine, [], Step()
        self.last: dict[str, float] = {}
        self._decoding: set[int] = set()  # id() of the sequences that decoded the step before
        self._gc_started = 0.0
        sched, spec = engine.scheduler, engine.speculator
        schedule, extend, step = sched.schedule, spec.extend, engine.step

        def traced_schedule() -> Any:
            out = schedule()
            decoding = set()
            for seq, new in out.work:
                self.cur.context += seq.num_computed_tokens
                if seq.embedding is not None:
                    self.cur.embedding += new
                elif new == 1 and seq.num_computed_tokens > 0:
                    self.cur.decodes += 1
                    self.cur.joins += id(seq) not in self._decoding
                    decoding.add(id(seq))
                else:
                    self.cur.prefill += new
            self.cur.preempted = len(out.preempted)
            self._decoding = decoding
            return out

        def traced_extend(work: list, scheduler: Any, spare: int) -> int:
            before = sum(n for _, n in work)
            drafted = extend(work, scheduler, spare)
            self.cur.drafts = sum(n for _, n in work) - before
            budget = sched.step_budget
            if budget is not None and work:
                self.cur.predicted = budget.model.predict(before + self.cur.drafts)
                if self.cur.decodes:
                    self.cur.decodes_predicted = budget.model.predict(self.cur.decodes)
            return drafted  # the engine tells the step budget (an older tree's returns None)

        def traced_step() -> list:
            started, cpu_started = time.perf_counter(), time.thread_time()
            outputs = step()
            now = time.perf_counter()
            self.cur.wall, self.cur.cpu = now - started, time.thread_time() - cpu_started
            for out in outputs:
                k = sum(
                    ev.wire()["tokens"]
                    for ev in out.events
                    if ev.wire()["type"] == "text" and ev.wire()["tokens"]
                )
                if k and out.request_id in self.last:
                    self.cur.gaps += [(now - self.last[out.request_id]) / k] * k
                if k:
                    self.last[out.request_id] = now
            self.steps.append(self.cur)
            self.cur = Step()
            if len(self.steps) % 100 == 0:
                print(f"  {len(self.steps)} steps, {len(engine.live.ids())} live", file=sys.stderr)
            return outputs

        if sched.step_budget is not None:
            ended = sched.step_budget.ended

            def traced_ended(tokens: int, *more: int) -> None:  # older trees: no decodes
                begun = sched.step_budget._started
                ended(tokens, *more)
                if begun is not None:
                    self.cur.measured = sched.step_budget.clock() - begun

            sched.step_budget.ended = traced_ended
        sched.schedule, spec.extend, engine.step = traced_schedule, traced_extend, traced_step
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.cur.gc_s += time.perf_counter() - self._gc_started


def _describe(steps: list[Step], label: str) -> str:
    n = len(steps) or 1

    def share(pred) -> str:
        return f"{100 * sum(bool(pred(s)) for s in steps) / n:.0f}%"

    def med(values: list[float]) -> str:
        m = percentile(values, 50)
        return "-" if m is None else f"{m:.1f}"

    errs = [1000 * (s.measured - s.predicted) for s in steps if s.predicted is not None]
    return (
        f"{label:>14}: {len(steps):4d} steps | wall ms p50 {med([1000 * s.wall for s in steps])}"
        f" | decodes p50 {med([s.decodes for s in steps])} | prefill>0 {share(lambda s: s.prefill)}"
        f" (tokens p50 {med([s.prefill for s in steps if s.prefill])})"
        f" | joins {share(lambda s: s.joins)} | drafts>0 {share(lambda s: s.drafts)}"
        f" | gc {share(lambda s: s.gc_s > 0)} | preempt {share(lambda s: s.preempted)}"
        f" | measured-predicted ms p50 {med(errs)}"
        f" | cpu ms p50 {med([1000 * s.cpu for s in steps])}"
    )


def analyse(steps: list[Step]) -> str:
    gaps = sorted(g for s in steps for g in s.gaps)
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    tail = [s for s in steps if s.gaps and max(s.gaps) >= p99]
    with_gaps = [s for s in steps if s.gaps]
    lines = [f"ITL p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms, p99/p50 {p99 / p50:.2f}"]
    lines += [_describe(with_gaps, "all steps"), _describe(tail, "p99 steps")]
    if any(s.embedding for s in steps):
        decode_only = [s for s in with_gaps if not s.embedding and not s.prefill]
        embedding = [s for s in with_gaps if s.embedding]
        lines += [_describe(decode_only, "decodes only"), _describe(embedding, "embedding")]
        chunk = percentile([s.embedding for s in embedding], 50)
        lines.append(f"  embedding tokens a step p50 {chunk}")
    charged = sum(len([g for g in s.gaps if g >= p99]) for s in tail) or 1
    for name, pred in (
        ("prefill", lambda s: s.prefill > 0),
        ("drafts", lambda s: s.drafts > 0),
        ("gc", lambda s: s.gc_s > 0),
        ("a sequence joining the decodes", lambda s: s.joins > 0),
        ("wall>1.5x pred", lambda s: s.predicted and s.measured > 1.5 * s.predicted),
    ):
        n = sum(len([g for g in s.gaps if g >= p99]) for s in tail if pred(s))
        lines.append(f"  p99 gaps in steps with {name}: {100 * n / charged:.0f}%")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--deadline-fraction", type=float, default=0.1)
    p.add_argument("--deadline-ms", type=float, default=3000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-target", type=float, default=None, help="0: row d-fixed")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write every step here")
    p.add_argument("--cold", action="store_true", help="a two-prompt warm-up, not a burst of c")
    p.add_argument("--embed", action="store_true", help="row (g): embeddings beside the streams")
    args = p.parse_args()
    for name in ("num_kv_blocks", "block_size", "max_num_batched_tokens"):
        setattr(args, name, None)
    import torch

    from workers.model_loader import load_model, resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(resolve_model_path(args.model), args.device, args.dtype)
    warm, warm_tokens = warmup_size(args.concurrency, burst=not args.cold)
    prompts = mixed_prompts(tokenizer, args.requests + warm)
    prompts, warmup = prompts[: args.requests], prompts[args.requests :]
    row = "g" if args.embed else "d-fixed" if args.step_time_target == 0 else "d"
    engine, _ = make_engine(model, tokenizer, engine_settings(row, args, args.concurrency, prompts))
    embedded = None
    if args.embed:
        documents = [document_prompt(tokenizer, k)[:EMBED_TOKENS] for k in range(16)]
        embedded = Embedded(engine, documents, "embed")
    drive(engine, [Arrival(0.0, p) for p in warmup], warm_tokens, "warmup", None, embedded)
    tracer = Tracer(engine)
    drive(engine, plan(prompts, args, args.rate), args.max_new_tokens, "run", None, embedded)
    print(f"row {row}:", analyse(tracer.steps))
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(asdict(s)) for s in tracer.steps))


if __name__ == "__main__":
    main()
