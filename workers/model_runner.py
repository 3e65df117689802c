"""Owns the model's tensors: turns one scheduled step into a single forward pass.

The step's new tokens (decodes first, then prefill chunks) are flattened into one row; positions,
cache slots and per-sequence attention spans go to the paged attention function (attention.py)
through the model's forward keyword arguments. Logits are computed only for the sequences that
will sample a token this step; an embedding's chunk (embedding.py) gets its rows' final hidden
states instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from workers import decode_kernel
from workers.attention import (
    ATTENTION_NAME,
    KernelSpans,
    PagedBatch,
    PrefillSpan,
    SpanGroup,
    length_bias,
)
from workers.decode_graphs import DecodeGraphs, GraphPlan, can_capture
from workers.decode_rows import DecodeRows, row_runs
from workers.fused_layers import fuse_projections
from workers.heap import trim_heap
from workers.host_copy import to_device
from workers.kv_cache import KVCache
from workers.llama_forward import lean_forward
from workers.own_memory import own_weights
from workers.packed_linear import (
    mkl_pack_linears,
    pack_linears,
    should_pack,
    should_pack_for_mkl,
    should_transpose,
    transpose_linears,
)
from workers.request import SequenceState

log = structlog.get_logger("sluice.worker.kernel")

# Chunks of up to this many tokens (draft verifications, prompt tails) are attended together
# (attention.SpanGroup); longer ones each get their own causal SDPA, whose per-chunk cost their
# own arithmetic outweighs.
SHORT_SPAN = 16
# With the CPU kernel (decode_kernel.span_attention), chunks of up to this many tokens (a draft's
# verification is at most 7) go through it; longer ones take the per-chunk causal SDPA, whose
# tiles win once a chunk's queries are many: the kernel reads a chunk's context once per query.
# `bench/span_attention.py`, 30 layers of bfloat16 SmolLM2 heads, one chunk over 480 positions,
# kernel / per-chunk SDPA / padded group (ms): 4 new 2.4 / 3.6 / 6.7; 16 new 8.2 / 4.5 / 11.2;
# 32 new 16.0 / 6.5 / 17.6.
KERNEL_SPAN = 8
# What one more run of decode rows (decode_rows.row_runs) costs on a CPU, in row positions
# read: its calls per layer take about as long as reading 600 positions (set with two batched
# matmuls at 8-64 rows of SmolLM2's shapes in float32: 70-100 us a call set, 0.1-0.17 us a
# position; with one SDPA call, 600 and 2,000 read the same in steady bf16 waves).
CPU_ROW_RUN_COST = 600


def span_group(
    spans: list[tuple[SequenceState, int, int]],
    block_size: int,
    group: int,
    device: Any,
    dtype: torch.dtype,
) -> SpanGroup:
    """The padded layout of the short chunks `(seq, start in the batch, new tokens)`, for query
    heads in groups of `group` per KV head; the mask in the queries' `dtype`."""
    bs, count = block_size, len(spans)
    length = max(new for _, _, new in spans)
    width = max(-(-(s.num_computed_tokens + new) // bs) for s, _, new in spans)
    tokens, keep, rows, blocks, last = [], [], [], [], []
    for i, (seq, start, new) in enumerate(spans):
        tokens += [*range(start, start + new), *[start] * (length - new)]
        keep += range(i * length, i * length + new)
        rows += range(start, start + new)
        table = seq.block_table[:width]
        blocks += table + [0] * (width - len(table))
        # query j sees positions up to done + j; a pad query sees the span's first position's
        done = seq.num_computed_tokens
        last += [*range(done, done + new), *[done] * (length - new)]
    visible = torch.arange(width * bs, device=device) <= to_device(last, device).view(
        count, length, 1, 1
    )
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    bias = bias.masked_fill_(~visible, float("-inf")).expand(-1, -1, group, -1)
    return SpanGroup(
        count,
        length,
        tokens=to_device(tokens, device),
        keep=to_device(keep, device),
        rows=to_device(rows, device),
        blocks=to_device(blocks, device),
        bias=bias.reshape(count, length * group, width * bs),
    )


def kernel_spans(
    spans: list[tuple[SequenceState, int, int]], block_size: int, device: Any
) -> KernelSpans:
    """The short chunks `(seq, start in the batch, new tokens)` for the CPU kernel: their block
    tables, and each query token's place, span and visible length (causal within the chunk)."""
    width = max(-(-(s.num_computed_tokens + new) // block_size) for s, _, new in spans)
    rows, tables, span_of, lengths = [], [], [], []
    for i, (seq, start, new) in enumerate(spans):
        table = seq.block_table[:width]
        tables += table + [0] * (width - len(table))
        done = seq.num_computed_tokens
        rows += range(start, start + new)
        span_of += [i] * new
        lengths += range(done + 1, done + new + 1)
    return KernelSpans(
        rows=to_device(rows, device),
        tables=to_device(tables, device).view(len(spans), width),
        spans=to_device(span_of, device),
        lengths=to_device(lengths, device),
    )


@dataclass(slots=True)
class StepResult:
    """What a step's forward pass gave: `logits` rows for `samplers` (ModelRunner.execute), and
    for each embedding chunk `(seq, first position, tokens)` in `pooled`, its rows of `hidden`
    (in that order)."""

    samplers: list[SequenceState]
    logits: torch.Tensor | None = None
    pooled: list[tuple[SequenceState, int, int]] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    replayed: bool = False  # a captured CUDA graph's replay ran the step (decode_graphs.py)
    captured: bool = False  # the step captured its graph first (warm-ups, a capture, a replay)


def _is_decode(seq: SequenceState, new: int) -> bool:
    """Whether `seq`'s `new` tokens this step are a decode: its one last token, after others.

    NOTE: not any one-token chunk: a budget nearly spent on decodes can leave a prompt one token
    of its middle, which is prefill (it samples nothing); so is an embedding's last token."""
    return (
        new == 1
        and seq.num_computed_tokens > 0
        and seq.num_uncomputed == 1
        and seq.embedding is None
    )


class ModelRunner:
    def __init__(
        self,
        model: Any,
        cache: KVCache,
        decode_kernel_ok: bool = True,
        graphs: GraphPlan | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.dtype = cache.shape.dtype
        self.block_size = cache.block_size
        self.run_cost = CPU_ROW_RUN_COST if self.device.type == "cpu" else None
        config = model.config
        self.group = config.num_attention_heads // (
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
        # the decodes' attention over their rows, and the short chunks' over their blocks: the
        # CPU kernel (decode_kernel.py) where it builds and has the shape's variant; SDPA
        # otherwise (runs of rows; a padded, masked group of chunks)
        on_cpu = decode_kernel_ok and self.device.type == "cpu"
        head_dim = cache.shape.head_dim
        self.decode_kernel = on_cpu and decode_kernel.supports(self.group, head_dim, self.dtype)
        if on_cpu and not self.decode_kernel and decode_kernel.available():
            log.info(
                "decode attention through SDPA: the kernel has no variant for this model",
                query_heads_per_kv_head=self.group,
                head_dim=head_dim,
                dtype=str(self.dtype).removeprefix("torch."),
            )
        self.rows = DecodeRows(cache, kernel_reads=self.decode_kernel)
        self.short_span = KERNEL_SPAN if self.decode_kernel else SHORT_SPAN
        own_weights(model)  # off the checkpoint's mapping, which then goes
        fuse_projections(model)
        if should_pack(self.device, self.dtype):
            pack_linears(model)
        elif should_pack_for_mkl(self.device, self.dtype):
            mkl_pack_linears(model)
        elif should_transpose(self.device, self.dtype):
            transpose_linears(model)
        trim_heap()  # the weights fusing and packing (or transposing) replaced
        model.set_attn_implementation(ATTENTION_NAME)
        # the engine's own pass where the architecture allows (llama_forward.py), else the model's
        self.lean = lean_forward(model)
        self.graphs = self._decode_graphs(graphs)

    def _decode_graphs(self, plan: GraphPlan | None) -> DecodeGraphs | None:
        """Decode-only steps through static buffers (decode_graphs.py), where the plan asks and
        the model's forward allows: the lean pass, and for capture no host-side branch."""
        if plan is None:
            return None
        if self.lean is None or (plan.capture and not can_capture(self.model)):
            log.info("decode steps run eagerly: this model's forward cannot be captured")
            return None
        head = self.model.lm_head
        vocab = getattr(head, "out_features", None) or self.model.config.vocab_size
        return DecodeGraphs(plan, self.cache, self._decode_logits, vocab, self.dtype)

    def _decode_logits(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: PagedBatch
    ) -> torch.Tensor:
        """The logits of the `keep` rows through the lean pass (a decode graph's forward)."""
        return self.model.lm_head(self.lean(ids, positions, keep, batch))

    def _graph_step(self, decodes: list[SequenceState]) -> StepResult:
        """A decode-only step through the static buffers (decode_graphs.py).

        NOTE: the rows are still arranged every step (their contract): as chunks, so a held
        sequence keeps its row and the positions this step writes only to blocks are copied in
        when an eager step next decodes it; a sequence gone is freed."""
        self.rows.arrange([], [(s, 1) for s in decodes])
        graphs = self.graphs
        count = graphs.graph_count
        logits = graphs.run(decodes)
        captured = graphs.graph_count > count
        replayed = graphs.plan.capture and not captured
        return StepResult(decodes, logits=logits, replayed=replayed, captured=captured)

    def _slots(self, seq: SequenceState, start: int, stop: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def _decode_metadata(
        self,
        batch: PagedBatch,
        decodes: list[SequenceState],
        chunks: list[tuple[SequenceState, int]],
    ) -> list[SequenceState]:
        """The decodes' attention inputs: normally their persistent rows (decode_rows.py), where
        each new K/V goes, a length mask per row and the runs of rows read together; when the
        rows would outgrow the paged cache, the blocks to gather instead. Returns the decodes
        in the order the batch takes them: their rows' order, so row i is usually decode i."""
        rows = self.rows.arrange(decodes, chunks)
        if not decodes:
            return decodes
        if rows is None:
            self._gather_metadata(batch, decodes)
            return decodes
        if rows != sorted(rows):
            order = sorted(range(len(rows)), key=rows.__getitem__)
            decodes, rows = [decodes[i] for i in order], [rows[i] for i in order]
        kv_heads, capacity = self.rows.keys.shape[2], self.rows.capacity
        index = to_device(rows, self.device)
        done = [s.num_computed_tokens for s in decodes]
        batch.row_keys, batch.row_values = self.rows.keys, self.rows.values
        if self.decode_kernel:  # it writes each new K/V and reads each row to its length
            batch.row_index = index
            batch.row_lengths = to_device([n + 1 for n in done], self.device)
            return decodes
        positions = to_device(done, self.device)
        heads = torch.arange(kv_heads, device=self.device)
        writes = (index.unsqueeze(1) * kv_heads + heads) * capacity + positions.unsqueeze(1)
        batch.row_writes = writes.view(-1)
        lengths = [1] * len(self.rows.seqs)  # a row not decoding now: any finite row will do
        for length, row in zip(done, rows, strict=True):
            lengths[row] = length + 1
        batch.row_runs = row_runs(lengths, self.run_cost)
        reach = max(lengths)
        if rows != list(range(len(lengths))):
            batch.row_index = index
        bias = length_bias(to_device(lengths, self.device), reach, self.rows.dtype)
        batch.decode_bias = bias.view(-1, 1, 1, reach)
        return decodes

    def _gather_metadata(self, batch: PagedBatch, decodes: list[SequenceState]) -> None:
        # NOTE: the widest context comes from the host's own numbers: taking it from the device
        # tensor would make the CPU wait for the GPU every step.
        host_lengths = [s.num_computed_tokens + 1 for s in decodes]
        width = -(-max(host_lengths) // self.block_size)
        lengths = to_device(host_lengths, self.device)
        tables = [s.block_table[:width] for s in decodes]
        batch.decode_blocks = to_device(
            [b for t in tables for b in t + [0] * (width - len(t))], self.device
        )
        context = width * self.block_size
        batch.decode_context = context
        bias = length_bias(lengths, context, self.dtype)
        batch.decode_bias = bias.view(1, len(decodes), 1, context)

    def _prefill_span(self, seq: SequenceState, start: int, new: int) -> PrefillSpan:
        done = seq.num_computed_tokens
        if done == 0:
            return PrefillSpan(start, new)
        context = done + new
        slots = to_device(self._slots(seq, 0, context), self.device)
        rows = torch.arange(done, context, device=self.device).unsqueeze(1)
        visible = torch.arange(context, device=self.device).unsqueeze(0) <= rows
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~visible, float("-inf"))
        return PrefillSpan(start, new, slots, bias.view(1, 1, new, context))

    @torch.inference_mode()
    def execute(self, work: list[tuple[SequenceState, int]]) -> StepResult:
        """Run one step: the logits rows of the sequences that sample next (one row each, or
        1 + len(seq.draft) consecutive rows for a sequence verifying a draft), and the final
        hidden states of the embeddings' chunks."""
        graphs = self.graphs is not None and self.graphs.fits(len(work))
        if graphs and all(_is_decode(s, n) and not s.draft for s, n in work):
            return self._graph_step([s for s, _ in work])
        decodes: list[SequenceState] = []
        prefills: list[tuple[SequenceState, int]] = []
        for seq, new in work:
            if _is_decode(seq, new):
                decodes.append(seq)
            else:
                prefills.append((seq, new))
        batch = PagedBatch(self.cache, torch.empty(0), num_decode=len(decodes))
        decodes = self._decode_metadata(batch, decodes, prefills)
        ids: list[int] = [s.all_ids[s.num_computed_tokens] for s in decodes]
        positions: list[int] = [s.num_computed_tokens for s in decodes]
        slots: list[int] = [
            s.block_table[p // self.block_size] * self.block_size + p % self.block_size
            for s, p in zip(decodes, positions, strict=True)
        ]
        result = StepResult(list(decodes))
        keep: list[int] = list(range(len(decodes)))
        pool: list[int] = []
        short: list[tuple[SequenceState, int, int]] = []
        for seq, new in prefills:
            start, done = len(ids), seq.num_computed_tokens
            ids += seq.all_ids[done : done + new]
            positions += range(done, done + new)
            slots += self._slots(seq, done, done + new)
            if new <= self.short_span:
                short.append((seq, start, new))
            else:
                batch.prefills.append(self._prefill_span(seq, start, new))
            if seq.embedding is not None:
                pool += range(start, start + new)
                result.pooled.append((seq, done, new))
            elif done + new == len(seq.all_ids):
                result.samplers.append(seq)  # a draft's verification: a logits row per position
                keep += range(len(ids) - 1 - len(seq.draft), len(ids))
        if short and self.decode_kernel:
            batch.spans = kernel_spans(short, self.block_size, self.device)
        elif short:
            batch.spans = span_group(short, self.block_size, self.group, self.device, self.dtype)
        batch.slot_mapping = to_device(slots, self.device)
        input_ids = to_device(ids, self.device).unsqueeze(0)
        position_ids = to_device(positions, self.device).unsqueeze(0)
        self._forward(input_ids, position_ids, keep, pool, batch, result)
        return result

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: list[int],
        pool: list[int],
        batch: PagedBatch,
        result: StepResult,
    ) -> None:
        """The forward pass; the LM head only over the `keep` rows, the `pool` rows' final
        hidden states (after the last norm) kept as they are."""
        if self.lean is not None:
            hidden = self.lean(input_ids, position_ids, to_device(keep + pool, self.device), batch)
            result.logits = self.model.lm_head(hidden[: len(keep)])
            result.hidden = hidden[len(keep) :]
            return
        if not pool:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                logits_to_keep=to_device(keep, self.device),
                use_cache=False,
                paged_batch=batch,
            )
            result.logits = out.logits[0]
            return
        # NOTE: the model's decoder without its head, then the head on the sampling rows alone
        body = self.model.base_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, paged_batch=batch
        ).last_hidden_state[0]
        head = self.model.get_output_embeddings()
        result.logits = head(body.index_select(0, to_device(keep, self.device)))
        result.hidden = body.index_select(0, to_device(pool, self.device))
