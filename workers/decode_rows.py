"""The persistent decode batch: each decoding sequence's past K/V kept in a contiguous row.

Why: paged blocks are scattered, so attending over them means gathering every decoding
sequence's whole past K/V into one tensor, in every layer, every step; at 64 sequences that copy
was a fifth of a CPU step. Here the sequences that decode step after step keep a row of
`[layers, rows, kv_heads, capacity, head_dim]` keys and values: a sequence's past is copied in
once, when it joins the decode batch, and then each step adds one position per layer (written
next to the paged cache's own copy, by the attention function). Rows `0..n-1` are always exactly
this step's decodes, so attention reads `rows[:n]` with no copy at all.

NOTE: the paged cache stays the source of truth (prefills, prefix caching, forks and preemption
only know blocks). A row is trusted only while its sequence decodes every step: a sequence that
skips a step, is preempted or comes back with a different length is copied in again. The rows
never hold more token slots than the paged cache itself; a batch that would need more is served
by gathering blocks, as before (`arrange` returns None).
"""

from __future__ import annotations

import torch

from workers.kv_cache import KVCache
from workers.request import SequenceState


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


class DecodeRows:
    """Owns the row copies; `arrange` lines them up with a step's decodes."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.keys: torch.Tensor | None = None  # [layers, rows, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.seqs: list[SequenceState] = []  # row i holds seqs[i]'s past ...
        self.lengths: list[int] = []  # ... positions 0 .. lengths[i] - 1
        self.copied_in = 0  # sequences copied in from blocks, over the runner's life (tests)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    @property
    def num_rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def arrange(self, decodes: list[SequenceState]) -> list[SequenceState] | None:
        """Make rows 0..n-1 hold exactly `decodes`' past K/V; return them in row order.

        Every returned sequence writes its next position (its `num_computed_tokens`) this step.
        None: the rows would outgrow the paged cache; they are dropped and the caller gathers.
        """
        wanted = {id(s): s.num_computed_tokens for s in decodes}
        self._drop_rows(lambda i: wanted.get(id(self.seqs[i])) != self.lengths[i])
        if not self._fit(len(decodes), max(wanted.values()) + 1):
            self.release()
            return None
        held = {id(s) for s in self.seqs}
        for seq in decodes:
            if id(seq) not in held:
                self._copy_in(seq)
        self.lengths = [n + 1 for n in self.lengths]  # this step writes one more position
        return list(self.seqs)

    def release(self) -> None:
        """Forget every row and free the memory."""
        self.keys = self.values = None
        self.seqs, self.lengths = [], []

    def _drop_rows(self, stale) -> None:
        """Remove stale rows, filling each hole with the last row (one row copied, not all)."""
        row = 0
        while row < len(self.seqs):
            if not stale(row):
                row += 1
                continue
            last = len(self.seqs) - 1
            if row != last:
                self.keys[:, row] = self.keys[:, last]
                self.values[:, row] = self.values[:, last]
                self.seqs[row], self.lengths[row] = self.seqs[last], self.lengths[last]
            self.seqs.pop()
            self.lengths.pop()

    def _fit(self, rows: int, longest: int) -> bool:
        """Grow (or shrink) the rows to hold `rows` sequences of up to `longest` positions."""
        bs, budget = self.cache.block_size, self.cache.num_blocks * self.cache.block_size
        need = _round_up(longest, bs)
        if rows * need > budget:
            return False
        capacity = self.capacity
        if need > capacity or need + 4 * bs < capacity or rows * capacity > budget:
            # a block of headroom (a reshape every block_size steps), within the budget
            capacity = min(need + bs, budget // rows)
        count = self.num_rows if rows <= self.num_rows else max(rows, 2 * self.num_rows)
        count = min(count, budget // capacity)
        if capacity != self.capacity or count != self.num_rows:
            self._reshape(count, capacity)
        return True

    def _reshape(self, count: int, capacity: int) -> None:
        cache = self.cache
        layers, kv_heads, _, head_dim = cache.keys.shape
        size = (layers, count, kv_heads, capacity, head_dim)
        keys = cache.keys.new_zeros(size)
        values = cache.values.new_zeros(size)
        held, keep = len(self.seqs), min(capacity, self.capacity)
        if held:
            keys[:, :held, :, :keep] = self.keys[:, :held, :, :keep]
            values[:, :held, :, :keep] = self.values[:, :held, :, :keep]
        self.keys, self.values = keys, values

    def _copy_in(self, seq: SequenceState) -> None:
        """A new last row: the sequence's whole blocks, read once from the paged cache."""
        cache, row = self.cache, len(self.seqs)
        bs, done = cache.block_size, seq.num_computed_tokens
        blocks = torch.tensor(seq.block_table[: -(-done // bs)], device=cache.keys.device)
        for source, rows in ((cache.keys, self.keys), (self.cache.values, self.values)):
            layers, kv_heads, _, head_dim = source.shape
            by_block = source.view(layers, kv_heads, -1, bs * head_dim)
            past = by_block.index_select(2, blocks).view(layers, kv_heads, -1, head_dim)
            rows[:, row, :, : past.shape[2]] = past
        self.seqs.append(seq)
        self.lengths.append(done)
        self.copied_in += 1
