"""Which grammar library drives the worker's constrained decoding: llguidance or xgrammar.

Measured on this machine's CPU, because that is where the worker computes masks (the mask is
built on the host whatever the model's device): compile time of a mid-size JSON schema, the
per-step mask computation for batch 1 and 32 while decoding a valid instance token by token, and
the cost of applying the masks to a [batch, vocab] logits tensor. The tokenizer is the default
model's (SmolLM2, 49152 tokens) when its converted folder is in the cache, else the tiny one.

Run it in a throwaway venv that has both libraries (neither is needed by the other):

    python3 -m venv /tmp/gram && /tmp/gram/bin/pip install torch==2.13.0 \
        && /tmp/gram/bin/pip install llguidance xgrammar transformers
    PYTHONPATH=. /tmp/gram/bin/python bench/grammar_choice.py [--tokenizer DIR] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["CH", "DE", "FR", "IT"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "name", "email", "active", "role", "address", "orders"],
    "additionalProperties": False,
}

INSTANCE = {
    "id": 42,
    "name": "Ada Lovelace",
    "email": "ada@example.com",
    "active": True,
    "score": 97.5,
    "role": "editor",
    "tags": ["math", "engines"],
    "address": {"street": "1 Analytical Way", "city": "London", "zip": "12345", "country": "CH"},
    "orders": [{"sku": "NOTE-G", "qty": 2, "price": 9.99}, {"sku": "CARD", "qty": 10, "price": 1}],
    "notes": None,
}

DEFAULT_TOKENIZER = Path.home() / ".cache/sluicegate/models"


def _tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path is None:
        found = sorted(DEFAULT_TOKENIZER.glob("*/tokenizer.json"))
        if found:
            path = str(found[0].parent)
    if path is not None:
        return AutoTokenizer.from_pretrained(path)
    from testkit.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lib, self.torch = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        return self.lib.LLMatcher(self.tok, grammar)  # the matcher build is the compile

    def matchers(self, schema: dict[str, Any], n: int) -> list[Any]:
        return [self.compile(schema) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.torch.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def accept(self, matchers: list[Any], token: int) -> None:
        for m in matchers:
            assert m.consume_token(token), m.get_error()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.torch.apply_token_bitmask_inplace(logits, bitmask)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.vocab = len(tokenizer)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict[str, Any]) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)  # a cold compile
        return compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, schema: dict[str, Any], n: int) -> list[Any]:
        compiled = self.compile(schema)
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list[Any], token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


def _compile_ms(lib: Any, repeats: int = 5) -> float:
    samples = []
    for i in range(repeats):
        schema = {**SCHEMA, "title": f"cold-{i}"}  # defeat any cache
        started = time.perf_counter()
        lib.compile(schema)
        samples.append(time.perf_counter() - started)
    return _median_ms(samples)


def _step_ms(lib: Any, tokens: list[int], batch: int, steps: int) -> tuple[float, float]:
    """Median mask fill and mask apply per step, decoding `tokens` in every matcher."""
    matchers = lib.matchers(SCHEMA, batch)
    bitmask = lib.bitmask(batch)
    logits = torch.randn(batch, lib.vocab)
    fills, applies = [], []
    for token in tokens[:steps]:
        started = time.perf_counter()
        lib.fill(matchers, bitmask)
        fills.append(time.perf_counter() - started)
        started = time.perf_counter()
        lib.apply(logits, bitmask)
        applies.append(time.perf_counter() - started)
        lib.accept(matchers, token)
    return _median_ms(fills), _median_ms(applies[2:] or applies)  # skip torch.compile warm-up


def _run(name: str, make: Callable[[Any], Any], tokenizer: Any, steps: int) -> list[str]:
    lib = make(tokenizer)
    tokens = tokenizer(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    ids = tokens["input_ids"]
    rows = [f"| {name} | compile (cold, mid-size schema) | {_compile_ms(lib):.2f} ms |"]
    for batch in (1, 32):
        fill, apply = _step_ms(lib, ids, batch, steps)
        rows.append(f"| {name} | mask fill per step, batch {batch} | {fill:.3f} ms |")
        rows.append(f"| {name} | mask apply per step, batch {batch} | {apply:.3f} ms |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a tokenizer folder (default: SmolLM2's, cached)")
    parser.add_argument("--steps", type=int, default=60, help="decode steps measured")
    parser.add_argument("--only", choices=["llguidance", "xgrammar"])
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = _tokenizer(args.tokenizer)
    print(f"tokenizer vocabulary: {len(tokenizer)} tokens, torch threads {torch.get_num_threads()}")
    print("| library | what | median |")
    print("|---|---|---|")
    for name, make in (("llguidance", Llguidance), ("xgrammar", Xgrammar)):
        if args.only in (None, name):
            for row in _run(name, make, tokenizer, args.steps):
                print(row, flush=True)


if __name__ == "__main__":
    main()
