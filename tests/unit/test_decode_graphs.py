"""Decode-only steps through the decode graphs' static buffers (workers/decode_graphs.py), on the
CPU with capture off: the buckets a step is padded to, pad rows that write only the scratch block,
a static buffer rewritten whole each step, and greedy output equal to the eager path's and to
`generate`'s while sequences join and leave."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from common.worker_settings import load_worker_config
from tests.support.model_equivalence import greedy, stream_texts
from tests.unit.test_decode_rows import prompts
from workers.decode_graphs import (
    PAD_TOKEN,
    DecodeGraphs,
    batch_buckets,
    bucket_for,
    context_buckets,
    graph_plan,
)
from workers.engine import Engine

SENTINEL = 7.0  # what the scratch block holds before pad rows write it
SETTINGS = dict(block_size=8, num_kv_blocks=64, speculative="off")


def recorded_runs(monkeypatch) -> list[dict]:
    """From now on each static-buffer step is recorded: its decodes (with their positions and
    block tables), its bucket pair, the inputs its slot read, the cache's keys before and after."""
    run, runs = DecodeGraphs.run, []

    def spy(self, decodes):
        before = self.cache.keys.clone()
        logits = run(self, decodes)
        slot = self._slot(decodes)
        runs.append(
            dict(
                decodes=[
                    (s.all_ids[s.num_computed_tokens], s.num_computed_tokens) for s in decodes
                ],
                tables=[list(s.block_table) for s in decodes],
                bucket=(slot.batch, slot.blocks),
                inputs=(slot.ids[0].tolist(), slot.positions[0].tolist(), slot.slots.tolist()),
                read=slot.tables.view(slot.batch, slot.blocks).tolist(),
                before=before,
                after=self.cache.keys.clone(),
            )
        )
        assert logits.shape[0] == len(decodes)
        return logits

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    return runs


def test_batch_buckets_double_with_midpoints_and_end_at_max_num_seqs():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(1) == [1]
    assert [bucket_for(batch_buckets(64), n) for n in (1, 3, 5, 9, 17, 25, 33, 49)] == [
        1,
        4,
        8,
        16,
        24,
        32,
        48,
        64,
    ]
    with pytest.raises(ValueError):
        bucket_for(batch_buckets(64), 65)


def test_context_buckets_are_powers_of_two_up_to_a_sequences_most_blocks():
    assert context_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert context_buckets(10) == [1, 2, 4, 8, 10]
    assert [bucket_for(context_buckets(10), n) for n in (1, 3, 8, 9)] == [1, 4, 8, 10]


def test_graphs_are_planned_for_cuda_and_ignored_on_a_cpu_unless_forced(tiny):
    model, tokenizer = tiny
    cuda = graph_plan(torch.device("cuda"), True, False, 16, 2048, 16)
    assert cuda is not None and cuda.capture and cuda.contexts[-1] == 128
    assert graph_plan(torch.device("cuda"), False, False, 16, 2048, 16) is None
    assert graph_plan(torch.device("cpu"), True, False, 16, 2048, 16) is None
    engine = Engine(model, tokenizer, cuda_graphs=True, **SETTINGS)
    assert engine.runner.graphs is None and engine.cache.scratch_block is None
    forced = Engine(model, tokenizer, static_decode=True, **SETTINGS)
    assert not forced.runner.graphs.plan.capture
    assert forced.cache.scratch_block == 64  # one block past what the block manager hands out
    assert forced.scheduler.blocks.num_blocks == 64


def test_the_worker_flag_turns_graphs_off_and_the_engine_gets_it():
    assert load_worker_config(["--port", "1"], {}).engine_kwargs("cuda")["cuda_graphs"] is True
    off = load_worker_config(["--port", "1", "--no-cuda-graphs"], {})
    assert off.engine_kwargs("cuda")["cuda_graphs"] is False
    from_env = load_worker_config(["--port", "1"], {"SLUICE_CUDA_GRAPHS": "false"})
    assert from_env.cuda_graphs is False


def test_pad_rows_write_only_the_scratch_block_and_stale_rows_never_leak(tiny, monkeypatch):
    model, tokenizer = tiny
    runs = recorded_runs(monkeypatch)
    engine = Engine(model, tokenizer, max_num_seqs=8, static_decode=True, **SETTINGS)
    # seven sequences (bucket 8) that leave one by one: 7, 6, 5 rows all pad to 8 then 4
    bs, scratch = engine.cache.block_size, engine.cache.scratch_block
    engine.cache.keys[:, :, scratch * bs : (scratch + 1) * bs] = SENTINEL
    all_ids = prompts(tokenizer, [3, 5, 2, 8, 4, 6, 3])
    stream_texts(engine, all_ids, [4 + 2 * i for i in range(7)])
    sizes = [(len(r["decodes"]), r["bucket"][0]) for r in runs]
    assert (7, 8) in sizes and (5, 8) in sizes and (3, 4) in sizes and (1, 1) in sizes
    for r in runs:
        (batch, blocks), decodes = r["bucket"], r["decodes"]
        pads = batch - len(decodes)
        slots = [t[p // bs] * bs + p % bs for t, (_, p) in zip(r["tables"], decodes, strict=True)]
        # what the slot read is this step's rows, then pads: nothing of an earlier, larger step
        ids, positions, read_slots = r["inputs"]
        assert ids == [token for token, _ in decodes] + [PAD_TOKEN] * pads
        assert positions == [p for _, p in decodes] + [0] * pads
        assert read_slots == slots + [scratch * bs] * pads
        expected = [t[:blocks] + [scratch] * (blocks - len(t[:blocks])) for t in r["tables"]]
        assert r["read"] == expected + [[scratch] * blocks] * pads
        # in the cache, only this step's slots and the scratch block changed
        moved = (r["after"] != r["before"]).any(dim=3).any(dim=1).any(dim=0)
        changed = set(moved.nonzero().flatten().tolist())
        scratch_slots = set(range(scratch * bs, (scratch + 1) * bs))
        assert changed - scratch_slots == set(slots)
        assert changed & scratch_slots <= {scratch * bs}  # a pad row writes position 0
    keys = engine.cache.keys[:, :, scratch * bs : (scratch + 1) * bs]
    assert (keys[:, :, 0] != SENTINEL).all(), "pad rows wrote their slot"
    assert (keys[:, :, 1:] == SENTINEL).all(), "and no other"


def run_texts(model, tokenizer, **settings) -> tuple[dict[str, str], Engine]:
    """Twelve greedy requests, six at a time: they join as others leave."""
    engine = Engine(model, tokenizer, max_num_seqs=6, max_num_batched_tokens=48, **settings)
    lengths = [random.Random(i).randint(1, 20) for i in range(12)]
    all_ids = prompts(tokenizer, lengths)
    return stream_texts(engine, all_ids, [6 + 3 * i for i in range(12)]), engine


@pytest.mark.parametrize("speculative", ["off", "prompt-lookup"])
def test_greedy_output_through_the_static_buffers_is_the_eager_paths_and_generates(
    tiny, speculative
):
    model, tokenizer = tiny
    settings = dict(block_size=8, num_kv_blocks=96, speculative=speculative)
    static, engine = run_texts(model, tokenizer, static_decode=True, **settings)
    eager, plain = run_texts(model, tokenizer, **settings)
    assert plain.runner.graphs is None
    assert engine.runner.graphs.replays > 20, "most steps should be decode-only"
    assert len(engine.runner.graphs.slots) > 2, "several bucket pairs should have been used"
    assert static == eager
    all_ids = prompts(tokenizer, [random.Random(i).randint(1, 20) for i in range(12)])
    for i, ids in enumerate(all_ids):
        expected = tokenizer.decode(
            greedy(model, ids, 6 + 3 * i),
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
        assert static[f"r{i}"] == expected, f"r{i}"
    assert engine.scheduler.blocks.num_used == 0


class FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the slot's step."""

    def __init__(self, slot) -> None:
        self.replay = slot.compute


def test_each_bucket_pair_is_captured_once_then_replayed(tiny, monkeypatch):
    model, tokenizer = tiny
    captured = []

    def capture(self, slot):
        captured.append((slot.batch, slot.blocks))
        return FakeGraph(slot)

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    settings = dict(block_size=8, num_kv_blocks=96, speculative="off")
    engine = Engine(model, tokenizer, max_num_seqs=6, static_decode=True, **settings)
    graphs = engine.runner.graphs
    graphs.plan = dataclasses.replace(graphs.plan, capture=True)
    all_ids = prompts(tokenizer, [random.Random(i).randint(1, 20) for i in range(12)])
    texts = stream_texts(engine, all_ids, [6 + 3 * i for i in range(12)])
    assert sorted(captured) == sorted(set(captured)) == sorted(graphs.slots)
    assert graphs.graph_count == len(captured) and graphs.replays > len(captured)
    eager, _ = run_texts(model, tokenizer, **settings)
    assert texts == eager
