"""The paged KV cache: one preallocated pool of blocks per layer, sized from a memory budget.

NOTE on layout: each layer holds keys and values head-major, as `[kv_heads, num_blocks *
block_size, head_dim]`: a token's slot is `block_id * block_size + offset`, writing a step's new
K/V is one `index_copy_` per layer, and gathering a batch's slots yields `[kv_heads, tokens,
head_dim]`, already the layout batched matmuls and SDPA want (no transposing copy). The pool is
zero-filled: attention masks the unused tail of a block, and zeros (unlike uninitialised
memory) can never turn into NaN under that mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class CacheShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype) -> CacheShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype)

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.kv_heads * self.head_dim * element


def blocks_for_budget(shape: CacheShape, block_size: int, budget_bytes: int, cap: int) -> int:
    """How many blocks fit in `budget_bytes`, but no more than `cap` (what could ever be used)."""
    blocks = min(budget_bytes // shape.bytes_per_block(block_size), cap)
    if blocks < 1:
        raise ValueError("the KV cache budget is smaller than one block")
    return blocks


class KVCache:
    """Owns the cache tensors; the attention function writes and reads them by slot."""

    def __init__(
        self,
        shape: CacheShape,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        scratch: bool = False,
    ) -> None:
        """`scratch`: one block more, past the `num_blocks` the block manager hands out, for the
        writes of a padded batch's pad rows (decode_graphs.py); `scratch_block` is its id."""
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks if scratch else None
        slots = (num_blocks + scratch) * block_size
        size = (shape.num_layers, shape.kv_heads, slots, shape.head_dim)
        self.keys = torch.zeros(size, dtype=shape.dtype, device=device)
        self.values = torch.zeros(size, dtype=shape.dtype, device=device)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (a forked sequence's own copy of a shared tail)."""
        bs = self.block_size
        self.keys[:, :, dst * bs : (dst + 1) * bs] = self.keys[:, :, src * bs : (src + 1) * bs]
        self.values[:, :, dst * bs : (dst + 1) * bs] = self.values[:, :, src * bs : (src + 1) * bs]
