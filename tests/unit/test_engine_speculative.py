"""Prompt-lookup speculation in the engine, on the tiny model: greedy output equals `generate`
token for token whether drafts are accepted or rejected; rejected tokens never reach the KV
cache's committed part, the stream or the counts; stops, max_tokens and aborts keep their meaning.

The tiny model's own output rarely repeats, so its drafts are rejected. A copy whose attention
output is scaled down (o_proj) leans on the last token alone and soon loops, which is the case
where drafts are accepted: at 0 nearly all of them, at a small scale some (attention still
counts, so a wrong KV slot would show as a wrong token).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from tests.support.worker_lines import wire
from wire.sampling_params import SamplingParams
from workers.engine import Engine
from workers.model_loader import load_model
from workers.request import EngineRequest

PROMPTS = ["你好世界", "Hello world", "def add(a, b):", "Ça va très bien", "🚀 emoji"]
SPEC_TOKENS = 4


@pytest.fixture(scope="module")
def looping(tiny_model_dir) -> tuple[Any, Any]:
    """The tiny model with no attention output: its greedy output soon loops."""
    return _attention_scaled(tiny_model_dir, 0.0)


@pytest.fixture(scope="module")
def damped(tiny_model_dir) -> tuple[Any, Any]:
    """The tiny model with a little attention output: drafts partly accepted."""
    return _attention_scaled(tiny_model_dir, 0.03)


def _attention_scaled(path, scale: float) -> tuple[Any, Any]:
    model, tokenizer = load_model(path, "cpu", "float32")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
    return model, tokenizer


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(model, ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new)
    return out[0, len(ids) :].tolist()


def engine_for(model, tokenizer, mode: str = "prompt-lookup", **kwargs: Any) -> Engine:
    return Engine(
        model, tokenizer, speculative=mode, spec_tokens=SPEC_TOKENS, max_num_seqs=8, **kwargs
    )


def run(engine: Engine, requests: dict[str, tuple[list[int], dict]]) -> dict[str, list[dict]]:
    for request_id, (ids, params) in requests.items():
        params = {"temperature": 0.0, **params}  # greedy unless said otherwise
        engine.add_request(EngineRequest(request_id, ids, SamplingParams(**params)))
    events: dict[str, list[dict]] = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            events[out.request_id].extend(wire(out.events))
    return events


def tokens_of(events: list[dict]) -> list[int]:
    return [i for e in events if e["type"] == "text" for i in e.get("ids") or []]


def summary(events: list[dict]) -> tuple[str, list[int], list[dict]]:
    """What a client sees, whatever the lines' grouping: text, token ids, finish and usage."""
    text = "".join(e["text"] for e in events if e["type"] == "text")
    return text, tokens_of(events), [e for e in events if e["type"] in ("finish", "usage")]


def assert_no_leaks(engine: Engine) -> None:
    blocks = engine.scheduler.blocks
    assert blocks.num_used == 0 and all(b.ref_count == 0 for b in blocks.blocks)


@pytest.mark.process
@pytest.mark.parametrize("kind", ["tiny", "damped", "looping"])
def test_greedy_with_speculation_equals_generate_token_for_token(request, kind) -> None:
    model, tokenizer = request.getfixturevalue(kind)
    engine = engine_for(model, tokenizer)
    # at most MAX_SPECULATING_DECODES at once: a larger batch does not speculate
    prompts = {f"r{i}": ids_of(tokenizer, p) for i, p in enumerate(PROMPTS[:4])}
    events = run(engine, {k: (ids, {"max_tokens": 40}) for k, ids in prompts.items()})
    for request_id, ids in prompts.items():
        assert tokens_of(events[request_id]) == generate(model, ids, 40), request_id
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0
    if kind == "looping":
        assert stats.spec_accepted_tokens > stats.spec_draft_tokens * 0.7
        assert stats.steps_total < 40  # several tokens per step
    elif kind == "damped":
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    else:
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.generated_tokens_total == 40 * len(prompts)
    assert_no_leaks(engine)


def test_rejected_drafts_never_count_as_computed_and_blocks_add_up(damped) -> None:
    model, tokenizer = damped
    engine = engine_for(model, tokenizer, block_size=4, num_kv_blocks=96)
    for i, text in enumerate(PROMPTS[:4]):
        params = SamplingParams(max_tokens=30 + i, temperature=0.0)
        engine.add_request(EngineRequest(f"r{i}", ids_of(tokenizer, text), params))
    blocks, multi_token_steps = engine.scheduler.blocks, 0
    while engine.has_unfinished():
        engine.step()
        held: set[int] = set()
        for seq in engine.scheduler.running:
            assert not seq.draft
            if seq.output_ids:  # every token but the newest is computed, nothing past it
                assert seq.num_computed_tokens == len(seq.all_ids) - 1
                assert seq.num_hashed_blocks <= seq.num_computed_tokens // 4
            need = blocks.blocks_for(len(seq.all_ids) - 1)  # the newest goes in next step
            assert need <= len(seq.block_table) <= blocks.blocks_for(len(seq.all_ids) + SPEC_TOKENS)
            multi_token_steps += seq.last_step_tokens > 1
            held.update(seq.block_table)
        assert blocks.num_used == len(held)
    assert multi_token_steps > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 11])
def test_max_tokens_is_never_exceeded_by_an_accepted_run(looping, max_tokens) -> None:
    model, tokenizer = looping
    ids = ids_of(tokenizer, PROMPTS[2])
    engine = engine_for(model, tokenizer)
    events = run(engine, {"r": (ids, {"max_tokens": max_tokens})})["r"]
    assert tokens_of(events) == generate(model, ids, max_tokens)
    assert [e for e in events if e["type"] == "finish"] == [
        {"type": "finish", "index": 0, "reason": "length", "completion_tokens": max_tokens}
    ]
    assert engine.stats().generated_tokens_total == max_tokens


def test_stops_inside_an_accepted_run_end_exactly_as_without_speculation(looping) -> None:
    model, tokenizer = looping
    ids = ids_of(tokenizer, PROMPTS[1])
    expected = generate(model, ids, 40)
    late = expected[25:]  # by then the output loops and drafts are accepted
    stop_string = tokenizer.decode(late[3:5])
    requests = {
        "token": (ids, {"max_tokens": 40, "stop_token_ids": [late[2]]}),
        "string": (ids, {"max_tokens": 40, "stop": [stop_string]}),
        "plain": (ids, {"max_tokens": 40}),
    }
    plain = run(engine_for(model, tokenizer, "off"), requests)
    speculated = engine_for(model, tokenizer)
    events = run(speculated, requests)
    for request_id in requests:
        assert summary(events[request_id]) == summary(plain[request_id]), request_id
    assert speculated.stats().spec_accepted_tokens > 0
    assert summary(events["token"])[2][0]["completion_tokens"] < 40
    assert stop_string not in summary(events["string"])[0]
    assert_no_leaks(speculated)


def test_sampled_requests_do_not_speculate_and_keep_their_seeded_tokens(looping) -> None:
    model, tokenizer = looping
    ids = ids_of(tokenizer, PROMPTS[0])
    params = {"max_tokens": 30, "temperature": 0.8, "seed": 7}
    plain = run(engine_for(model, tokenizer, "off"), {"r": (ids, params)})
    engine = engine_for(model, tokenizer)
    events = run(engine, {"r": (ids, params)})
    assert summary(events["r"]) == summary(plain["r"])
    assert engine.stats().spec_draft_tokens == 0


def test_an_abort_after_a_verified_step_counts_that_steps_tokens_as_tail(looping) -> None:
    model, tokenizer = looping
    engine = engine_for(model, tokenizer)
    engine.add_request(
        EngineRequest(
            "r", ids_of(tokenizer, PROMPTS[3]), SamplingParams(max_tokens=200, temperature=0)
        )
    )
    [seq] = engine.live["r"].sequences
    sent = 0
    while seq.last_step_tokens < 2:
        for out in engine.step():
            sent += len(tokens_of(wire(out.events)))
    tail = seq.last_step_tokens
    assert engine.abort("r", arrived_at=0.0)  # arrived while that step ran
    events = wire(engine.step()[0].events)
    finish = next(e for e in events if e["type"] == "finish")
    assert finish["reason"] == "abort" and finish["tail_tokens"] == tail
    assert finish["completion_tokens"] == sent + len(tokens_of(events))
    assert_no_leaks(engine)


def test_logprobs_of_accepted_tokens_are_those_of_one_token_steps(looping) -> None:
    model, tokenizer = looping
    ids = ids_of(tokenizer, PROMPTS[4])
    params = {"max_tokens": 30, "logprobs": True, "top_logprobs": 2}
    plain = run(engine_for(model, tokenizer, "off"), {"r": (ids, params)})["r"]
    engine = engine_for(model, tokenizer)
    events = run(engine, {"r": (ids, params)})["r"]

    def logprobs(lines: list[dict]) -> list[dict]:
        return [item for e in lines if e["type"] == "text" for item in e["logprobs"]]

    assert engine.stats().spec_accepted_tokens > 0
    assert len(logprobs(events)) == 30
    for ours, theirs in zip(logprobs(events), logprobs(plain), strict=True):
        assert ours["token"] == theirs["token"]
        assert ours["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)
        assert [t["token"] for t in ours["top_logprobs"]] == [
            t["token"] for t in theirs["top_logprobs"]
        ]
