"""The model flags the device benchmarks share (`--model`, `--device`, `--dtype`), and the load."""

from __future__ import annotations

import argparse
from typing import Any


def add_model_arguments(p: argparse.ArgumentParser, device: str, dtype: str) -> None:
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M)")
    p.add_argument("--device", default=device)
    p.add_argument("--dtype", default=dtype)


def load_model_of(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) as the flags say."""
    from workers.model_loader import load_model, resolve_model_path

    return load_model(resolve_model_path(args.model), args.device, args.dtype)
