"""The persistent decode rows: decoding over them streams exactly what gathering blocks streams,
through joins, departures and preemption, read in one run of rows or several; a steady decode
copies each sequence in once; a batch that would outgrow the paged cache falls back to
gathering."""

from __future__ import annotations

import random

import torch

from tests.support.model_equivalence import stream_texts as stream
from workers.decode_rows import MAX_ROW_RUNS, DecodeRows, RowArena, row_runs
from workers.engine import Engine
from workers.kv_cache import CacheShape, KVCache

WORDS = ["world", "café", "def f(x):", "naïve", "über", "ok", "straße", "🚀"]


def prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for words in lengths:
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def gathering(monkeypatch) -> None:
    """From now on, engines attend by gathering blocks (the rows never take a batch)."""
    monkeypatch.setattr(DecodeRows, "arrange", lambda self, decodes, chunks: None)


def test_rows_stream_what_gathering_streams_through_joins_leaves_and_preemption(
    tiny, monkeypatch
) -> None:
    model, tokenizer = tiny
    all_ids = prompts(tokenizer, [random.Random(i).randint(1, 30) for i in range(12)])
    lengths = [8 + 3 * i for i in range(12)]  # requests leave the batch one by one
    settings = dict(max_num_seqs=6, num_kv_blocks=40, block_size=8, max_num_batched_tokens=48)
    engine = Engine(model, tokenizer, **settings)
    rows = stream(engine, all_ids, lengths)
    assert engine.stats().preemptions_total > 0, "the pool should be small enough to preempt"
    assert engine.runner.rows.copied_in >= len(all_ids)
    gathering(monkeypatch)
    assert stream(Engine(model, tokenizer, **settings), all_ids, lengths) == rows
    assert all(len(text) > 0 for text in rows.values())


def test_a_steady_decode_copies_each_sequence_in_once(tiny) -> None:
    model, tokenizer = tiny
    all_ids = prompts(tokenizer, [10, 10, 10, 10])
    # without drafts: a sequence verifying one runs as a chunk that step and is copied in again
    engine = Engine(
        model, tokenizer, max_num_seqs=4, num_kv_blocks=64, block_size=8, speculative="off"
    )
    stream(engine, all_ids, [40] * 4)
    assert engine.runner.rows.copied_in == 4
    assert engine.runner.rows.capacity >= max(map(len, all_ids)) + 39  # the last step's position


def test_rows_grow_geometrically_not_a_block_at_a_time(tiny, monkeypatch) -> None:
    """Growing the capacity copies every held row: a steady decode of 200 tokens in 8-token
    blocks grows the rows 5 times (by a quarter each), where a block of headroom took 13."""
    model, tokenizer = tiny
    reshapes: list[int] = []
    reshape = DecodeRows._reshape

    def counted(self, count: int, capacity: int) -> None:
        reshapes.append(capacity)
        reshape(self, count, capacity)

    monkeypatch.setattr(DecodeRows, "_reshape", counted)
    engine = Engine(
        model, tokenizer, max_num_seqs=2, num_kv_blocks=128, block_size=8, speculative="off"
    )
    stream(engine, prompts(tokenizer, [10, 10]), [200, 200])
    assert reshapes == sorted(reshapes)  # only growing
    assert 1 <= len(reshapes) <= 8, reshapes


def test_on_cpu_layouts_take_turns_in_two_arenas_and_read_only_finite_values(tiny, monkeypatch):
    """A reshape must not take fresh memory (its page faults landed in one step's ITL): the
    layouts alternate between two reserved arenas, and what a layout reads past its rows'
    lengths is zero or old K/V, never uninitialised memory (0 x NaN poisons a masked row)."""
    model, tokenizer = tiny
    reserved = []
    arena = RowArena.__init__

    def counted(self, *args, **kwargs) -> None:
        arena(self, *args, **kwargs)
        reserved.append(self)

    monkeypatch.setattr(RowArena, "__init__", counted)
    layouts = []
    reshape = DecodeRows._reshape

    def checked(self, count: int, capacity: int) -> None:
        reshape(self, count, capacity)
        layouts.append(self.keys.data_ptr())
        assert torch.isfinite(self.keys).all() and torch.isfinite(self.values).all()

    monkeypatch.setattr(DecodeRows, "_reshape", checked)
    settings = dict(
        max_num_seqs=3, num_kv_blocks=128, block_size=8, speculative="off", decode_kernel=False
    )
    all_ids, new = prompts(tokenizer, [10, 30, 10], seed=7), [200, 40, 150]
    texts = stream(Engine(model, tokenizer, **settings), all_ids, new)
    assert len(layouts) >= 3 and len(reserved) == 4  # keys and values, two arenas each
    flats = {a.flat.data_ptr() for a in reserved}
    assert set(layouts) <= flats and len(set(layouts)) == 2
    gathering(monkeypatch)
    assert stream(Engine(model, tokenizer, **settings), all_ids, new) == texts


def test_rows_the_kernel_reads_are_never_zeroed_and_stream_what_sdpa_streams(tiny) -> None:
    """The kernel reads each row only to its length: its layouts skip the zeroing (a page is
    first touched by the write that fills it), and the text is SDPA's over zeroed layouts."""
    model, tokenizer = tiny
    settings = dict(max_num_seqs=3, num_kv_blocks=128, block_size=8, speculative="off")
    all_ids, new = prompts(tokenizer, [10, 30, 10], seed=7), [200, 40, 150]
    engine = Engine(model, tokenizer, **settings)
    assert engine.runner.decode_kernel
    texts = stream(engine, all_ids, new)
    arenas = [arena for pair in engine.runner.rows._arenas for arena in pair]
    assert len(arenas) == 4 and all(arena.ready == 0 for arena in arenas)
    sdpa = Engine(model, tokenizer, decode_kernel=False, **settings)
    assert stream(sdpa, all_ids, new) == texts
    assert all(arena.ready > 0 for pair in sdpa.runner.rows._arenas for arena in pair)


def test_a_batch_that_would_outgrow_the_cache_gathers_instead(tiny, monkeypatch) -> None:
    model, tokenizer = tiny
    all_ids = prompts(tokenizer, [60, 1, 1, 1], seed=3)
    # enough blocks for the one long and three short sequences, not four rows as long as the first
    blocks = sum(-(-(len(ids) + 16) // 8) for ids in all_ids)
    settings = dict(max_num_seqs=4, num_kv_blocks=blocks, block_size=8)
    engine = Engine(model, tokenizer, **settings)
    texts = stream(engine, all_ids, [16] * 4)
    assert engine.runner.rows.keys is None, "the rows gave the batch up"
    gathering(monkeypatch)
    assert stream(Engine(model, tokenizer, **settings), all_ids, [16] * 4) == texts


def test_sequences_verifying_drafts_keep_their_rows(tiny) -> None:
    model, tokenizer = tiny
    all_ids = prompts(tokenizer, [10, 10, 10, 10], seed=5)
    engine = Engine(model, tokenizer, max_num_seqs=4, num_kv_blocks=64, block_size=8)
    texts = stream(engine, all_ids, [40] * 4)
    assert engine.stats().spec_draft_tokens > 0, "the tiny model's output should repeat itself"
    assert engine.runner.rows.copied_in == 4, "a verification step does not cost a copy-in"
    plain = Engine(
        model, tokenizer, max_num_seqs=4, num_kv_blocks=64, block_size=8, speculative="off"
    )
    assert stream(plain, all_ids, [40] * 4) == texts


def test_rows_on_cpu_are_float32_only_where_bfloat16_is_emulated(monkeypatch) -> None:
    """bfloat16 attention was 3-5x slower than float32 on a CPU without native bf16, and faster
    with it (SDPA over the rows' strided views); float32 caches keep float32 rows either way."""

    def rows(dtype: torch.dtype) -> torch.dtype:
        cache = KVCache(CacheShape(2, 2, 8, dtype), 4, 4, torch.device("cpu"))
        return DecodeRows(cache).dtype

    monkeypatch.setattr("workers.decode_rows.cpu_has_native_bf16", lambda: False)
    assert rows(torch.bfloat16) == torch.float32
    assert rows(torch.float32) == torch.float32
    monkeypatch.setattr("workers.decode_rows.cpu_has_native_bf16", lambda: True)
    assert rows(torch.bfloat16) == torch.bfloat16
    assert rows(torch.float32) == torch.float32


def test_row_runs_split_only_where_reading_fewer_positions_pays() -> None:
    lengths = [100, 100, 90, 90, 12, 10, 10, 9]
    assert row_runs(lengths, None) == [(0, 8, 100)]  # an accelerator: one run
    assert row_runs(lengths, 10_000) == [(0, 8, 100)]  # a run costs more than it saves
    # 800 positions in one run, 4 * 100 + 4 * 12 = 448 in two, 3 or 4 runs save too little more
    assert row_runs(lengths, 100) == [(0, 4, 100), (4, 8, 12)]
    # free runs: as many as allowed, contiguous, covering every row, each up to its longest
    runs = row_runs([5 * i for i in range(40, 0, -1)], 0)
    assert len(runs) == MAX_ROW_RUNS
    assert [a for a, _, _ in runs] == [0, *[b for _, b, _ in runs[:-1]]] and runs[-1][1] == 40
    assert all(reach == 5 * (40 - a) for a, _, reach in runs)
    assert row_runs([7], 0) == [(0, 1, 7)]


def test_a_wave_takes_its_rows_longest_first_and_runs_of_rows_stream_what_one_run_streams(
    tiny, monkeypatch
) -> None:
    """Rows laid out longest first make runs of near lengths; attending run by run, each only up
    to its own longest row, must stream what gathering blocks streams (SDPA's path: the CPU
    kernel reads each row to its own length and takes no runs)."""
    model, tokenizer = tiny
    all_ids = prompts(tokenizer, [3, 40, 9, 25, 1, 33], seed=11)
    settings = dict(
        max_num_seqs=6, num_kv_blocks=96, block_size=8, speculative="off", decode_kernel=False
    )
    engine = Engine(model, tokenizer, **settings)
    engine.runner.run_cost = 0  # every split that reads fewer positions is taken
    split: list[list[tuple[int, int, int]]] = []
    runs_of = row_runs

    def watched(lengths, run_cost):
        split.append(runs_of(lengths, run_cost))
        if len(split) == 1:  # the wave's first decode step: the rows as the wave took them
            held = engine.runner.rows.lengths
            assert held == sorted(held, reverse=True), held
        return split[-1]

    monkeypatch.setattr("workers.model_runner.row_runs", watched)
    texts = stream(engine, all_ids, [24, 30, 12, 24, 30, 18])
    assert max(len(runs) for runs in split) > 1
    assert any(reach < runs[0][2] for runs in split for _, _, reach in runs)
    gathering(monkeypatch)
    assert stream(Engine(model, tokenizer, **settings), all_ids, [24, 30, 12, 24, 30, 18]) == texts
