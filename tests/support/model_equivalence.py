"""What a model rewrite (fused projections, packed weights) must leave unchanged: the logits
(within rounding), greedy `generate`, and what the engine streams."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.support.worker_lines import wire
from wire.sampling_params import SamplingParams
from workers.engine import Engine
from workers.request import EngineRequest

PROMPTS = ["你好世界今天", "def add(a: int, b: int)", "Ça va très bien, merci ! Où", "🚀 🌍"]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy(model: nn.Module, ids: list[int], new: int = 24) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=new, min_new_tokens=new
        )
    return out[0, len(ids) :].tolist()


def assert_same_logits(model: nn.Module, rewritten: nn.Module, tokenizer) -> None:
    ids = torch.tensor([encode(tokenizer, PROMPTS[0] + PROMPTS[1])])
    with torch.inference_mode():
        expected, got = model(ids).logits.float(), rewritten(ids).logits.float()
    tolerance = 1e-5 if model.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * 10)


def assert_same_greedy(model: nn.Module, rewritten: nn.Module, tokenizer) -> None:
    for text in PROMPTS:
        ids = encode(tokenizer, text)
        assert greedy(rewritten, ids) == greedy(model, ids), text


def stream_texts(engine: Engine, all_ids: list[list[int]], max_tokens: list[int]) -> dict[str, str]:
    """Submit every prompt at once (greedy) and return each request's streamed text."""
    for i, (ids, new) in enumerate(zip(all_ids, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", ids, params))
    texts = {f"r{i}": "" for i in range(len(all_ids))}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += "".join(
                e["text"] for e in wire(out.events) if e["type"] == "text"
            )
    return texts


def engine_texts(model: nn.Module, tokenizer) -> dict[str, str]:
    """What the engine streams for PROMPTS, greedy, 24 tokens each, all in one batch."""
    engine = Engine(model, tokenizer, max_num_seqs=4, num_kv_blocks=32, block_size=8)
    return stream_texts(engine, [encode(tokenizer, t) for t in PROMPTS], [24] * len(PROMPTS))


def texts_with_and_without(model: nn.Module, tokenizer, monkeypatch, rewrite: str, off):
    """(texts, engine's model) for an engine on a copy of `model`, then the same with the runner's
    `rewrite` (a name in workers.model_runner) replaced by `off`."""
    rewritten = copy.deepcopy(model)
    with_it = engine_texts(rewritten, tokenizer)
    monkeypatch.setattr(f"workers.model_runner.{rewrite}", off)
    plain = copy.deepcopy(model)
    without = engine_texts(plain, tokenizer)
    assert all(len(text) > 0 for text in with_it.values())
    return (with_it, rewritten), (without, plain)
