"""Fused q/k/v and gate/up projections compute what the loaded model computes: same logits (within
rounding), the same greedy tokens through `generate` and through the engine, in float32 and
bfloat16; and fusing replaces only the Llama modules, once."""

from __future__ import annotations

import copy

import pytest

from tests.support.model_equivalence import (
    assert_same_greedy,
    assert_same_logits,
    texts_with_and_without,
)
from workers.fused_layers import FusedGateUpMLP, FusedQKVAttention, fuse_projections
from workers.model_loader import load_model


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request, tiny_model_dir):
    """(unfused, fused, tokenizer): two copies of the tiny model in one dtype."""
    model, tokenizer = load_model(tiny_model_dir, "cpu", request.param)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers
    return model, fused, tokenizer


def test_fusing_replaces_each_layers_attention_and_mlp_once(pair) -> None:
    model, fused, _ = pair
    for layer in fused.model.layers:
        assert isinstance(layer.self_attn, FusedQKVAttention)
        assert isinstance(layer.mlp, FusedGateUpMLP)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    count = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in fused.parameters()) == count, "weights moved, none copied"
    assert fuse_projections(fused) == 0, "fusing twice is a no-op"


def test_fused_model_computes_what_the_loaded_model_computes(pair) -> None:
    model, fused, tokenizer = pair
    assert_same_logits(model, fused, tokenizer)
    assert_same_greedy(model, fused, tokenizer)


def test_the_engine_fuses_and_streams_what_it_streams_unfused(pair, monkeypatch) -> None:
    model, _, tokenizer = pair
    (fused, fused_model), (plain, plain_model) = texts_with_and_without(
        model, tokenizer, monkeypatch, "fuse_projections", lambda model: 0
    )
    assert plain == fused
    assert isinstance(fused_model.model.layers[0].self_attn, FusedQKVAttention)
    assert not isinstance(plain_model.model.layers[0].self_attn, FusedQKVAttention)
