"""Rows (a)-(c) of the engine benchmark: transformers' own ways to generate, timed like ours.

(a) `model.generate`, one request at a time; (b) `model.generate` on static left-padded
batches; (c) transformers' continuous batching (`init_continuous_batching`, its paged cache,
`max_requests_per_batch` = the concurrency). (a)/(b) stamp each step through a `generate`
streamer, (c) uses the manager's own per-token stamps (`record_timestamps=True`).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from engine_stats import Trace

# transformers' FIFO scheduler admits no new prefill while less than this share of its cache is free
CB_SAFETY_MARGIN = 0.15


def fitted_blocks(prompts: list[list[int]], max_new: int, block: int, concurrency: int) -> int:
    """KV blocks for `concurrency` of the longest request: the workload fits, nothing spare."""
    return concurrency * math.ceil((max(map(len, prompts)) + max_new) / block)


def _stamp_streamer() -> Any:
    """A `generate` streamer that stamps each decoding step (the first `put` is the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class StepStamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value: Any) -> None:
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    return StepStamps()


def run_generate(model: Any, tokenizer: Any, wave: list[list[int]], max_new: int) -> list[Trace]:
    """One `generate` call over the wave, left-padded (the cell unset EOS in the model's config)."""
    import torch

    enc = tokenizer.pad({"input_ids": wave}, padding_side="left", return_tensors="pt")
    streamer = _stamp_streamer()
    submitted = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            enc["input_ids"].to(model.device),
            attention_mask=enc["attention_mask"].to(model.device),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
        )
    new = out.shape[1] - enc["input_ids"].shape[1]
    deliveries = [(t, 1) for t in streamer.times]
    return [Trace(submitted, list(deliveries), tokens=new) for _ in wave]


def make_cb_manager(model: Any, args: argparse.Namespace, concurrency: int, prompts: list) -> Any:
    """A started manager: greedy, EOS off, at most `concurrency` requests per batch."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = ContinuousBatchingConfig(max_requests_per_batch=concurrency)
    if args.cb_num_blocks is None:  # NOTE: headroom for the scheduler's safety margin
        fitted = fitted_blocks(prompts, args.max_new_tokens, config.page_size, concurrency)
        margin = CB_SAFETY_MARGIN if config.safety_margin is None else config.safety_margin
        config.num_blocks = math.ceil(fitted / (1 - margin))
    elif args.cb_num_blocks > 0:
        config.num_blocks = args.cb_num_blocks
    if args.cb_max_batch_tokens:
        config.max_batch_tokens = args.cb_max_batch_tokens
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=-1,
        pad_token_id=model.generation_config.pad_token_id,
    )
    manager = model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=config
    )
    manager.warmup()
    manager.start()
    return manager


def run_cb(manager: Any, wave: list[list[int]], max_new: int, tag: str) -> list[Trace]:
    """Add the wave, wait for every result; token times come from the manager's own stamps."""
    submitted = time.perf_counter()
    ids = [
        manager.add_request(
            p,
            request_id=f"{tag}-{i}",
            max_new_tokens=max_new,
            record_timestamps=True,
            eos_token_id=-1,
        )
        for i, p in enumerate(wave)
    ]
    results: dict[str, Any] = {}
    deadline = time.monotonic() + 600
    while len(results) < len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            results[out.request_id] = out
        elif out is None and not manager.is_running():
            break
    traces = []
    for request_id in ids:
        out = results.get(request_id)
        trace = Trace(submitted)
        if out is None:
            trace.error = "no result"
        else:
            trace.tokens, trace.error = len(out.generated_tokens), out.error
            trace.deliveries = [(t, 1) for t in out.timestamps or []]
        traces.append(trace)
    return traces
