"""Host work per decode step: the model's module forward against the engine's own Llama forward
(workers/llama_forward.py), side by side on one engine.

For each concurrency, a wave of requests (no drafts) is run until every one decodes; then the
two forwards take turns (`--rounds` turns of `--steps` steps each) on the same engine, and the
table gives, per step: the tensor ops called from Python (top-level aten ops, with and without
the views, which launch no kernel) and the wall time (median of the turns' medians), and their
ratio.

On a CPU with a real model most of a step is GEMMs, so the time barely moves; the op count is
what a GPU pays for in launches. A model with the same layer count and narrow widths makes the
step nearly all host work (what it is on a GPU), e.g. SmolLM2-135M's 30 layers at width 72:

    python bench/random_model.py --like ~/.cache/sluicegate/models/<digest> --out /tmp/narrow \\
        --set hidden_size=72 --set intermediate_size=96 --set head_dim=8
    python bench/step_ops.py --model /tmp/narrow --concurrency 1,64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from device_profile import decoding_engine  # noqa: E402
from model_args import add_model_arguments, load_model_of  # noqa: E402

# aten ops that only make a new view (or an empty tensor): no kernel, no arithmetic
_VIEW_NAMES = (
    "view as_strided reshape transpose permute select slice unsqueeze squeeze t expand split "
    "split_with_sizes _unsafe_view alias detach empty empty_strided narrow lift_fresh "
    "resolve_conj resolve_neg"
)
VIEWS = frozenset(f"aten::{name}" for name in _VIEW_NAMES.split(" "))


def count_ops(engine, steps: int) -> tuple[float, float]:
    """(top-level aten ops, of them not views) per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ops: Counter[bool] = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops[event.name in VIEWS] += 1
    return (ops[True] + ops[False]) / steps, ops[False] / steps


def step_ms(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def measure(engine, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    lean = engine.runner.lean
    if lean is None:
        sys.exit("step_ops: this model does not take the lean forward")
    ways = {"modules": None, "lean": lean}
    out = {name: {"ms": []} for name in ways}
    for name, forward in ways.items():
        engine.runner.lean = forward
        out[name]["ops"], out[name]["kernels"] = count_ops(engine, steps)
    for turn in range(rounds):
        order = list(ways.items()) if turn % 2 == 0 else list(reversed(ways.items()))
        for name, forward in order:
            engine.runner.lean = forward
            out[name]["ms"].append(step_ms(engine, steps))
    engine.runner.lean = lean
    for row in out.values():
        row["ms"] = statistics.median(row["ms"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, device="cpu", dtype="float32")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    model, tokenizer = load_model_of(args)
    print(f"{args.model or 'SmolLM2-135M'}, {args.dtype} on {args.device}, per decode step")
    print(f"{'c':>3} {'forward':<8} | {'ops':>6} {'non-view':>9} | {'ms':>8} | lean/modules")
    for c in (int(x) for x in args.concurrency.split(",")):
        max_new = (2 + 2 * args.rounds) * args.steps + 50
        # NOTE: no drafts: every step is then the same one-token decode, whichever forward runs
        engine = decoding_engine(model, tokenizer, c, max_new, speculative="off")
        rows = measure(engine, args.steps, args.rounds)
        for name, row in rows.items():
            ratio = ""
            if name == "lean":
                base = rows["modules"]
                ops, ms = row["kernels"] / base["kernels"], row["ms"] / base["ms"]
                ratio = f"non-view ops {ops:.2f}, ms {ms:.2f}"
            print(
                f"{c:>3} {name:<8} | {row['ops']:>6.0f} {row['kernels']:>9.0f} | "
                f"{row['ms']:>8.2f} | {ratio}"
            )


if __name__ == "__main__":
    main()
