"""One decode step's GEMMs in each weight layout the engine uses on CPU, side by side: the BLAS on
the weight as loaded (x @ W.T), the BLAS on the weight stored transposed (x @ W), oneDNN's
packed weights, and (float32, where torch carries MKL) MKL's packed weights.

The engine picks a layout per CPU and dtype (workers/packed_linear.py); which was read off this
table. Shapes are a model's fused projections (q/k/v, o, gate/up, down), one distinct weight per
layer, plus the output head, at a few batch sizes (rows); each cell is the best of `--repeats`
runs of the whole set. NOTE: distinct weights, because a step reads each layer's from memory; one
weight per shape, reused 30 times, stays in cache and flatters the small shapes.

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

from workers import mkl_sgemm
from workers.model_loader import cpu_has_amx, cpu_has_native_bf16
from workers.packed_linear import MklPackedLinear, PackedLinear, TransposedLinear

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, 30 layers, vocabulary 49152
HIDDEN, KV, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152
LAYER_SHAPES = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * MLP), (MLP, HIDDEN)]
LAYOUTS = ("BLAS", "transposed", "packed", "mkl")


def best_of(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm: oneDNN picks its kernel on the first call of a shape
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def step_linears(dtype: torch.dtype) -> list[nn.Linear]:
    """A step's linear layers in the order it runs them: each layer's four, then the head."""
    shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES] + [(HIDDEN, VOCAB)]
    return [nn.Linear(i, o, bias=False).to(dtype).requires_grad_(False) for i, o in shapes]


def step_gemms(dtype: torch.dtype, rows_list: list[int], repeats: int) -> dict:
    """Seconds of one step's GEMMs at each row count, per layout: {(rows, layout): s}."""
    linears = step_linears(dtype)
    layouts = {
        "BLAS": [lambda x, w=linear.weight: F.linear(x, w) for linear in linears],
        "transposed": [TransposedLinear(linear) for linear in linears],
        "packed": [PackedLinear(linear) for linear in linears],
    }
    if dtype == torch.float32 and mkl_sgemm.available():
        layouts["mkl"] = [MklPackedLinear(linear) for linear in linears]
    out = {}
    with torch.no_grad():
        for rows in rows_list:
            inputs = {width: torch.randn(rows, width, dtype=dtype) for width in (HIDDEN, MLP)}
            xs = [inputs[linear.in_features] for linear in linears]
            for name in layouts:

                def run(calls=layouts[name], xs=xs) -> None:
                    for call, x in zip(calls, xs, strict=True):
                        call(x)

                out[rows, name] = best_of(run, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
        f"{torch.backends.cpu.get_cpu_capability()}, AMX {cpu_has_amx()}, native bf16 "
        f"{cpu_has_native_bf16()}; {LAYERS} layers x {len(LAYER_SHAPES)} GEMMs + the head"
    )
    head = f"{'dtype':<10}{'rows':>6}" + "".join(f"{name + ' ms':>14}" for name in LAYOUTS)
    print(head + "".join(f"{name + '/BLAS':>17}" for name in LAYOUTS[1:]))
    rows_list = [int(r) for r in args.rows.split(",")]
    for name in args.dtype.split(","):
        times = step_gemms(getattr(torch, name), rows_list, args.repeats)
        for rows in rows_list:
            blas = times[rows, "BLAS"]
            cells = ratios = ""
            for layout in LAYOUTS:
                took = times.get((rows, layout))
                cells += f"{'-':>14}" if took is None else f"{took * 1e3:>14.1f}"
                if layout != "BLAS":
                    ratios += f"{'-':>17}" if took is None else f"{took / blas:>16.2f}x"
            print(f"{name:<10}{rows:>6}{cells}{ratios}")


if __name__ == "__main__":
    main()
