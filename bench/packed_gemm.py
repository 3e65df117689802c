"""One decode step's GEMMs, the BLAS's against oneDNN's packed weights, side by side (CPU).

The engine packs its linear layers where this pays (workers/packed_linear.py); which CPUs those
are was read off this table. Shapes are a model's fused projections (q/k/v, o, gate/up, down)
times its layers, plus the output head, at a few batch sizes (rows); each cell is the best of
`--repeats` runs of the whole set.

    .venv/bin/python bench/packed_gemm.py --dtype float32,bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.model_loader import cpu_has_amx, cpu_has_native_bf16
from workers.packed_linear import PackedLinear

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, 30 layers, vocabulary 49152
HIDDEN, KV, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152
LAYER_SHAPES = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * MLP), (MLP, HIDDEN)]


def best_of(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm: oneDNN picks its kernel on the first call of a shape
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def step_gemms(dtype: torch.dtype, rows: int, repeats: int) -> tuple[float, float]:
    """Seconds of one step's GEMMs at `rows` rows: (BLAS, packed)."""
    shapes = [*LAYER_SHAPES, (HIDDEN, VOCAB)]
    linears = [nn.Linear(i, o, bias=False).to(dtype).requires_grad_(False) for i, o in shapes]
    packed = [PackedLinear(linear) for linear in linears]
    inputs = [torch.randn(rows, i, dtype=dtype) for i, _ in shapes]
    counts = [LAYERS] * len(LAYER_SHAPES) + [1]

    def blas() -> None:
        for linear, x, n in zip(linears, inputs, counts, strict=True):
            for _ in range(n):
                F.linear(x, linear.weight)

    def onednn() -> None:
        for layer, x, n in zip(packed, inputs, counts, strict=True):
            for _ in range(n):
                layer(x)

    with torch.no_grad():
        return best_of(blas, repeats), best_of(onednn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,32,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
        f"{torch.backends.cpu.get_cpu_capability()}, AMX {cpu_has_amx()}, native bf16 "
        f"{cpu_has_native_bf16()}; {LAYERS} layers x {len(LAYER_SHAPES)} GEMMs + the head"
    )
    print(f"{'dtype':<10}{'rows':>6}{'BLAS ms':>10}{'packed ms':>11}{'packed / BLAS':>15}")
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        for rows in map(int, args.rows.split(",")):
            blas, packed = step_gemms(dtype, rows, args.repeats)
            ratio = packed / blas
            print(f"{name:<10}{rows:>6}{blas * 1e3:>10.1f}{packed * 1e3:>11.1f}{ratio:>14.2f}x")


if __name__ == "__main__":
    main()
