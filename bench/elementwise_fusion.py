"""Whether `torch.compile` pays for the engine's element-wise chains on a device: each chain of
the lean Llama pass (workers/llama_forward.py: the RMSNorm, rotary on q and k, SiLU times up),
eager against compiled, at a decode step's shapes, per call in µs, and their ratio.

On a CPU each call is timed as the engine makes it. On CUDA a decode step is replayed as a
graph (workers/decode_graphs.py), where launches cost nothing and what a fused kernel can save is
the GPU's own time: each chain is captured `--calls` times into one CUDA graph, eager and
compiled, and the graph's replay is timed. The inputs are contiguous where the engine's are
views of one fused projection's output: a small difference in what a kernel reads.

    python bench/elementwise_fusion.py --device cpu --dtype bfloat16,float32
    python bench/elementwise_fusion.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.llama_forward import _rotate, llama_rms_norm  # noqa: E402

# SmolLM2-135M's widths: hidden 576, MLP 1536, 9 query + 3 key heads of 64
HIDDEN, INTERMEDIATE, QK_HEADS, HEAD_DIM = 576, 1536, 12, 64


def chains(tokens: int, dtype: torch.dtype, device: str) -> dict[str, tuple[Callable, tuple]]:
    """name -> (the chain as the lean pass runs it, its inputs at `tokens` tokens)."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    weight = randn(HIDDEN)
    cos, sin = randn(1, tokens, 1, HEAD_DIM), randn(1, tokens, 1, HEAD_DIM)
    return {
        "rms_norm": (
            lambda x: llama_rms_norm(x, (HIDDEN,), weight, 1e-5),
            (randn(1, tokens, HIDDEN),),
        ),
        "rotary": (lambda qk: _rotate(qk, cos, sin), (randn(1, tokens, QK_HEADS, HEAD_DIM),)),
        "silu_mul": (
            lambda g, u: F.silu(g).mul_(u),
            (randn(1, tokens, INTERMEDIATE), randn(1, tokens, INTERMEDIATE)),
        ),
    }


def per_call_us(fn: Callable, args: tuple, calls: int, device: str) -> float:
    """Host-timed µs per call (synchronised at the ends on a GPU)."""
    for _ in range(20):
        fn(*args)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def graph_call_us(fn: Callable, args: tuple, calls: int) -> float:
    """µs per call of `calls` calls captured in one CUDA graph, timed over its replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (10 * calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16,float32")
    parser.add_argument("--tokens", default="1,32,64", help="a decode step's rows")
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    graphed = args.device == "cuda"
    print(
        f"elementwise_fusion: torch {torch.__version__}, device {args.device}, "
        f"{torch.get_num_threads()} threads; µs per call, "
        f"{'inside a CUDA graph' if graphed else 'as the engine calls it'}"
    )
    print(f"{'dtype':<9} {'tokens':>6} {'chain':<9} {'eager':>8} {'compiled':>9} {'ratio':>6}")
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for chain, (fn, inputs) in chains(tokens, dtype, args.device).items():
                torch._dynamo.reset()  # the lambdas share code objects: one cache, a limit
                compiled = torch.compile(fn, dynamic=False)
                if graphed:
                    eager_us = graph_call_us(fn, inputs, args.calls)
                    fused_us = graph_call_us(compiled, inputs, args.calls)
                else:
                    eager_us = per_call_us(fn, inputs, args.calls, args.device)
                    fused_us = per_call_us(compiled, inputs, args.calls, args.device)
                print(
                    f"{name:<9} {tokens:>6} {chain:<9} {eager_us:>8.1f} {fused_us:>9.1f} "
                    f"{fused_us / eager_us:>5.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
