"""Paged attention, plugged into transformers' own model classes through `AttentionInterface`.

The model runs one flattened batch per step: every scheduled sequence's new tokens side by side
in a single row. Each attention layer then (1) writes the new keys and values into their cache
slots and (2) attends per sequence over that sequence's slots: all single-token decodes together
in one masked SDPA call per run of rows, over their persistent rows (decode_rows.py; gathered
from blocks, padded to the longest context, when the rows do not hold them); short chunks (draft
verifications, prompt tails) together, padded into one masked SDPA call (`SpanGroup`), or on CPU
through the kernel over the paged blocks in place (`KernelSpans`); each long prefill chunk on
its own, causal SDPA.

NOTE on GQA: query heads are grouped per KV head (head h reads KV head h // G, as transformers'
`repeat_kv` lays them out), so a decode's G query heads ride as G "query positions" against their
one KV head: no KV expansion, and one mask row serves them all. The cache is head-major (see
kv_cache.py), so the attention runs over (KV head, sequence) without a transposing copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from workers.decode_kernel import decode_attention, span_attention
from workers.kv_cache import KVCache

ATTENTION_NAME = "sluice_paged"


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens at `start` in the flattened batch."""

    start: int
    length: int
    # None when the chunk starts the sequence: attend to its own new tokens, plain causal.
    context_slots: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # [1, 1, length, context] additive causal mask


@dataclass(slots=True)
class SpanGroup:
    """Short chunks attended together: `count` spans padded to `length` queries each.

    NOTE: one call per chunk cost ~10 tensor ops per chunk and layer; with a draft verification
    per sequence at c=64 that loop was the largest share of a step. Padded, the group is one
    gather and one SDPA call per layer whatever its size; pad queries are dropped.
    """

    count: int
    length: int
    tokens: torch.Tensor  # [count * length] each padded query's token in the flattened batch
    keep: torch.Tensor  # [real tokens] each real query's place in the padded layout ...
    rows: torch.Tensor  # ... and its token in the flattened batch
    blocks: torch.Tensor  # [count * width] block ids of each span's context (0-padded)
    bias: torch.Tensor  # [count, length * group, width * block_size] float32, causal + context


@dataclass(slots=True)
class KernelSpans:
    """Short chunks for the CPU kernel (decode_kernel.span_attention): each real query reads its
    sequence's blocks in the paged cache in place, to its own length (causal by length); no
    gathered context, no mask, no padded queries."""

    rows: torch.Tensor  # [real tokens] each query's token in the flattened batch
    tables: torch.Tensor  # [count, width] each span's block ids (0-padded)
    spans: torch.Tensor  # [real tokens] each query's span
    lengths: torch.Tensor  # [real tokens] the positions each query sees, its own included


@dataclass(slots=True)
class PagedBatch:
    """Where this step's tokens go in the cache and what each one attends to (all layers)."""

    cache: KVCache
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode: int = 0  # the first `num_decode` tokens are one-token decodes
    decode_blocks: torch.Tensor | None = None  # [num_decode * width] block ids to read
    decode_context: int = 0  # width * block_size: the decodes' longest context, padded
    decode_bias: torch.Tensor | None = None  # [1, num_decode, 1, max_context]
    # The persistent decode rows (decode_rows.py), when they hold this step's decodes: then
    # decode_bias is [rows in use, 1, 1, capacity] and no blocks are gathered.
    row_keys: torch.Tensor | None = None  # [layers, rows, kv_heads, capacity, head_dim]
    row_values: torch.Tensor | None = None
    row_index: torch.Tensor | None = None  # [num_decode] each decode's row; None: row i is decode i
    row_writes: torch.Tensor | None = None  # [num_decode * kv_heads] where each new K/V row goes
    # (start, stop, reach): runs of rows attended together, each over its first `reach`
    # positions (decode_rows.row_runs); decode_bias is then [rows in use, 1, 1, longest reach]
    row_runs: list[tuple[int, int, int]] = field(default_factory=list)
    # With the CPU kernel (decode_kernel.py): each decode's row length, this step's position
    # included; row_index then always set, no bias or runs, and the kernel writes the decodes'
    # K/V into the cache itself
    row_lengths: torch.Tensor | None = None  # [num_decode]
    prefills: list[PrefillSpan] = field(default_factory=list)
    spans: SpanGroup | KernelSpans | None = None


def length_bias(lengths: torch.Tensor, context: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(lengths), context] in `dtype`: 0 where a position is visible, -inf past its end
    (device ops alone: no host read, so a CUDA graph can hold it)."""
    visible = torch.arange(context, device=lengths.device) < lengths.unsqueeze(1)
    bias = torch.zeros(visible.shape, dtype=dtype, device=lengths.device)
    return bias.masked_fill_(~visible, float("-inf"))


def _gather_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, rows: int, block_size: int
) -> torch.Tensor:
    """Whole cache blocks → [kv_heads, rows, width * block_size, head_dim] (contiguous).

    NOTE: copying whole blocks (block_size * head_dim values per index) instead of single slots
    makes the gather a few large memcpys; the padding it adds is masked like any other.
    """
    kv_heads, _, head_dim = cache.shape
    by_block = cache.view(kv_heads, -1, block_size * head_dim)
    picked = by_block.index_select(1, blocks)
    return picked.view(kv_heads, rows, -1, head_dim)


def _gather(cache: torch.Tensor, slots: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """Cache slots → [kv_heads, rows, length, head_dim] (contiguous)."""
    return cache.index_select(1, slots).view(cache.shape[0], rows, length, cache.shape[2])


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Attention for a few queries per KV head: [KV, S, G, D] x [KV, S, L, D] -> [KV, S, G, D]
    (or any batch dims SDPA broadcasts `bias`, in q's dtype, over).

    NOTE: one fused SDPA call, which reads K and V where they lie: the decode rows are read as
    strided views (each run of rows up to its own longest), and two batched matmuls copied such a
    view in bfloat16 before multiplying (q.kT 190-280 us against 45-60 contiguous on an AMX host).
    Over 30 layers of 4 runs of rows: 17 against 32 ms at 32 rows (bf16 SDPA against bf16
    matmuls), 21 against 25 ms in float32.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def _decode_from_rows(
    batch: PagedBatch,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """The decodes' attention over their persistent rows (decode_rows.py) → [nd, H, D].

    With the CPU kernel (decode_kernel.py), one call a layer writes each decode's new K/V into
    its row and its cache slot, and reads the row to its own length. Otherwise the new K/V joins
    each row first, then rows 0..R-1 are read in place, run by run, each run only as far as its
    longest row (SDPA takes the slices' strides: no gathering copy); each query goes to its
    sequence's row, and a row whose sequence does not decode this step (it runs a chunk, or the
    row is free) gets a zero query and its output is dropped.
    """
    nd, (_, heads, _, head_dim) = batch.num_decode, query.shape
    kv_heads = key.shape[1]
    rows_k, rows_v = batch.row_keys[layer], batch.row_values[layer]
    # [H, nd, D] → [KV, G, nd, D] → [nd, KV, G, D], placed at the decodes' rows (in their dtype)
    q = query[0, :, :nd].view(kv_heads, heads // kv_heads, nd, head_dim).permute(2, 0, 1, 3)
    q = q.to(rows_k.dtype)
    if batch.row_lengths is not None:  # [KV, nd, D] → [nd, KV, D]: views, written by the kernel
        new = key[0, :, :nd].transpose(0, 1), value[0, :, :nd].transpose(0, 1)
        cache = batch.cache.keys[layer], batch.cache.values[layer]
        slots = batch.slot_mapping[:nd]
        scale = head_dim**-0.5 if scale is None else scale
        index, lengths = batch.row_index, batch.row_lengths
        o = decode_attention(q, (rows_k, rows_v), new, index, lengths, cache, slots, scale)
        return o.reshape(nd, heads, head_dim).to(query.dtype)
    for rows, new in ((rows_k, key), (rows_v, value)):
        fresh = new[0, :, :nd].transpose(0, 1).reshape(nd * kv_heads, head_dim)
        rows.view(-1, head_dim).index_copy_(0, batch.row_writes, fresh.to(rows.dtype))
    used = batch.decode_bias.shape[0]
    if batch.row_index is not None:
        q = q.new_zeros(used, *q.shape[1:]).index_copy_(0, batch.row_index, q)
    bias, runs = batch.decode_bias, batch.row_runs
    if len(runs) == 1:
        _, _, reach = runs[0]
        o = _decode_attention(q, rows_k[:used, :, :reach], rows_v[:used, :, :reach], bias, scale)
    else:  # NOTE: slices of rows and positions are views: no copy (SDPA takes their strides)
        o = torch.empty_like(q)
        for a, b, reach in runs:
            k, v = rows_k[a:b, :, :reach], rows_v[a:b, :, :reach]
            o[a:b] = _decode_attention(q[a:b], k, v, bias[a:b, :, :, :reach], scale)
    if batch.row_index is not None:
        o = o.index_select(0, batch.row_index)
    return o.reshape(nd, heads, head_dim).to(query.dtype)


def _group_attention(
    group: SpanGroup,
    keys: torch.Tensor,
    values: torch.Tensor,
    query: torch.Tensor,
    block_size: int,
    scale: float | None,
) -> torch.Tensor:
    """The short chunks' attention over their gathered blocks → [real tokens, H, D].

    Each span's queries ride as `length * group` rows against its KV heads (position-major,
    so a mask row per position serves its G heads, as for decodes)."""
    kv_heads, _, head_dim = keys.shape
    heads, (count, length) = query.shape[1], (group.count, group.length)
    q = query[0].index_select(1, group.tokens)  # [H, count * length, D]
    q = q.view(kv_heads, heads // kv_heads, count, length, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(kv_heads, count, -1, head_dim)
    k = _gather_blocks(keys, group.blocks, count, block_size)
    v = _gather_blocks(values, group.blocks, count, block_size)
    o = _decode_attention(q, k, v, group.bias, scale)  # [KV, count, length * G, D]
    o = o.view(kv_heads, count, length, -1, head_dim).permute(1, 2, 0, 3, 4)
    return o.reshape(count * length, heads, head_dim).index_select(0, group.keep)


def _spans_by_kernel(
    spans: KernelSpans,
    keys: torch.Tensor,
    values: torch.Tensor,
    query: torch.Tensor,
    block_size: int,
    scale: float | None,
) -> torch.Tensor:
    """The short chunks' attention through the CPU kernel → [real tokens, H, D]."""
    kv_heads, _, head_dim = keys.shape
    heads = query.shape[1]
    # [H, R, D] → [R, H, D] → [R, KV, G, D]: head h reads KV head h // G
    q = query[0].index_select(1, spans.rows).transpose(0, 1)
    q = q.view(-1, kv_heads, heads // kv_heads, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    o = span_attention(
        q, (keys, values), spans.tables, spans.spans, spans.lengths, block_size, scale
    )
    return o.view(-1, heads, head_dim)


def _write_cache(
    batch: PagedBatch,
    keys: torch.Tensor,
    values: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """The step's new K/V into their cache slots; the decodes' are the kernel's to write when it
    attends them."""
    written = batch.num_decode if batch.row_lengths is not None else 0
    if written < key.shape[2]:
        slots = batch.slot_mapping[written:]
        keys.index_copy_(1, slots, key[0, :, written:])
        values.index_copy_(1, slots, value[0, :, written:])


def _decode_from_blocks(
    batch: PagedBatch,
    keys: torch.Tensor,
    values: torch.Tensor,
    query: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """The decodes' attention over their gathered blocks (when the rows do not hold them)."""
    nd, (_, heads, _, head_dim), kv_heads = batch.num_decode, query.shape, keys.shape[0]
    # [H, nd, D] → [KV, G, nd, D] → [KV, nd, G, D]
    q = query[0, :, :nd].view(kv_heads, heads // kv_heads, nd, head_dim).transpose(1, 2)
    bs = batch.cache.block_size
    k = _gather_blocks(keys, batch.decode_blocks, nd, bs)
    v = _gather_blocks(values, batch.decode_blocks, nd, bs)
    o = _decode_attention(q, k, v, batch.decode_bias, scale)  # [KV, nd, G, D]
    return o.permute(1, 0, 2, 3).reshape(nd, heads, head_dim)


def _prefill_attention(
    span: PrefillSpan,
    keys: torch.Tensor,
    values: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """One long prefill chunk: causal over its own tokens, or over its gathered context."""
    s, n = span.start, span.length
    gqa = query.shape[1] > key.shape[1]
    q = query[:, :, s : s + n]
    if span.context_slots is None:
        k, v, mask = key[:, :, s : s + n], value[:, :, s : s + n], None
    else:
        length = span.context_slots.numel()
        k = _gather(keys, span.context_slots, 1, length).transpose(0, 1)
        v = _gather(values, span.context_slots, 1, length).transpose(0, 1)
        mask = span.bias
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )
    return o[0].transpose(0, 1)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    batch: PagedBatch | None = kwargs.get("paged_batch")
    if batch is None:  # the model used outside the engine (e.g. `generate`): plain SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = module.layer_idx
    keys, values = batch.cache.keys[layer], batch.cache.values[layer]
    _, heads, tokens, head_dim = query.shape
    _write_cache(batch, keys, values, key, value)
    out = query.new_empty(tokens, heads, head_dim)
    nd = batch.num_decode
    if nd and batch.row_keys is not None:
        out[:nd] = _decode_from_rows(batch, layer, query, key, value, scaling)
    elif nd:
        out[:nd] = _decode_from_blocks(batch, keys, values, query, scaling)
    if batch.spans is not None:
        bs, attend = batch.cache.block_size, _group_attention
        if type(batch.spans) is KernelSpans:
            attend = _spans_by_kernel
        out.index_copy_(0, batch.spans.rows, attend(batch.spans, keys, values, query, bs, scaling))
    for span in batch.prefills:
        out[span.start : span.start + span.length] = _prefill_attention(
            span, keys, values, query, key, value, scaling
        )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
