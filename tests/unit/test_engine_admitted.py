"""The `admitted` line: once per request, in the step that first schedules it, before any text;
never again after a preemption or for the other choices of `n`."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tests.support.worker_lines import wire
from wire.sampling_params import SamplingParams
from workers.engine import Engine
from workers.request import EngineRequest

ADMITTED = {"type": "admitted"}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def submit(engine: Engine, request_id: str, ids: list[int], **params: Any) -> None:
    engine.add_request(EngineRequest(request_id, ids, SamplingParams(**params)))


def run(engine: Engine) -> dict[str, list[dict[str, Any]]]:
    events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            events[out.request_id].extend(wire(out.events))
    return events


def assert_admitted_once_first(events: list[dict[str, Any]]) -> None:
    """The request's first line (so before any text) is `admitted`, and no other is."""
    types = [e["type"] for e in events]
    assert events[0] == ADMITTED, types
    assert types.count("admitted") == 1, types
    assert "text" in types, types


def test_admitted_comes_once_in_the_first_scheduled_step_before_text(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_num_seqs=1)
    ids = encode(tokenizer, "Hello")
    submit(engine, "first", ids, max_tokens=3, temperature=0.0, ignore_eos=True)
    submit(engine, "second", ids, max_tokens=3, temperature=0.0, ignore_eos=True)
    step = {out.request_id: wire(out.events) for out in engine.step()}
    assert list(step) == ["first"]  # "second" waits for the only slot: no line yet
    assert step["first"][0] == ADMITTED and step["first"][1]["type"] == "text"
    events = defaultdict(list, {"first": step["first"]})
    for request_id, more in run(engine).items():
        events[request_id] += more
    assert_admitted_once_first(events["first"])
    assert_admitted_once_first(events["second"])


def test_chunked_prefill_is_admitted_in_its_first_chunk(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    ids = encode(tokenizer, " ".join(["café", "world", "数据"] * 12))
    assert len(ids) > 32, "the prompt must need several prefill chunks"
    submit(engine, "r", ids, max_tokens=4, temperature=0.0, ignore_eos=True)
    (first,) = engine.step()
    assert wire(first.events) == [ADMITTED]  # computing the prompt, nothing to say yet
    assert_admitted_once_first(wire(first.events) + run(engine)["r"])


def test_n_3_is_admitted_once(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, num_kv_blocks=64, block_size=8)
    ids = encode(tokenizer, "Once upon")
    submit(engine, "r", ids, max_tokens=6, n=3, temperature=1.0, seed=5, ignore_eos=True)
    events = run(engine)["r"]
    assert_admitted_once_first(events)
    assert {e["index"] for e in events if e["type"] == "finish"} == {0, 1, 2}


def test_a_preempted_request_is_not_admitted_again(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(
        model, tokenizer, max_num_seqs=16, num_kv_blocks=24, block_size=8, max_num_batched_tokens=96
    )
    preempted: set[str] = set()
    preempt = engine.scheduler._preempt

    def recording(seq, reason):
        preempted.add(seq.request_id)
        return preempt(seq, reason)

    engine.scheduler._preempt = recording
    words = ["你好", "world", "café", "🚀", "naïve", "数据"]
    for i in range(16):
        ids = encode(tokenizer, " ".join(words[: 1 + i % 6]))
        n = 2 if i % 4 == 0 else 1
        submit(engine, f"r{i}", ids, max_tokens=20, n=n, temperature=0.0, ignore_eos=True)
    events = run(engine)
    assert preempted, "the pool should be small enough to preempt"
    for i in range(16):
        assert_admitted_once_first(events[f"r{i}"])


def test_a_request_aborted_in_the_queue_is_never_admitted(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_num_seqs=1)
    ids = encode(tokenizer, "Hi")
    submit(engine, "running", ids, max_tokens=5, temperature=0.0)
    submit(engine, "queued", ids, max_tokens=5, temperature=0.0)
    engine.step()
    engine.abort("queued")
    events = run(engine)
    assert [e["type"] for e in events["queued"]] == ["finish", "usage"]
