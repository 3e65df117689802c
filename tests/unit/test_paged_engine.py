"""The paged engine on the tiny model: exact greedy output under preemption, prefix caching,
`n` sharing one prefill, aborts at step boundaries, and no leaked blocks."""

from __future__ import annotations

import random
import time
from collections import defaultdict

import torch

from tests.support.worker_lines import wire
from wire.sampling_params import SamplingParams
from workers.engine import Engine
from workers.model_runner import ModelRunner
from workers.request import EngineRequest

WORDS = ["你好", "world", "café", "🚀", "def f(x):", "naïve", "über", "数据", "ok", "straße"]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; every third prompt extends a shared preamble."""
    rng = random.Random(seed)
    preamble = " ".join(WORDS * 3)
    out = []
    for i in range(count):
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        out.append(encode(tokenizer, f"{preamble} {body}" if i % 3 == 0 else body))
    return out


def submit(engine: Engine, request_id: str, ids: list[int], **params) -> None:
    engine.add_request(EngineRequest(request_id, ids, SamplingParams(**params)))


def run(engine: Engine) -> dict[str, list[dict]]:
    events: dict[str, list[dict]] = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            events[out.request_id].extend(wire(out.events))
    return events


def text_of(events: list[dict], index: int = 0) -> str:
    return "".join(e["text"] for e in events if e["type"] == "text" and e["index"] == index)


def assert_no_leaks(engine: Engine) -> None:
    assert engine.scheduler.blocks.num_used == 0
    assert all(b.ref_count == 0 for b in engine.scheduler.blocks.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_32_prompts_at_once_match_generate_even_with_preemption(tiny):
    model, tokenizer = tiny
    engine = Engine(
        model, tokenizer, max_num_seqs=32, num_kv_blocks=48, block_size=8, max_num_batched_tokens=96
    )
    all_ids = prompts(tokenizer, 32)
    for i, ids in enumerate(all_ids):
        submit(engine, f"r{i}", ids, max_tokens=20, temperature=0.0, ignore_eos=True)
    events = run(engine)
    assert engine.stats().preemptions_total > 0, "the pool should be small enough to preempt"
    for i, ids in enumerate(all_ids):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=20, min_new_tokens=20
            )
        expected = tokenizer.decode(
            out[0, len(ids) :], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert text_of(events[f"r{i}"]) == expected, f"r{i}"
        finish = [e for e in events[f"r{i}"] if e["type"] == "finish"]
        assert finish[0]["completion_tokens"] == 20
    assert_no_leaks(engine)


def test_a_one_token_chunk_in_the_middle_of_a_prompt_is_prefill(tiny, monkeypatch):
    """Seven decodes leave a budget of 8 one token for the long prompt, step after step: each
    such chunk computes a prompt token and samples nothing (a decode would have sampled, and
    the prompt's text would start too early)."""
    model, tokenizer = tiny
    middles = []
    execute = ModelRunner.execute

    def watching(self, work):
        middles.extend(
            s for s, n in work if n == 1 and 0 < s.num_computed_tokens < s.prompt_len - 1
        )
        return execute(self, work)

    monkeypatch.setattr(ModelRunner, "execute", watching)
    engine = Engine(
        model, tokenizer, max_num_seqs=8, num_kv_blocks=64, block_size=8, max_num_batched_tokens=8
    )
    short = [encode(tokenizer, word) for word in WORDS[:7]]
    long = encode(tokenizer, " ".join(WORDS * 2))
    for i, ids in enumerate(short):
        submit(engine, f"s{i}", ids, max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.step()  # the short prompts decode before the long one arrives
    submit(engine, "long", long, max_tokens=12, temperature=0.0, ignore_eos=True)
    events = run(engine)
    assert any(s.request_id == "long" for s in middles), "the long prompt got one-token chunks"
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([long]), do_sample=False, max_new_tokens=12, min_new_tokens=12
        )
    expected = tokenizer.decode(
        out[0, len(long) :], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert text_of(events["long"]) == expected
    assert next(e for e in events["long"] if e["type"] == "finish")["completion_tokens"] == 12
    assert_no_leaks(engine)


def test_a_repeated_prompt_hits_the_prefix_cache_and_computes_only_new_tokens(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8)
    ids = prompts(tokenizer, 1)[0]
    submit(engine, "first", ids, max_tokens=4, temperature=0.0)
    first = run(engine)
    hits = engine.stats().prefix_cache_hits
    submit(engine, "again", ids, max_tokens=4, temperature=0.0)
    (out,) = engine.step()
    cached = (len(ids) - 1) // 8 * 8
    assert engine.stats().prefix_cache_hits == hits + cached
    assert engine.stats().last_step_tokens == len(ids) - cached
    again = wire(out.events) + run(engine)["again"]
    assert text_of(again) == text_of(first["first"])
    assert_no_leaks(engine)


def test_a_shared_prefix_is_found_under_another_salt_and_nothing_after_it(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8)
    ids = prompts(tokenizer, 1)[0]
    assert len(ids) > 40

    def ask(request_id: str, salt: str, shared: int, n: int = 1) -> tuple[int, str]:
        hits = engine.stats().prefix_cache_hits
        params = SamplingParams(max_tokens=4, temperature=0.0, n=n)
        request = EngineRequest(request_id, ids, params, cache_salt=salt, shared_prefix_len=shared)
        engine.add_request(request)
        events = run(engine)[request_id]
        return engine.stats().prefix_cache_hits - hits, text_of(events, n - 1)

    first, text = ask("acme", "tenant-acme", 21, n=2)  # n > 1: forked choices, as ever
    assert first == 0
    assert ask("globex", "tenant-globex", 21) == (16, text)  # 21 tokens: two whole blocks
    assert ask("acme-again", "tenant-acme", 21)[0] == (len(ids) - 1) // 8 * 8  # all its own
    assert ask("undeclared", "tenant-initech", 0)[0] == 0  # the same tokens, not declared
    assert_no_leaks(engine)


def test_n_3_shares_one_prompt_prefill(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8)
    work = []
    execute = engine.runner.execute

    def recording(batch):
        work.extend((seq.index, new) for seq, new in batch)
        return execute(batch)

    engine.runner.execute = recording
    ids = prompts(tokenizer, 1)[0]
    submit(engine, "r", ids, max_tokens=6, n=3, temperature=1.0, seed=5, ignore_eos=True)
    events = run(engine)["r"]
    assert next(new for index, new in work if index == 0) == len(ids)
    assert all(new == 1 for index, new in work if index > 0)
    finishes = sorted((e["index"], e["completion_tokens"]) for e in events if e["type"] == "finish")
    assert finishes == [(0, 6), (1, 6), (2, 6)]
    texts = {text_of(events, i) for i in range(3)}
    assert len(texts) > 1, "three seeded choices should not all be equal"
    assert events[-1] == {"type": "usage", "prompt_tokens": len(ids), "completion_tokens": 18}
    assert_no_leaks(engine)


def test_abort_mid_prefill_stops_at_the_next_step_without_a_token(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    ids = prompts(tokenizer, 1)[0]
    assert len(ids) > 32, "the prompt must need several prefill chunks"
    submit(engine, "r", ids, max_tokens=10, temperature=0.0)
    engine.step()
    engine.abort("r")
    (out,) = engine.step()
    finish, usage = wire(out.events)
    assert {k: finish[k] for k in ("type", "index", "reason", "completion_tokens")} == {
        "type": "finish",
        "index": 0,
        "reason": "abort",
        "completion_tokens": 0,
    }
    assert finish["tail_tokens"] == 0  # the abort arrived between steps
    assert 0 <= finish["stop_latency_ms"] < 5_000
    assert usage == {"type": "usage", "prompt_tokens": len(ids), "completion_tokens": 0}
    assert not engine.has_unfinished()
    assert_no_leaks(engine)


def test_abort_mid_decode_stops_within_one_step(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8)
    submit(engine, "r", encode(tokenizer, "hello"), max_tokens=100, ignore_eos=True)
    for _ in range(4):
        engine.step()
    generated = engine.stats().generated_tokens_total
    engine.abort("r")
    engine.abort("r")  # idempotent
    (out,) = engine.step()
    assert engine.stats().generated_tokens_total == generated
    assert wire(out.events)[0]["reason"] == "abort" and wire(out.events)[0]["tail_tokens"] == 0
    assert wire(out.events)[0]["completion_tokens"] == generated
    assert not engine.abort("r")  # finished: a no-op
    assert_no_leaks(engine)


def test_an_abort_that_arrived_during_a_step_counts_that_steps_token_as_tail(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8)
    submit(engine, "r", encode(tokenizer, "hello"), max_tokens=100, ignore_eos=True)
    engine.step()
    arrived = time.monotonic()  # the abort reaches the worker while the next step runs
    engine.step()
    engine.abort("r", arrived_at=arrived)
    (out,) = engine.step()
    assert wire(out.events)[0]["tail_tokens"] == 1
    assert wire(out.events)[0]["completion_tokens"] == 2


def test_random_aborts_over_200_requests_leak_no_blocks(tiny):
    model, tokenizer = tiny
    engine = Engine(
        model, tokenizer, max_num_seqs=16, num_kv_blocks=40, block_size=4, max_num_batched_tokens=64
    )
    rng = random.Random(1)
    all_ids = prompts(tokenizer, 200, seed=2)
    pending = list(enumerate(all_ids))
    live: list[str] = []
    finished = set()
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                i, ids = pending.pop()
                n = rng.choice([1, 1, 1, 2])
                submit(
                    engine,
                    f"r{i}",
                    ids[:60],
                    max_tokens=rng.randint(1, 12),
                    n=n,
                    temperature=rng.choice([0.0, 1.0]),
                    seed=i,
                )
                live.append(f"r{i}")
        if live and rng.random() < 0.3:
            engine.abort(rng.choice(live))
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
                live.remove(out.request_id)
    assert len(finished) == 200
    assert engine.stats().preemptions_total > 0
    assert_no_leaks(engine)
