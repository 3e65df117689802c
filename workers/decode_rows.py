"""The persistent decode batch: each decoding sequence's past K/V kept in a contiguous row.

Why: paged blocks are scattered, so attending over them means gathering every decoding
sequence's whole past K/V into one tensor, in every layer, every step; at 64 sequences that copy
was a fifth of a CPU step. Here the sequences that decode step after step keep a row of
`[layers, rows, kv_heads, capacity, head_dim]` keys and values: a sequence's past is copied in
once, when it joins the decode batch, and then each step adds one position per layer (written
next to the paged cache's own copy, by the attention function). Rows `0..n-1` hold this step's
decodes (and the holes sequences that left made), laid out longest first, so attention reads
them in place, in a few runs of rows each only as far as its own longest (`row_runs`).

NOTE: the paged cache stays the source of truth (prefills, prefix caching, forks and preemption
only know blocks). A row is trusted only while its sequence decodes every step: a sequence that
skips a step, is preempted or comes back with a different length is copied in again. The rows
never hold more token slots than the paged cache itself; a batch that would need more is served
by gathering blocks, as before (`arrange` returns None).

NOTE on dtype: with the engine's CPU kernel (decode_kernel.py) the rows keep the cache's dtype
on any CPU: the kernel widens bfloat16 to float32 as it loads. Without it, on a CPU without
native bfloat16 the rows are float32 whatever the cache's dtype: bfloat16 attention there (no
native bf16 dot on AVX2) ran 3-5x slower than float32, and that attention is most of a step's
non-GEMM time at c=64; the price is twice the rows' memory in a bfloat16 run. A CPU with native
bfloat16 (AVX512-BF16, AMX), like an accelerator, keeps the cache's dtype: SDPA over a 32-row
step's runs (strided views) took 17 ms in bfloat16 against 21 in float32 on an AMX host (the
batched matmuls before it copied the views first and took 32).

NOTE on memory: growing the rows lays them out anew. On CPU, fresh memory costs a page fault per
page on first touch: zeroing 150 MB of new pages took 50 ms here, and several times that on a
virtual machine whose host had not yet backed the pages (a reshape of 8 rows of 800 positions
took 150-600 ms, up to four steps' worth, all in one step's ITL). So on CPU the rows' tensors
are views of two reserved flat buffers (`RowArena`) the layouts take turns in: each buffer is
address space for as many token slots as the paged cache, its pages appear as a layout first
reaches them and stay, so a reshape past warm-up costs only the copy of the held rows (each
row's own positions). For SDPA a layout's new reach is zeroed (it reads masked positions); for
the decode kernel, which reads each row only to its length, it is not, and a page is first
touched by the write that fills it. On an
accelerator (no page faults; the caching allocator reuses freed blocks) a reshape allocates
exactly, as reserving the whole budget would take real device memory.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from workers.host_copy import to_device
from workers.kv_cache import KVCache
from workers.model_loader import cpu_has_native_bf16
from workers.request import SequenceState

# NOTE: growing the capacity copies every held row (at c=16, fp32 rows, 900 positions: about
# 0.7 GB). A block of headroom made the rows grow again each time the longest sequence crossed
# a block, a copy every 16 tokens that showed as the ITL tail; a quarter of headroom (at least a
# block) makes growth geometric: a row set that grows to n positions is copied O(log n) times.
HEADROOM = 4  # capacity = need + need / HEADROOM
MAX_ROW_RUNS = 4  # the most runs of rows a step's decode attention is split into (`row_runs`)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def capacity_for(longest: int, block_size: int) -> int:
    """The positions rows get for sequences of up to `longest`: whole blocks, with a quarter of
    headroom (at least a block) so that growth is geometric (see HEADROOM)."""
    need = _round_up(longest, block_size)
    return _round_up(need + max(block_size, need // HEADROOM), block_size)


def row_runs(lengths: list[int], run_cost: int | None) -> list[tuple[int, int, int]]:
    """How the decodes' attention takes rows `0..len(lengths)-1`: as contiguous runs
    `(start, stop, reach)`, each read only up to its longest row's `reach` positions.

    Why: a row's tensor holds `capacity` positions (the longest sequence's, plus headroom), and
    reading every row that far read three times the positions the rows hold at c=64 (prompts of
    30-180 tokens). Rows are laid out longest first (`DecodeRows`), so a few runs of rows close
    the gap: of the splits into 1 to `MAX_ROW_RUNS` runs of equal size, the one that reads the
    fewest positions, where each run beyond the first costs `run_cost` positions (its calls);
    `run_cost` None: one run (an accelerator, where a call costs more than reading)."""
    count = len(lengths)
    best = [(0, count, max(lengths))]
    if run_cost is None:
        return best
    least = count * best[0][2]
    for runs in range(2, min(MAX_ROW_RUNS, count) + 1):
        bounds = [count * i // runs for i in range(runs + 1)]
        split = [(a, b, max(lengths[a:b])) for a, b in pairwise(bounds)]
        cost = sum((b - a) * reach for a, b, reach in split) + (runs - 1) * run_cost
        if cost < least:
            best, least = split, cost
    return best


class RowArena:
    """A flat buffer the rows' keys (or values) are laid out in, one layout after another.

    Reserved whole (CPU: address space only) and, for SDPA, zeroed only as far as a layout has
    reached, so every value a layout can read is finite: zero, or K/V some layout wrote (a
    masked position's weight is 0, and 0 x NaN would still poison its row). The decode kernel
    reads each row only to its length, all written, so for it nothing is zeroed: a page is then
    first touched by the write that fills it, a row's growth spread over the steps, where zeroing
    a layout's new reach at once took 23-48 ms of one step (16 rows of 688 positions)."""

    def __init__(self, like: torch.Tensor, numel: int, dtype: torch.dtype, zeroed: bool) -> None:
        self.flat = like.new_empty(numel, dtype=dtype)
        self.zeroed = zeroed
        self.ready = 0  # flat[:ready] is zero or written

    def take(self, numel: int) -> torch.Tensor:
        """The first `numel` values, initialised where the reader needs it."""
        if self.zeroed and numel > self.ready:
            self.flat[self.ready : numel].zero_()
            self.ready = numel
        return self.flat[:numel]


class DecodeRows:
    """Owns the row copies; `arrange` finds (or makes) each of a step's decodes its row."""

    def __init__(self, cache: KVCache, kernel_reads: bool = False) -> None:
        """`kernel_reads`: the CPU decode kernel reads the rows, so they take the cache's dtype
        on any CPU (it reads bfloat16 at float32's speed and writes the cache and the rows in
        one dtype), and a layout is not zeroed (it reads each row only to its length)."""
        self.cache = cache
        self.kernel_reads = kernel_reads
        on_cpu = cache.keys.device.type == "cpu"
        widen = on_cpu and not kernel_reads and not cpu_has_native_bf16()
        self.dtype = torch.float32 if widen else cache.keys.dtype
        self.keys: torch.Tensor | None = None  # [layers, rows, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.seqs: list[SequenceState | None] = []  # row i holds seqs[i]'s past (None: free) ...
        self.lengths: list[int] = []  # ... positions 0 .. lengths[i] - 1
        self.tables: list[list[int]] = []  # ... read from (and written beside) these blocks
        self.row_of: dict[int, int] = {}  # id(sequence) → its row
        self.copied_in = 0  # sequences copied in whole from blocks, over the runner's life (tests)
        self.reserve = on_cpu  # layouts take turns in two reserved arenas (see the module note)
        self._arenas: list[tuple[RowArena, RowArena]] = []  # (keys, values), the current last

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    @property
    def num_rows(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def arrange(
        self, decodes: list[SequenceState], chunks: list[tuple[SequenceState, int]]
    ) -> list[int] | None:
        """The row of each of `decodes`, holding its past K/V; this step writes its next position.

        A held sequence running a chunk this step (a draft's verification) keeps its row: the
        positions the row lacks are copied from its blocks when it decodes again. Called every
        step, decodes or not, so no row outlives a step its sequence was absent from. None: the
        rows would outgrow the paged cache; they are dropped and the caller gathers blocks.
        """
        starts = {id(s): s.num_computed_tokens for s, _ in chunks}
        starts.update((id(s), s.num_computed_tokens) for s in decodes)
        self._free_stale(starts)
        if not decodes:
            return []
        # the longest first, so rows near each other have near lengths (`row_runs`)
        joining = sorted(
            (s for s in decodes if id(s) not in self.row_of), key=lambda s: -s.num_computed_tokens
        )
        # rows kept for a chunk this step must keep their past too
        longest = max([max(s.num_computed_tokens for s in decodes) + 1, *self.lengths])
        if not self._fit(len(self.row_of) + len(joining), longest):
            self.release()
            return None
        for seq in joining:
            self._take_row(seq)
        rows = []
        for seq in decodes:
            row = self.row_of[id(seq)]
            if self.lengths[row] < seq.num_computed_tokens:
                self._copy_in(seq, row, self.lengths[row])
            self.lengths[row] = seq.num_computed_tokens + 1
            self.tables[row] = list(seq.block_table)
            rows.append(row)
        return rows

    def release(self) -> None:
        """Forget every row and free the memory."""
        self.keys = self.values = None
        self.seqs, self.lengths, self.tables, self.row_of = [], [], [], {}
        self._arenas = []

    def _free_stale(self, starts: dict[int, int]) -> None:
        """Free the rows of sequences not in this step, behind their row, or whose blocks changed
        (preempted and recomputed): those rows are no longer known to match their blocks."""
        bs = self.cache.block_size
        for row, seq in enumerate(self.seqs):
            if seq is None:
                continue
            held = -(-self.lengths[row] // bs)
            moved = seq.block_table[:held] != self.tables[row][:held]
            if moved or starts.get(id(seq), -1) < self.lengths[row]:
                del self.row_of[id(seq)]
                self.seqs[row] = None
        while self.seqs and self.seqs[-1] is None:
            self.seqs.pop()
            self.lengths.pop()
            self.tables.pop()

    def _take_row(self, seq: SequenceState) -> None:
        """The first free row (or a new last one), filled from the sequence's blocks."""
        row = self.seqs.index(None) if None in self.seqs else len(self.seqs)
        if row == len(self.seqs):
            self.seqs.append(None)
            self.lengths.append(0)
            self.tables.append([])
        self.seqs[row], self.lengths[row], self.row_of[id(seq)] = seq, 0, row
        self._copy_in(seq, row, 0)
        self.copied_in += 1

    def _fit(self, rows: int, longest: int) -> bool:
        """Make room for `rows` sequences of up to `longest` positions, within the budget."""
        bs, budget = self.cache.block_size, self.cache.num_blocks * self.cache.block_size
        need = _round_up(longest, bs)
        if rows * need > budget:
            return False
        capacity = self.capacity
        # NOTE: never shrink under held rows: which sequences decode changes step by step (drafts),
        # and a capacity that followed the step's longest would copy every row back and forth.
        shrink = not self.row_of and need + 4 * bs < capacity
        if need > capacity or shrink or rows * capacity > budget:
            capacity = min(capacity_for(need, bs), budget // rows)
        count = max(rows, len(self.seqs))
        if count > self.num_rows:
            count = max(count, 2 * self.num_rows)
        count = min(count, budget // capacity)
        if capacity != self.capacity or count < len(self.seqs) or count > self.num_rows:
            self._reshape(count, capacity)
        return True

    def _reshape(self, count: int, capacity: int) -> None:
        """New tensors; the held rows move over packed (rows 0..n-1, holes closed), the longest
        first."""
        layers, kv_heads, _, head_dim = self.cache.keys.shape
        size = (layers, count, kv_heads, capacity, head_dim)
        keys, values = (flat.view(size) for flat in self._layout(size))
        held = [row for row, seq in enumerate(self.seqs) if seq is not None]
        held.sort(key=lambda row: -self.lengths[row])
        # NOTE: each row's own positions only, not the old capacity: rows are of mixed lengths,
        # and copying whole rows moved 2-3x the bytes (a reshape at 11 of 16 rows of 688
        # positions took 27-59 ms of a Poisson run's steps, the slowest of its ITL tail)
        keep = min(capacity, self.capacity)
        for new, old in ((keys, self.keys), (values, self.values)):
            for to, row in enumerate(held):
                length = min(keep, self.lengths[row])
                new[:, to, :, :length] = old[:, row, :, :length]
        self.seqs = [self.seqs[row] for row in held]
        self.lengths = [self.lengths[row] for row in held]
        self.tables = [self.tables[row] for row in held]
        self.row_of = {id(seq): row for row, seq in enumerate(self.seqs)}
        self.keys, self.values = keys, values

    def _layout(self, size: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat keys and values for a layout of `size`: on CPU from the arena the current layout
        is not in (two, reserved on first use), elsewhere newly allocated."""
        cache = self.cache
        layers, count, kv_heads, capacity, head_dim = size
        numel = layers * count * kv_heads * capacity * head_dim
        if not self.reserve:
            zeros = cache.keys.new_zeros
            return zeros(numel, dtype=self.dtype), zeros(numel, dtype=self.dtype)
        if not self._arenas:
            # every layout holds at most the paged cache's token slots (`_fit`)
            whole = layers * kv_heads * head_dim * cache.num_blocks * cache.block_size
            self._arenas = [
                tuple(
                    RowArena(source, whole, self.dtype, zeroed=not self.kernel_reads)
                    for source in (cache.keys, cache.values)
                )
                for _ in range(2)
            ]
        self._arenas.reverse()  # the one not holding the current layout goes last
        keys, values = self._arenas[-1]
        return keys.take(numel), values.take(numel)

    def _copy_in(self, seq: SequenceState, row: int, start: int) -> None:
        """Positions start .. num_computed_tokens - 1 of the row, whole blocks from the cache."""
        cache = self.cache
        bs, done = cache.block_size, seq.num_computed_tokens
        first = start // bs
        blocks = to_device(seq.block_table[first : -(-done // bs)], cache.keys.device)
        for source, rows in ((cache.keys, self.keys), (cache.values, self.values)):
            layers, kv_heads, _, head_dim = source.shape
            by_block = source.view(layers, kv_heads, -1, bs * head_dim)
            past = by_block.index_select(2, blocks).view(layers, kv_heads, -1, head_dim)
            rows[:, row, :, first * bs : first * bs + past.shape[2]] = past
