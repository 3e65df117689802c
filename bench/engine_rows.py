"""The sluicegate engine's rows: (d) the engine as a worker runs it, (d-fixed) the same engine
with a fixed token budget (no step-time target), (d-sdpa) the same engine with the decodes'
attention in SDPA instead of the CPU kernel (decode_kernel.py), (d-eager) the same engine with
every step eager (no CUDA graphs, decode_graphs.py), (e) row (d) from a `--compare` tree, (f)
row (d) with every request under a JSON-schema constraint (llguidance's per-step mask): an
array of at least 10,000 mid-size objects, so no request completes its JSON before
`--max-new-tokens` and the workload is the same as (d)'s; (g) row (d) with a retrieval client
embedding long documents through the same engine all the while (engine_drive.Embedded); (e-g)
row (g) from the `--compare` tree.

Settings reach the engine only where its constructor accepts them, so an older tree runs too.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from engine_drive import EMBED_BACKLOG, EMBED_TOKENS
from engine_hf_rows import fitted_blocks

ENGINE_KWARGS = ("num_kv_blocks", "block_size", "max_num_batched_tokens")
ENGINE_ROWS = ("d", "d-fixed", "d-sdpa", "d-eager", "e", "f", "g", "e-g")
EMBED_ROWS = ("g", "e-g")  # with the retrieval client beside the streams
COMPARED_ROWS = ("e", "e-g")  # run from the `--compare` tree

BENCH_ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "maxLength": 12},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number"},
        "kind": {"enum": ["book", "food", "toy"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["sku", "qty", "price", "kind"],
    "additionalProperties": False,
}
BENCH_SCHEMA = {"type": "array", "items": BENCH_ITEM, "minItems": 10_000}


def step_time_target(row: str, args: argparse.Namespace) -> float | None:
    """Row (d-fixed): none; the others: `--step-time-target`, else the worker's default on the
    bench's device."""
    if row == "d-fixed":
        return None
    if args.step_time_target is not None:
        return args.step_time_target or None
    from workers import config

    if hasattr(config, "default_step_time_target"):
        return config.default_step_time_target(args.device)
    return getattr(config.WorkerConfig(), "step_time_target_s", None)  # an older tree


def engine_settings(
    row: str, args: argparse.Namespace, concurrency: int, prompts: list
) -> dict[str, Any]:
    """max_num_seqs = the concurrency; the KV cache sized to the workload unless told otherwise
    (`--num-kv-blocks 0`: the engine's own default sizing)."""
    from workers.engine import Engine

    settings = {name: getattr(args, name) for name in ENGINE_KWARGS}
    # (g): room for the retrieval client's backlog beside the c streams (engine_drive.Embedded)
    settings["max_num_seqs"] = concurrency + (EMBED_BACKLOG if row in EMBED_ROWS else 0)
    settings["step_time_target_s"] = step_time_target(row, args)
    settings["decode_kernel"] = False if row == "d-sdpa" else None  # None: the engine's default
    settings["cuda_graphs"] = False if row == "d-eager" else None
    if settings["num_kv_blocks"] is None:
        default_block = inspect.signature(Engine.__init__).parameters.get("block_size")
        block = args.block_size or getattr(default_block, "default", None)
        if isinstance(block, int):
            settings["num_kv_blocks"] = fitted_blocks(
                prompts, args.max_new_tokens, block, concurrency
            )
            if row in EMBED_ROWS:  # and the documents being embedded
                settings["num_kv_blocks"] += EMBED_BACKLOG * -(-EMBED_TOKENS // block)
    elif settings["num_kv_blocks"] == 0:
        settings["num_kv_blocks"] = None
    return settings


def make_engine(model: Any, tokenizer: Any, settings: dict[str, Any]) -> tuple[Any, dict]:
    """The engine and the settings it took: those its constructor accepts (before and after the
    paged-KV rewrite); settings left as None keep the engine's defaults."""
    from workers.engine import Engine

    accepted = inspect.signature(Engine.__init__).parameters
    used = {k: v for k, v in settings.items() if v is not None and k in accepted}
    return Engine(model, tokenizer, **used), used


def bench_grammar(engine: Any, tokenizer: Any) -> Any:
    """Row (f)'s compiled grammar (compiled once: the cost measured is the per-step mask)."""
    from wire.output_spec import ResponseFormat
    from workers.grammar import GrammarCompiler, grammar_source

    compiler = GrammarCompiler(tokenizer, engine.vocab_size, engine.stop_ctx.eos_token_ids)
    fmt = ResponseFormat("json_schema", BENCH_SCHEMA, "bench")
    return compiler.build(grammar_source(fmt, None))
