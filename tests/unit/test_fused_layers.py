"""Fused q/k/v and gate/up projections compute what the loaded model computes: same logits (within
rounding), the same greedy tokens through `generate` and through the engine, in float32 and
bfloat16; and fusing replaces only the Llama modules, once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.worker_lines import wire
from workers.engine import Engine
from workers.fused_layers import FusedGateUpMLP, FusedQKVAttention, fuse_projections
from workers.model_loader import load_model
from workers.request import EngineRequest
from workers.sampling_params import SamplingParams

PROMPTS = ["你好世界今天", "def add(a: int, b: int)", "Ça va très bien, merci ! Où", "🚀 🌍"]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request, tiny_model_dir):
    """(unfused, fused, tokenizer): two copies of the tiny model in one dtype."""
    model, tokenizer = load_model(tiny_model_dir, "cpu", request.param)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers
    return model, fused, tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy(model: nn.Module, ids: list[int], new: int = 24) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=new, min_new_tokens=new
        )
    return out[0, len(ids) :].tolist()


def test_fusing_replaces_each_layers_attention_and_mlp_once(pair) -> None:
    model, fused, _ = pair
    for layer in fused.model.layers:
        assert isinstance(layer.self_attn, FusedQKVAttention)
        assert isinstance(layer.mlp, FusedGateUpMLP)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    count = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in fused.parameters()) == count, "weights moved, none copied"
    assert fuse_projections(fused) == 0, "fusing twice is a no-op"


def test_fused_logits_match_the_loaded_model(pair) -> None:
    model, fused, tokenizer = pair
    ids = torch.tensor([encode(tokenizer, PROMPTS[0] + PROMPTS[1])])
    with torch.inference_mode():
        expected, got = model(ids).logits.float(), fused(ids).logits.float()
    tolerance = 1e-5 if model.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * 10)


def test_fused_generate_matches_the_loaded_model(pair) -> None:
    model, fused, tokenizer = pair
    for text in PROMPTS:
        ids = encode(tokenizer, text)
        assert greedy(fused, ids) == greedy(model, ids), text


def engine_texts(model: nn.Module, tokenizer) -> dict[str, str]:
    """What the engine streams for PROMPTS, greedy, 24 tokens each, all in one batch."""
    engine = Engine(model, tokenizer, max_num_seqs=4, num_kv_blocks=32, block_size=8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"r{i}", encode(tokenizer, text), params))
    texts = {f"r{i}": "" for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += "".join(
                e["text"] for e in wire(out.events) if e["type"] == "text"
            )
    return texts


def test_the_engine_fuses_and_streams_what_it_streams_unfused(pair, monkeypatch) -> None:
    model, _, tokenizer = pair
    fused_model = copy.deepcopy(model)
    fused = engine_texts(fused_model, tokenizer)
    assert isinstance(fused_model.model.layers[0].self_attn, FusedQKVAttention)
    monkeypatch.setattr("workers.model_runner.fuse_projections", lambda model: 0)
    plain_model = copy.deepcopy(model)
    assert engine_texts(plain_model, tokenizer) == fused
    assert not isinstance(plain_model.model.layers[0].self_attn, FusedQKVAttention)
    assert all(len(text) > 0 for text in fused.values())
