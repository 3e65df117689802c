"""The engine's greedy tokens on a device against `model.generate`, prompt by prompt.

The tests hold the engine to `generate` on a CPU. On a GPU the same comparison runs here: the
engine takes every prompt in one batch (prefill and decode rows, the paged cache; on CUDA its
decode-only steps replay CUDA graphs, workers/decode_graphs.py), `generate` one prompt at a
time. In float32 the two should agree token for token; where they part (two logits within
rounding of each other, summed in another order by another kernel), the table shows where.

    python bench/device_greedy.py --model PATH --device cuda --dtype float32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from engine_workload import mixed_prompts  # noqa: E402
from model_args import add_model_arguments, load_model_of  # noqa: E402


def engine_tokens(engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Every prompt submitted at once, greedy; each request's generated token ids."""
    from wire.sampling_params import SamplingParams
    from workers.request import EngineRequest

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    from wire.api import TextLine

    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", ids, params))
        tokens[f"r{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            for line in out.events:
                if isinstance(line, TextLine):
                    tokens[out.request_id] += line.token_ids
    return list(tokens.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, device="cuda", dtype="float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args()
    import torch

    from workers.engine import Engine

    model, tokenizer = load_model_of(args)
    prompts = mixed_prompts(tokenizer, args.prompts)
    expected = []
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=model.device),
                do_sample=False,
                max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens,
            )
        expected.append(out[0, len(ids) :].tolist())
    engine = Engine(model, tokenizer, max_num_seqs=len(prompts))
    got = engine_tokens(engine, prompts, args.max_new_tokens)
    same = 0
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        parted = next((k for k, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), None)
        same += parted is None and len(want) == len(have)
        where = "identical" if parted is None else f"parts at token {parted}"
        print(f"  prompt {i} ({len(prompts[i])} tokens): {where}")
    print(f"device_greedy: {same} of {len(prompts)} identical to generate ({args.dtype})")
    graphs = getattr(engine.runner, "graphs", None)  # decode-only steps (decode_graphs.py)
    if graphs is not None:
        print(f"  decode graphs: {graphs.graph_count} captured, {graphs.replays} steps run")


if __name__ == "__main__":
    main()
