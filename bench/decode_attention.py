"""The decodes' attention over a step's persistent rows, in the engine's forms and in matmul form,
side by side.

On CPU the engine attends with its own kernel (workers/decode_kernel.py: one call a layer, each
row read to its own length, this step's K/V written into the rows and the paged cache by the
same call). Where that
kernel is not built, it attends each run of decode rows with one SDPA call over strided views of
the rows (workers/attention._decode_attention; each run read only as far as its longest row),
the form every other column is measured against. The other form is two batched matmuls around a
float32 softmax: `k @ qᵀ` (bfloat16: the long side as M) or
`q @ kᵀ` (float32), then `p @ v`. Each form runs as one call a layer and as the engine's runs of
rows (equal splits). Rows are cold as in a step: one tensor per layer of `--layers`, every layer
visited once per measured pass, so nothing stays in cache from the pass before. Every row holds
`--reach` positions of a capacity with the engine's headroom. Times are ms per pass (all layers),
the best of `--repeats`; `x` is SDPA in `--runs` runs over the column's form.

    .venv/bin/python bench/decode_attention.py --dtype bfloat16,float32 --rows 32,64

NOTE: in bfloat16 oneDNN's batched matmul copies a strided operand to a contiguous one first;
`--profile` prints the copies' share of the matmul form's time.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from packed_gemm import best_of  # noqa: E402

from workers import decode_kernel  # noqa: E402
from workers.attention import _decode_attention  # noqa: E402
from workers.config import WorkerConfig  # noqa: E402
from workers.decode_rows import capacity_for  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2-135M: 9 query heads over 3 KV heads of 64
BLOCK_SIZE = WorkerConfig().block_size  # the worker's default
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return _decode_attention(q, k, v, bias, HEAD_DIM**-0.5)


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The engine's CPU kernel: every row read to `reach`, its last position written first, and
    a cache slot each (a decode's new K/V; here the query's first head stands in for it)."""
    count, reach = q.shape[0], k.shape[2]
    rows, lengths = torch.arange(count), torch.full((count,), reach)
    new = q[:, :, 0]
    cache = new.new_empty(k.shape[1], count, HEAD_DIM)  # [KV, slots, D]
    return decode_kernel.decode_attention(
        q, (k, v), (new, new), rows, lengths, (cache, cache), rows, HEAD_DIM**-0.5
    )


def matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d + bias) v as two batched matmuls, the softmax in float32."""
    if q.dtype == torch.float32:
        scores = torch.matmul(q, k.transpose(-1, -2))
    else:  # the long side (reach) as the matmul's M
        scores = torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2)
    weights = scores.float().mul_(HEAD_DIM**-0.5).add_(bias).softmax(-1).to(v.dtype)
    return torch.matmul(weights, v)


class Rows:
    """`layers` layers of `rows` decode rows, each holding `reach` positions."""

    def __init__(self, layers: int, rows: int, reach: int, dtype: torch.dtype) -> None:
        capacity = capacity_for(reach, BLOCK_SIZE)
        shape = (layers, rows, KV_HEADS, capacity, HEAD_DIM)
        self.keys = torch.randn(shape, dtype=dtype)
        self.values = torch.randn(shape, dtype=dtype)
        self.query = torch.randn(rows, KV_HEADS, GROUP, HEAD_DIM, dtype=dtype)
        self.bias = torch.zeros(rows, 1, 1, reach, dtype=dtype)
        self.reach = reach

    def pass_of(self, attention: Attention, runs: int) -> Callable[[], None]:
        return lambda: self.attend(attention, runs)

    def attend(self, attention: Attention, runs: int) -> None:
        """One pass: every layer's rows, in `runs` calls a layer."""
        rows, reach = self.query.shape[0], self.reach
        bounds = [rows * i // runs for i in range(runs + 1)]
        for layer in range(self.keys.shape[0]):
            keys, values = self.keys[layer], self.values[layer]
            for a, b in pairwise(bounds):
                attention(
                    self.query[a:b],
                    keys[a:b, :, :reach],
                    values[a:b, :, :reach],
                    self.bias[a:b],
                )


def copy_share(rows: Rows, runs: int) -> float:
    """The share of the matmul form's profiled time spent in `aten::copy_`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rows.attend(matmuls, runs)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    copies = sum(e.self_cpu_time_total for e in events if e.key == "aten::copy_")
    return copies / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16,float32")
    p.add_argument("--rows", default="32,64", help="decode rows in the step")
    p.add_argument("--reach", type=int, default=160, help="positions each row holds")
    p.add_argument("--runs", type=int, default=4, help="the engine's runs of rows")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="the copies' share, matmul form")
    args = p.parse_args(argv)
    print(
        f"decode_attention: torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.layers} layers, reach {args.reach}; ms per pass, best of {args.repeats}"
    )
    forms = [
        (f"sdpa, {args.runs} runs", sdpa, args.runs),
        *([("kernel, 1 call", kernel, 1)] if decode_kernel.available() else []),
        ("sdpa, 1 call", sdpa, 1),
        (f"matmuls, {args.runs} runs", matmuls, args.runs),
        ("matmuls, 1 call", matmuls, 1),
    ]
    print(f"{'dtype':<9} {'rows':>4}  " + "  ".join(f"{name:>18}" for name, _, _ in forms))
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for count in (int(r) for r in args.rows.split(",")):
            rows = Rows(args.layers, count, args.reach, dtype)
            times = [1000 * best_of(rows.pass_of(f, r), args.repeats) for _, f, r in forms]
            cells = [f"{t:8.1f} ms {times[0] / t:5.2f}x" for t in times]
            print(f"{dtype_name:<9} {count:>4}  " + "  ".join(f"{c:>18}" for c in cells))
            if args.profile:
                share = copy_share(rows, 1)
                print(f"{'':<15}matmuls, 1 call: aten::copy_ {100 * share:.0f}% of the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
