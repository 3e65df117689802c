"""The synchronous engine on the tiny model: greedy equals `generate`, aborts, limits, n, errors."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.support.worker_lines import wire
from wire.sampling_params import SamplingParams
from workers.engine import Engine
from workers.request import EngineRequest

PROMPTS = ["你好世界", "Hello world", "def add(a, b):", "Ça va très bien", "🚀 emoji"]


@pytest.fixture
def engine(tiny) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, max_num_seqs=8)


@dataclass
class Result:
    """Everything one request streamed, grouped per choice."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def text(self, index: int = 0) -> str:
        return "".join(e["text"] for e in self.of("text") if e["index"] == index)

    def finish(self, index: int = 0) -> dict[str, Any]:
        [event] = [e for e in self.of("finish") if e["index"] == index]
        return event

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def submit(engine: Engine, request_id: str, ids: list[int], **params: Any) -> None:
    engine.add_request(EngineRequest(request_id, ids, SamplingParams(**params)))


def run(engine: Engine, results: dict[str, Result] | None = None) -> dict[str, Result]:
    results = results if results is not None else defaultdict(Result)
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].events.extend(wire(out.events))
    return results


def test_greedy_equals_transformers_generate_token_for_token(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_num_seqs=3)  # 5 prompts: some wait their turn
    all_ids = [prompt_ids(tokenizer, p) for p in PROMPTS]
    for i, ids in enumerate(all_ids):
        submit(engine, f"r{i}", ids, max_tokens=24, temperature=0.0)
    results = run(engine)
    for i, ids in enumerate(all_ids):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)
        generated = out[0, len(ids) :].tolist()
        expected = tokenizer.decode(
            generated, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        result = results[f"r{i}"]
        assert result.text() == expected
        assert result.finish() == {
            "type": "finish",
            "index": 0,
            "reason": "length",
            "completion_tokens": len(generated),
        }
        assert sum(e["tokens"] for e in result.of("text")) == len(generated) == 24
        assert result.events[-1] == {
            "type": "usage",
            "prompt_tokens": len(ids),
            "completion_tokens": 24,
        }


def test_abort_mid_decode_stops_at_the_next_step(engine: Engine, tiny) -> None:
    ids = prompt_ids(tiny[1], "Hello")
    submit(engine, "a", ids, max_tokens=50, temperature=0.0)
    submit(engine, "b", ids, max_tokens=10, temperature=0.0)
    results: dict[str, Result] = defaultdict(Result)
    for _ in range(4):
        for out in engine.step():
            results[out.request_id].events.extend(wire(out.events))
    assert engine.abort("a") is True
    assert engine.abort("a") is True  # idempotent while pending
    outputs = {out.request_id: out for out in engine.step()}
    assert outputs["a"].finished
    finish, usage = wire(outputs["a"].events)
    assert finish["stop_latency_ms"] >= 0
    assert {k: v for k, v in finish.items() if k != "stop_latency_ms"} == {
        "type": "finish",
        "index": 0,
        "reason": "abort",
        "completion_tokens": 4,
        "tail_tokens": 0,
    }
    assert usage == {"type": "usage", "prompt_tokens": len(ids), "completion_tokens": 4}
    assert engine.abort("a") is False  # finished: a no-op
    assert engine.abort("never-seen") is False
    run(engine, results)
    assert results["b"].finish()["reason"] == "length"
    assert "a" not in {out.request_id for out in engine.step()}


def test_abort_of_a_waiting_request(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_num_seqs=1)
    ids = prompt_ids(tokenizer, "Hi")
    submit(engine, "first", ids, max_tokens=5, temperature=0.0)
    submit(engine, "second", ids, max_tokens=5, temperature=0.0)
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (1, 1)
    engine.abort("second")
    outputs = {out.request_id: out for out in engine.step()}
    finish = wire(outputs["second"].events)[0]
    assert (finish["type"], finish["reason"], finish["completion_tokens"]) == ("finish", "abort", 0)
    assert finish["tail_tokens"] == 0
    assert (engine.stats().running, engine.stats().waiting) == (1, 0)


def test_fifo_admission_up_to_max_num_seqs(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_num_seqs=2)
    ids = prompt_ids(tokenizer, "Hi")
    submit(engine, "x", ids, max_tokens=3, temperature=0.0, n=2)
    submit(engine, "y", ids, max_tokens=3, temperature=0.0)
    assert {out.request_id for out in engine.step()} <= {"x"}
    assert (engine.stats().running, engine.stats().waiting) == (1, 1)
    results = run(engine)
    assert results["y"].finish()["completion_tokens"] == 3


def test_max_tokens_gives_length_with_exactly_that_many_tokens(engine: Engine, tiny) -> None:
    ids = prompt_ids(tiny[1], "Count")
    submit(engine, "r", ids, max_tokens=7, temperature=0.9, seed=1, ignore_eos=True)
    result = run(engine)["r"]
    assert result.finish() == {
        "type": "finish",
        "index": 0,
        "reason": "length",
        "completion_tokens": 7,
    }


def test_n_two_streams_two_choices(engine: Engine, tiny) -> None:
    ids = prompt_ids(tiny[1], "Once upon")
    submit(engine, "r", ids, max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True)
    result = run(engine)["r"]
    assert [result.finish(i)["completion_tokens"] for i in (0, 1)] == [12, 12]
    assert result.text(0) != result.text(1)
    assert result.events[-1] == {
        "type": "usage",
        "prompt_tokens": len(ids),
        "completion_tokens": 24,
    }


def test_seeded_request_is_the_same_alone_or_in_company(tiny) -> None:
    model, tokenizer = tiny
    ids = prompt_ids(tokenizer, "Seeded")
    alone = Engine(model, tokenizer)
    submit(alone, "s", ids, max_tokens=15, temperature=0.8, top_p=0.9, seed=11)
    crowd = Engine(model, tokenizer)
    submit(crowd, "noise1", ids, max_tokens=20, temperature=1.0)
    submit(crowd, "s", ids, max_tokens=15, temperature=0.8, top_p=0.9, seed=11)
    submit(crowd, "noise2", prompt_ids(tokenizer, "other"), max_tokens=5, temperature=1.0)
    assert run(alone)["s"].text() == run(crowd)["s"].text()


def test_stop_string_cuts_the_text_before_it(engine: Engine, tiny) -> None:
    ids = prompt_ids(tiny[1], "Hello world")
    submit(engine, "plain", ids, max_tokens=30, temperature=0.0)
    full = run(engine)["plain"].text()
    stop = full[10:13]
    submit(engine, "stopped", ids, max_tokens=30, temperature=0.0, stop=[stop])
    result = run(engine)["stopped"]
    assert result.text() == full[: full.index(stop)]
    assert result.finish()["reason"] == "stop"


def test_stop_token_id_ends_without_its_text(engine: Engine, tiny) -> None:
    ids = prompt_ids(tiny[1], "Hello world")
    submit(engine, "plain", ids, max_tokens=1, temperature=0.0)
    run(engine)
    first_token = engine.runner.model(torch.tensor([ids])).logits[0, -1].argmax().item()
    submit(engine, "r", ids, max_tokens=10, temperature=0.0, stop_token_ids=[first_token])
    result = run(engine)["r"]
    # no text, but the token is on a line: its count and id add up to the usage
    assert [(e["text"], e["tokens"], e["ids"]) for e in result.of("text")] == [
        ("", 1, [first_token])
    ]
    assert result.finish() == {
        "type": "finish",
        "index": 0,
        "reason": "stop",
        "completion_tokens": 1,
    }


def test_logprobs_ride_on_the_text_lines_that_carry_their_tokens(engine: Engine, tiny) -> None:
    ids = prompt_ids(tiny[1], "Hello")
    submit(engine, "r", ids, max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=2)
    for event in run(engine)["r"].of("text"):
        assert len(event["logprobs"]) == event["tokens"]
        assert all(len(entry["top_logprobs"]) == 2 for entry in event["logprobs"])


def test_a_failing_forward_fails_its_step_and_the_loop_goes_on(
    engine: Engine, tiny, monkeypatch
) -> None:
    ids = prompt_ids(tiny[1], "Hello")
    execute = engine.runner.execute
    calls = []

    def fails_once(work):
        calls.append(len(work))
        if len(calls) == 2:
            raise RuntimeError("boom")
        return execute(work)

    monkeypatch.setattr(engine.runner, "execute", fails_once)
    submit(engine, "early", ids, max_tokens=5, temperature=0.0)
    engine.step()  # "early" prefills alone
    submit(engine, "late", ids, max_tokens=5, temperature=0.0)
    results = run(engine)  # the next step (both requests) fails
    error = {"type": "error", "code": "engine_error", "message": "the model failed on this request"}
    assert results["early"].events[-1] == error
    assert results["late"].events == [{"type": "admitted"}, error]  # scheduled, then failed
    submit(engine, "after", ids, max_tokens=5, temperature=0.0)
    assert run(engine)["after"].finish()["completion_tokens"] == 5
    assert engine.scheduler.blocks.num_used == 0
