"""One short chunk's attention over its sequence's paged blocks, in the engine's three forms,
side by side: the CPU kernel over the blocks in place (`span_attention`, each query read to its
own length), one causal SDPA call over the chunk's gathered context (a long chunk's form), and
the padded, masked SDPA group (the short chunks' form without the kernel).

The engine sends a chunk of up to `KERNEL_SPAN` tokens (draft verifications, prompt tails) to
the kernel and longer ones to the per-chunk SDPA (workers/model_runner.py); the crossover was
read off this table. Each cell is `--layers` layers of the default model's heads (3 KV heads,
3 query heads each, 64 wide), one cache per layer so the context is read from memory, the best
of `--repeats`, in ms.

    .venv/bin/python bench/span_attention.py --new 4,8,16,32 --done 160,480
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from packed_gemm import best_of  # noqa: E402

from workers import decode_kernel  # noqa: E402
from workers.attention import (  # noqa: E402
    PrefillSpan,
    _group_attention,
    _prefill_attention,
    _spans_by_kernel,
)
from workers.model_runner import kernel_spans, span_group  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16
CPU = torch.device("cpu")


def forms(new: int, done: int, dtype: torch.dtype, caches: list) -> dict:
    """The three forms of one chunk of `new` tokens after `done`, each a pass over the layers."""
    context = done + new
    table = list(range(3, 3 + -(-context // BLOCK)))
    seq = SimpleNamespace(num_computed_tokens=done, block_table=table)
    q = torch.randn(1, KV_HEADS * GROUP, new, HEAD_DIM, dtype=dtype)
    fresh = torch.randn(1, KV_HEADS, new, HEAD_DIM, dtype=dtype)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
    visible = torch.arange(context).unsqueeze(0) <= torch.arange(done, context).unsqueeze(1)
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    span = PrefillSpan(0, new, slots, bias.view(1, 1, new, context))
    group = span_group([(seq, 0, new)], BLOCK, GROUP, CPU, dtype)
    spans = kernel_spans([(seq, 0, new)], BLOCK, CPU)
    scale = HEAD_DIM**-0.5
    out = {}
    if decode_kernel.available():
        out["kernel"] = lambda: [_spans_by_kernel(spans, k, v, q, BLOCK, scale) for k, v in caches]
    out["chunk SDPA"] = lambda: [
        _prefill_attention(span, k, v, q, fresh, fresh, scale) for k, v in caches
    ]
    out["padded group"] = lambda: [
        _group_attention(group, k, v, q, BLOCK, scale) for k, v in caches
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--new", default="4,8,16,32", help="the chunk's tokens")
    p.add_argument("--done", default="160,480", help="positions already in the cache")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(
        f"span_attention: torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.layers} layers; ms per pass, best of {args.repeats}; x: over the padded group"
    )
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        blocks = 3 + -(-(max(map(int, args.done.split(","))) + 64) // BLOCK) + 1
        shape = (KV_HEADS, blocks * BLOCK, HEAD_DIM)
        caches = [
            (torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
            for _ in range(args.layers)
        ]
        header = None
        for new in map(int, args.new.split(",")):
            for done in map(int, args.done.split(",")):
                cells = forms(new, done, dtype, caches)
                if header is None:
                    header = f"{'dtype':<9} {'new':>4} {'done':>5}  " + "  ".join(
                        f"{name:>16}" for name in cells
                    )
                    print(header)
                times = {name: 1000 * best_of(f, args.repeats) for name, f in cells.items()}
                base = times["padded group"]
                row = "  ".join(f"{t:7.2f} ms {base / t:5.2f}x" for t in times.values())
                print(f"{dtype_name:<9} {new:>4} {done:>5}  {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
