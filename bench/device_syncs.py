"""Where the engine makes the host wait for the GPU: every synchronizing CUDA call, by call site.

A wave of `--concurrency` greedy requests runs through the engine (mixed prompts, so prefill
chunks meet running decodes) under `torch.cuda.set_sync_debug_mode("warn")`: PyTorch then warns
at each call that synchronizes the device (a copy to the host, `.item()`, a copy from pageable
memory, `nonzero`). Each warning is charged to the line that made it. The sampled tokens' copy
to the host is the one sync a step needs (the stream must see the tokens); anything else is
waiting the step could do without.

    python bench/device_syncs.py --model PATH --dtype bfloat16 --concurrency 32
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from engine_drive import drive  # noqa: E402
from engine_workload import Arrival, mixed_prompts  # noqa: E402

SYNC_WARNING = "synchronizing CUDA operation"


class StepCounter:
    """Counts `Engine.step` calls (a step is the unit the syncs are read against)."""

    def __init__(self, engine) -> None:
        self.steps = 0
        step = engine.step

        def counted() -> list:
            self.steps += 1
            return step()

        engine.step = counted


def sync_sites(caught: list[warnings.WarningMessage]) -> Counter:
    """Synchronizing calls by `file:line` of the Python line that made them."""
    sites: Counter = Counter()
    for w in caught:
        if SYNC_WARNING in str(w.message):
            sites[f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"] += 1
    return sites


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()
    import torch

    from workers.engine import Engine
    from workers.model_loader import load_model, resolve_model_path

    if not torch.cuda.is_available():
        sys.exit("device_syncs: needs a CUDA device (it counts CUDA synchronizations)")
    model, tokenizer = load_model(resolve_model_path(args.model), "cuda", args.dtype)
    prompts = mixed_prompts(tokenizer, args.concurrency + 2)
    engine = Engine(model, tokenizer, max_num_seqs=args.concurrency)
    drive(engine, [Arrival(0.0, q) for q in prompts[-2:]], 4, "warmup")
    counter = StepCounter(engine)
    arrivals = [Arrival(0.0, q) for q in prompts[: args.concurrency]]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            traces = drive(engine, arrivals, args.max_new_tokens, "run")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    tokens = sum(t.tokens for t in traces)
    sites = sync_sites(caught)
    steps = max(counter.steps, 1)
    print(
        f"device_syncs: {args.concurrency} requests, {tokens} tokens, {counter.steps} steps, "
        f"{sum(sites.values())} synchronizing calls ({sum(sites.values()) / steps:.2f} per step)"
    )
    print(f"| {'call site':<48} | calls | per step |")
    print(f"|{'-' * 50}|-------|----------|")
    for site, n in sites.most_common():
        print(f"| {site:<48} | {n:5d} | {n / steps:8.2f} |")


if __name__ == "__main__":
    main()
