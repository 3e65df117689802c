"""Embeddings through the engine's steps: the vector equals a plain forward pass's mean-pooled
final state however the input is chunked, batched beside decodes or preempted; the decodes'
output is untouched; nothing leaks, and an embedded text never enters the prefix cache."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from tests.support.loops import WORKERS_LOOP
from tests.support.waiting import until
from tests.unit.test_paged_engine import assert_no_leaks, encode, prompts, run, submit, text_of
from wire.share import Share
from workers.async_engine import AsyncEngine, EmbeddingFailed
from workers.embedding import EmbeddingJob, PooledLine
from workers.engine import Engine

EVENT_LOOP = WORKERS_LOOP  # the loop these tests run on

TEXTS = ["the cat sat on the mat " * 12, "你好 world café 🚀", "x", "数据 straße naïve " * 30]


def reference(
    model, ids: list[int], dimensions: int | None = None, pooling: str = "mean"
) -> torch.Tensor:
    """A whole-input forward pass of the model's decoder, pooled and normalised."""
    with torch.inference_mode():
        hidden = model.base_model(input_ids=torch.tensor([ids]), use_cache=False)
        states = hidden.last_hidden_state[0].float()
    pooled = {"mean": states.mean(dim=0), "cls": states[0], "last": states[-1]}[pooling]
    if dimensions is not None:
        pooled = pooled[:dimensions]
    return torch.nn.functional.normalize(pooled, dim=0)


def vectors(engine: Engine, jobs: list[EmbeddingJob]) -> dict[str, list[float]]:
    for job in jobs:
        engine.add_embedding(job)
    found: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            found.update(
                (out.request_id, e.vector) for e in out.events if isinstance(e, PooledLine)
            )
    return found


def assert_close(vector: list[float], expected: torch.Tensor) -> None:
    got = torch.tensor(vector)
    assert got.shape == expected.shape
    assert abs(float(got.norm()) - 1.0) < 1e-5
    assert torch.allclose(got, expected, atol=2e-5), float((got - expected).abs().max())


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "model-forward"])
def test_chunked_inputs_equal_a_whole_forward_pass(tiny, lean):
    model, tokenizer = tiny
    # a 24-token budget splits the long inputs into many chunks, several inputs per step
    engine = Engine(model, tokenizer, max_num_seqs=8, block_size=8, max_num_batched_tokens=24)
    if not lean:
        engine.runner.lean = None
    ids = [encode(tokenizer, t) for t in TEXTS]
    assert max(map(len, ids)) > 100
    jobs = [EmbeddingJob(f"e{i}", x, 16 if i == 1 else None) for i, x in enumerate(ids)]
    found = vectors(engine, jobs)
    for job in jobs:
        assert_close(found[job.request_id], reference(model, job.prompt_ids, job.dimensions))
    assert_no_leaks(engine)


def test_embeddings_beside_decodes_leave_their_output_unchanged(tiny):
    model, tokenizer = tiny
    chats = prompts(tokenizer, 6)

    def decode_all(with_embeddings: bool) -> dict:
        engine = Engine(model, tokenizer, max_num_seqs=12, block_size=8, max_num_batched_tokens=32)
        for i, ids in enumerate(chats):
            submit(engine, f"r{i}", ids, max_tokens=12, temperature=0.0, ignore_eos=True)
        if with_embeddings:
            for i, text in enumerate(TEXTS):
                engine.add_embedding(EmbeddingJob(f"e{i}", encode(tokenizer, text)))
        events = run(engine)
        assert_no_leaks(engine)
        return events

    alone, mixed = decode_all(False), decode_all(True)
    for i in range(len(chats)):
        assert text_of(mixed[f"r{i}"]) == text_of(alone[f"r{i}"])
    usage = [e for e in mixed["e0"] if e["type"] == "usage"]
    assert usage == [
        {"type": "usage", "prompt_tokens": len(encode(tokenizer, TEXTS[0])), "completion_tokens": 0}
    ]


def test_preempted_input_starts_over_and_still_matches(tiny):
    model, tokenizer = tiny
    # few blocks: the decodes' growth preempts the input being embedded
    engine = Engine(
        model, tokenizer, max_num_seqs=8, num_kv_blocks=40, block_size=8, max_num_batched_tokens=16
    )
    long_ids = encode(tokenizer, TEXTS[3])[:200]
    engine.add_embedding(EmbeddingJob("e", long_ids))  # first in: its blocks are taken first
    for i, ids in enumerate(prompts(tokenizer, 4)):
        submit(engine, f"r{i}", ids[:40], max_tokens=60, temperature=0.0, ignore_eos=True)
    found = vectors(engine, [])
    assert engine.stats().preemptions_total > 0, "the cache should be small enough to preempt"
    assert_close(found["e"], reference(model, long_ids))
    assert_no_leaks(engine)


def test_an_embedded_text_neither_takes_nor_leaves_prefix_cache_blocks(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, block_size=8)
    ids = encode(tokenizer, TEXTS[0])
    submit(engine, "warm", ids, max_tokens=1, temperature=0.0)  # caches the text's blocks
    run(engine)
    hits = engine.stats().prefix_cache_hits
    vectors(engine, [EmbeddingJob("e", ids)])
    assert engine.stats().prefix_cache_hits == hits
    cached = set(engine.scheduler.blocks.hash_to_block)
    engine2 = Engine(model, tokenizer, block_size=8)
    vectors(engine2, [EmbeddingJob("e", ids)])
    assert not engine2.scheduler.blocks.hash_to_block and cached


def test_refusals_and_aborts_free_everything(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, block_size=8, max_num_batched_tokens=16)
    with pytest.raises(ValueError) as refused:
        engine.add_embedding(EmbeddingJob("too-long", [1] * (engine.max_model_len + 1)))
    assert refused.value.param == "input"
    engine.add_embedding(EmbeddingJob("e", encode(tokenizer, TEXTS[3])))
    engine.step()
    assert engine.scheduler.blocks.num_used > 0
    assert engine.abort("e")
    outputs = engine.step()
    assert any(out.finished for out in outputs if out.request_id == "e")
    assert_no_leaks(engine)


async def test_async_embed_returns_in_order_and_a_cancelled_call_frees_its_inputs(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, block_size=8, max_num_batched_tokens=16)
    held, stepped, release = threading.Event(), threading.Event(), threading.Event()

    def hold_after_a_step(_seconds, _stats) -> None:  # on the engine thread
        if held.is_set():
            stepped.set()
            release.wait(10)

    loop = AsyncEngine(engine, on_step=hold_after_a_step)
    loop.start()
    try:
        ids = [encode(tokenizer, t) for t in TEXTS]
        jobs = [EmbeddingJob(f"a{i}", x) for i, x in enumerate(ids)]
        got = await loop.embed(jobs)
        for vector, x in zip(got, ids, strict=True):
            assert_close(vector, reference(model, x))
        held.set()
        call = asyncio.ensure_future(loop.embed([EmbeddingJob("b", ids[3] * 2)]))
        await until(stepped.is_set, "a first chunk computed")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        release.set()
        await until(lambda: not loop.holds("b"), "the abort taken at a step boundary")
        assert_no_leaks(engine)
        with pytest.raises(EmbeddingFailed):  # never computed: the engine refuses it
            await loop.embed([EmbeddingJob("c", [1] * (engine.max_model_len + 1))])
    finally:
        release.set()
        await loop.stop()


def declare(folder, config: dict) -> None:
    """A sentence-transformers folder's pooling declaration."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_a_folders_declared_pooling_is_the_one_computed(tiny, tmp_path, monkeypatch, pooling):
    model, tokenizer = tiny
    key = {"cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}[pooling]
    declare(
        tmp_path, {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": False, key: True}
    )
    monkeypatch.setattr(model.config, "_name_or_path", str(tmp_path))
    engine = Engine(model, tokenizer, block_size=8, max_num_batched_tokens=24)
    assert engine.pooling == pooling
    ids = encode(tokenizer, TEXTS[0])
    found = vectors(engine, [EmbeddingJob("e", ids)])
    assert_close(found["e"], reference(model, ids, pooling=pooling))


def test_a_pooling_sluicegate_does_not_compute_is_refused_at_start(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    declare(tmp_path, {"pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True})
    monkeypatch.setattr(model.config, "_name_or_path", str(tmp_path))
    with pytest.raises(ValueError, match="pooling"):
        Engine(model, tokenizer, block_size=8)


def test_an_input_takes_its_callers_share_into_the_schedule(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, block_size=8)
    share = Share("t-digest", 2.0, "flex")
    engine.add_embedding(EmbeddingJob("e", encode(tokenizer, TEXTS[1]), None, share))
    assert [s.share for s in engine.scheduler.waiting] == [share]
    vectors(engine, [])
    assert_no_leaks(engine)
