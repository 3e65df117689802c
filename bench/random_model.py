"""A model folder with random weights, for benchmarks where only the shapes matter.

A machine that cannot receive the default model's weights (a GPU machine reached through a
small transfer, say) can still measure the engine: with `ignore_eos` every request generates
exactly its token count whatever the weights say, so throughput, latency and memory depend on
the architecture's shapes alone. The folder takes its config and tokenizer from `--like`, with
`--set key=value` changing config fields (a larger model of the same family), and its weights
from the architecture's own initialisation.

    python bench/random_model.py --like ~/.cache/sluicegate/models/<digest> --out /tmp/m135
    python bench/random_model.py --like ... --out /tmp/m1.7b --set hidden_size=2048 \\
        --set intermediate_size=8192 --set num_hidden_layers=24 \\
        --set num_attention_heads=32 --set num_key_value_heads=32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_setting(text: str) -> tuple[str, object]:
    """`key=value`, the value read as JSON where it parses (numbers, booleans), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", required=True, help="a model folder: its config and tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--set", type=parse_setting, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="where the weights are initialised")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(args.like)
    for key, value in args.set:
        if not hasattr(config, key):
            p.error(f"the config has no field {key!r}")
        setattr(config, key, value)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    out = Path(args.out)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(args.like).save_pretrained(out)
    params = sum(t.numel() for t in model.parameters())
    print(f"random_model: {params / 1e6:.0f}M parameters, {args.dtype}, saved to {out}")


if __name__ == "__main__":
    main()
