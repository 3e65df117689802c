"""The per-step token mask of the constrained rows of a batch, applied to their logits.

llguidance fills one 32-bit word per 32 tokens for every constrained row, in parallel on its own
threads, into a host buffer (pinned on CUDA). The buffer goes to the logits' device with
`non_blocking`, becomes an additive 0 / -inf bias there (one table lookup per byte) and is
added to the logits: no host-side number is read back, so nothing waits on the device. On CUDA the
fill overlaps the forward pass still running: the logits are only awaited by the sampler's
`tolist()`, after the mask is queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from workers.grammar import Matcher
from workers.host_copy import to_device

_WORD = 32


def byte_table(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: for each byte value, 0 where bit j is set (allowed), else -inf."""
    values = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
    bits = torch.tensor([1 << j for j in range(8)], dtype=torch.int32)
    table = torch.where((values & bits) != 0, 0.0, float("-inf"))
    return table.to(device)


def mask_bias(bitmask: torch.Tensor, vocab_size: int, table: torch.Tensor) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit set = allowed) → [rows, vocab] additive 0 / -inf.

    NOTE: one table lookup per byte rather than unpacking bits and `masked_fill_`: on a CPU it is
    several times faster at 32 x 49152. The int32 words are read as little-endian bytes, so
    byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7 (x86 and CUDA are little-endian).
    """
    rows = bitmask.shape[0]
    as_bytes = bitmask.view(torch.uint8).long()
    return torch.nn.functional.embedding(as_bytes, table).view(rows, -1)[:, :vocab_size]


class GrammarMasks:
    """Owned by the sampler; created the first time a batch has a constrained row."""

    def __init__(self) -> None:
        self._executor = llguidance.LLExecutor()
        self._tables: dict[torch.device, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
        """Mask, in place, every token the row's grammar does not allow next."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        vocab = logits.shape[-1]
        words = -(-vocab // _WORD)
        pinned = logits.device.type == "cuda"
        bitmask = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=pinned)
        pairs = [(matchers[i].ll, k) for k, i in enumerate(rows)]  # type: ignore[union-attr]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(rows))
        table = self._tables.get(logits.device)
        if table is None:
            table = self._tables[logits.device] = byte_table(logits.device)
        bias = mask_bias(bitmask.to(logits.device, non_blocking=True), vocab, table)
        if len(rows) == logits.shape[0]:
            logits += bias
            return
        index = to_device(rows, logits.device)
        logits[index] += bias
