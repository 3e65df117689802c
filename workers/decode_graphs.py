"""Decode-only steps through static buffers, replayed as CUDA graphs on a GPU.

Why: on a GPU a small model's decode step is bound by the host launching its kernels (SmolLM2-135M
on an H200: ~1,500 launches a step, the GPU busy 3 ms of a 40 ms step). A CUDA graph records a
step's kernels once and launches them all in one call. A graph replays fixed shapes at fixed
addresses, so a step that only decodes (every sequence one token, no drafts, no prefill, no
embedding) is padded to a bucket: its batch to the smallest batch bucket that holds it, each
sequence's context (in blocks) to the smallest context bucket that holds the longest. The step's
numbers are copied into one static buffer whose slices are the graph's inputs (token ids,
positions, cache slots, block tables); the graph computes the length mask from the positions,
attends by gathering the blocks (attention.py's gather path), applies the LM head and writes the
logits into one static buffer; the step reads its first `batch` rows. Every other step (prefill,
drafts, mixed) runs eagerly, as before.

Pad rows decode token 0 at position 0 into a scratch block the block manager never hands out
(kv_cache.py's `scratch_block`): they write nowhere a sequence reads, see one position, and their
logits rows are never read.

On a CPU nothing is captured: the same object, with `capture` off, pads to the bucket, fills the
same buffers and runs the same function eagerly (the engine's `static_decode`; tests use it).

NOTE on capture: lazy, the first time a (batch bucket, context bucket) pair is needed, with that
step's own inputs (the warm-up runs and the replay compute the same step: the same K/V to the same
slots): no start-up cost and only the pairs a workload reaches, each a one-time stall of the step
that first needs it. All graphs share one private memory pool and never run concurrently (one
engine thread), so the pool holds about the largest captured step's intermediates (its gathered
K/V and activations). Inputs and logits live outside it, sized once for the largest buckets, and
nothing a capture allocates outlives it: each replay uses the pool as scratch alone, so graphs
may replay in any order (PyTorch's "same order" caveat is about one graph's output in the pool
feeding another).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from workers.attention import PagedBatch, length_bias
from workers.host_copy import copy_into
from workers.kv_cache import KVCache
from workers.request import SequenceState

log = structlog.get_logger("sluice.worker.graphs")

# (ids [1, B], positions [1, B], rows to keep [B], the batch) -> logits [B, vocab]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]
# NOTE: eager runs on the capture stream before a capture: cuBLAS picks its workspaces and
# lazily initialised kernels load there, not inside the graph (PyTorch's documented pattern).
WARMUP_RUNS = 2
PAD_TOKEN = 0


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, …: each power of two and one and a half times it
    from 16 on (a padded batch wastes at most a third), then `max_num_seqs` itself."""
    sizes, power = [1, 2, 4, 8], 16
    while power < max_num_seqs:
        sizes += [power, power * 3 // 2]
        power *= 2
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def context_buckets(max_blocks: int) -> list[int]:
    """Blocks per sequence: 1, 2, 4, … and `max_blocks` (a sequence's most)."""
    sizes, power = [], 1
    while power < max_blocks:
        sizes.append(power)
        power *= 2
    return [*sizes, max_blocks]


def bucket_for(buckets: list[int], need: int) -> int:
    """The smallest bucket that holds `need`; ValueError past the largest."""
    i = bisect.bisect_left(buckets, need)
    if i == len(buckets):
        raise ValueError(f"{need} is past the largest bucket, {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """The buckets a runner pads decode-only steps to, and whether it captures graphs."""

    batches: list[int]
    contexts: list[int]
    capture: bool


def graph_plan(
    device: torch.device,
    cuda_graphs: bool,
    static_decode: bool,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> GraphPlan | None:
    """What the engine does with decode-only steps: captured graphs on CUDA with `cuda_graphs`;
    the static buffers without capture where `static_decode` asks (tests, benchmarks); None: the
    eager path alone (a CPU ignores `cuda_graphs`, and says so once)."""
    capture = cuda_graphs and device.type == "cuda"
    if cuda_graphs and not capture:
        log.info("decode steps run eagerly: CUDA graphs need a CUDA device", device=device.type)
    if not capture and not static_decode:
        return None
    blocks = -(-max_model_len // block_size)
    return GraphPlan(batch_buckets(max_num_seqs), context_buckets(blocks), capture)


def can_capture(model: Any) -> bool:
    """Whether the model's forward has no host-side branch on tensor values: transformers' dynamic
    RoPE scalings read the longest position on the host each call (a sync, not capturable)."""
    scaling = getattr(model.config, "rope_scaling", None) or {}
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    return "dynamic" not in kind and "longrope" not in kind


class _Slot:
    """One (batch, context) bucket: views of the static buffers, and its graph once captured."""

    def __init__(self, graphs: DecodeGraphs, batch: int, blocks: int) -> None:
        meta, block_size = graphs.meta, graphs.cache.block_size
        self.batch, self.blocks = batch, blocks
        self.ids = meta[:batch].view(1, batch)
        self.positions = meta[batch : 2 * batch].view(1, batch)
        self.slots = meta[2 * batch : 3 * batch]
        self.tables = meta[3 * batch : 3 * batch + batch * blocks]
        self.context = blocks * block_size
        self.graphs = graphs
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured

    def compute(self) -> None:
        """The step on the static buffers, logits into the static logits' first rows."""
        g = self.graphs
        batch = PagedBatch(g.cache, self.slots, num_decode=self.batch)
        batch.decode_blocks = self.tables
        batch.decode_context = self.context
        bias = length_bias(self.positions[0] + 1, self.context, g.dtype)
        batch.decode_bias = bias.view(1, self.batch, 1, self.context)
        logits = g.forward(self.ids, self.positions, g.keep[: self.batch], batch)
        g.logits[: self.batch].copy_(logits)


class DecodeGraphs:
    """Runs decode-only steps through static buffers; owns the buffers, the graphs, their pool."""

    def __init__(
        self, plan: GraphPlan, cache: KVCache, forward: DecodeForward, vocab: int, dtype: Any
    ) -> None:
        assert cache.scratch_block is not None, "pad rows need the cache's scratch block"
        self.plan, self.cache, self.forward, self.dtype = plan, cache, forward, dtype
        device = cache.keys.device
        most, widest = plan.batches[-1], plan.contexts[-1]
        with torch.inference_mode():  # NOTE: the steps run in inference mode; so do its buffers
            self.meta = torch.zeros(3 * most + most * widest, dtype=torch.long, device=device)
            self.keep = torch.arange(most, device=device)
            self.logits = torch.zeros(most, vocab, dtype=dtype, device=device)
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.pool: Any = None  # the graphs' shared private memory pool, from the first capture
        self.replays = 0  # steps run through the buffers, over the runner's life (tests, bench)

    @property
    def graph_count(self) -> int:
        return sum(slot.graph is not None for slot in self.slots.values())

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.plan.batches[-1]

    def run(self, decodes: list[SequenceState]) -> torch.Tensor:
        """The logits [len(decodes), vocab] of one decode-only step, one row per decode.

        NOTE: a view of the static logits, valid until the next step's run (which the sampler's
        one host sync per step always precedes)."""
        slot = self._slot(decodes)
        copy_into(self.meta, self._inputs(decodes, slot))
        if not self.plan.capture:
            slot.compute()
        elif slot.graph is None:
            slot.graph = self._capture(slot)
            slot.graph.replay()
        else:
            slot.graph.replay()
        self.replays += 1
        return self.logits[: len(decodes)]

    def _slot(self, decodes: list[SequenceState]) -> _Slot:
        """The bucket pair for this step, from the host's own numbers (no device read)."""
        widest = max(s.num_computed_tokens for s in decodes) + 1
        need = -(-widest // self.cache.block_size)
        key = (bucket_for(self.plan.batches, len(decodes)), bucket_for(self.plan.contexts, need))
        if key not in self.slots:
            self.slots[key] = _Slot(self, *key)
        return self.slots[key]

    def _inputs(self, decodes: list[SequenceState], slot: _Slot) -> list[int]:
        """The slot's whole region of the static buffer, pad rows included, so nothing of an
        earlier (larger) step survives in what this graph reads."""
        bs, scratch = self.cache.block_size, self.cache.scratch_block
        pads = slot.batch - len(decodes)
        positions = [s.num_computed_tokens for s in decodes]
        ids = [s.all_ids[p] for s, p in zip(decodes, positions, strict=True)]
        slots = [
            s.block_table[p // bs] * bs + p % bs for s, p in zip(decodes, positions, strict=True)
        ]
        tables: list[int] = []
        for seq in decodes:
            table = seq.block_table[: slot.blocks]
            tables += table + [scratch] * (slot.blocks - len(table))
        return [
            *ids,
            *[PAD_TOKEN] * pads,
            *positions,
            *[0] * pads,
            *slots,
            *[scratch * bs] * pads,
            *tables,
            *[scratch] * (pads * slot.blocks),
        ]

    def _capture(self, slot: _Slot) -> Any:
        """Warm-up runs on a side stream, then the capture, into the shared pool.

        NOTE: the warm-up runs compute this very step (the same K/V into the same slots), and the
        capture itself runs nothing: the replay after it gives the step its logits."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                slot.compute()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: "thread_local": a CUDA call on another thread of the worker during a capture is
        # not this capture's error
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            slot.compute()
        if self.pool is None:
            self.pool = graph.pool()
        log.info("decode graph captured", batch=slot.batch, blocks=slot.blocks)
        return graph
