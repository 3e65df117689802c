"""Short chunks attended together give each chunk exactly its own causal attention over its past
and itself, whatever the other chunks' lengths, contexts and block tables: as one padded, masked
SDPA group, and through the CPU kernel over the paged blocks in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from workers import decode_kernel
from workers.attention import PagedBatch, paged_attention_forward
from workers.kv_cache import CacheShape, KVCache
from workers.model_runner import kernel_spans, span_group

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
CPU = torch.device("cpu")
LAYOUTS = {
    "padded SDPA group": lambda spans: span_group(
        spans, BLOCK, HEADS // KV_HEADS, CPU, torch.float32
    ),
    "kernel over the blocks": lambda spans: kernel_spans(spans, BLOCK, CPU),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_short_chunks_together_match_each_chunk_on_its_own(layout) -> None:
    if layout == "kernel over the blocks":
        assert decode_kernel.supports(HEADS // KV_HEADS, HEAD_DIM, torch.float32)
    torch.manual_seed(0)
    cache = KVCache(CacheShape(1, KV_HEADS, HEAD_DIM, torch.float32), 16, BLOCK, CPU)
    # (positions already in the cache, new tokens, block table): a fresh prompt, a draft's
    # verification, a one-token tail over a full block, blocks out of order
    plans = [(0, 5, [3, 7]), (6, 3, [1, 9, 4]), (4, 1, [2, 5]), (9, 2, [8, 0, 6])]
    spans, start = [], 0
    for done, new, table in plans:
        seq = SimpleNamespace(num_computed_tokens=done, block_table=table)
        spans.append((seq, start, new))
        start += new
    past = [s for (done, new, table) in plans for s in slots_of(table, 0, done)]
    cache.keys[0][:, past] = torch.randn(KV_HEADS, len(past), HEAD_DIM)
    cache.values[0][:, past] = torch.randn(KV_HEADS, len(past), HEAD_DIM)
    query = torch.randn(1, HEADS, start, HEAD_DIM)
    key, value = torch.randn(2, 1, KV_HEADS, start, HEAD_DIM).unbind(0)
    new_slots = [s for (done, new, table) in plans for s in slots_of(table, done, done + new)]
    batch = PagedBatch(cache, torch.tensor(new_slots))
    batch.spans = LAYOUTS[layout](spans)
    module = SimpleNamespace(layer_idx=0)

    out, _ = paged_attention_forward(module, query, key, value, None, paged_batch=batch)

    for (_, at, new), (done, _, table) in zip(spans, plans, strict=True):
        context = torch.tensor(slots_of(table, 0, done + new))
        k = cache.keys[0][:, context].repeat_interleave(HEADS // KV_HEADS, 0)
        v = cache.values[0][:, context].repeat_interleave(HEADS // KV_HEADS, 0)
        visible = torch.arange(done + new) <= torch.arange(done, done + new).unsqueeze(1)
        expected = F.scaled_dot_product_attention(
            query[0, :, at : at + new], k, v, attn_mask=visible
        )
        torch.testing.assert_close(
            out[0, at : at + new], expected.transpose(0, 1), atol=2e-6, rtol=2e-5
        )


def slots_of(table: list[int], start: int, stop: int) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, stop)]
