"""The engine's own Llama forward computes what the model's module forward computes: every step's
logits, through decodes (over the decode rows and by gathering blocks), draft verifications,
long and continued prefill chunks; bitwise, in float32 and in bfloat16 (where a norm rounded
once instead of twice, as `F.rms_norm` does, turned the default model's answers to nonsense).
Models it does not know keep the module forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.support.model_equivalence import stream_texts, texts_with_and_without
from tests.unit.test_decode_rows import gathering, prompts
from workers.engine import Engine
from workers.llama_forward import lean_forward, llama_rms_norm
from workers.model_loader import load_model
from workers.model_runner import ModelRunner


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tiny_model_dir):
    return load_model(tiny_model_dir, "cpu", request.param)


def both_ways(monkeypatch) -> list[int]:
    """From now on every step runs twice, the module forward first (its K/V writes are then
    overwritten by the same step's), and both logits must agree; returns the rows compared."""
    execute = ModelRunner.execute
    compared = []

    def twice(self, work):
        lean, self.lean = self.lean, None
        try:
            expected = execute(self, work)
        finally:
            self.lean = lean
        got = execute(self, work)
        assert got.samplers == expected.samplers
        assert torch.equal(got.logits, expected.logits)
        compared.append(got.logits.shape[0])
        return got

    monkeypatch.setattr(ModelRunner, "execute", twice)
    return compared


def run(model, tokenizer, **settings) -> Engine:
    engine = Engine(model, tokenizer, num_kv_blocks=48, block_size=8, **settings)
    assert engine.runner.lean is not None, "the tiny Llama takes the lean forward"
    # long prompts (chunked prefill, a chunk continuing one), short ones, and a repeated phrase
    # whose continuation prompt lookup drafts (verifications attend as short spans)
    all_ids = prompts(tokenizer, [40, 3, 12, 1])
    all_ids[3] = (
        all_ids[3] + tokenizer("ok ok ok ok ok ok ok ok", add_special_tokens=False)["input_ids"]
    )
    stream_texts(engine, all_ids, [20, 24, 12, 30])
    return engine


def test_every_step_matches_the_module_forward(model, monkeypatch) -> None:
    model, tokenizer = copy.deepcopy(model[0]), model[1]
    compared = both_ways(monkeypatch)
    engine = run(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=24)
    assert engine.runner.rows.copied_in > 0, "decodes went over the decode rows"
    assert engine.stats().spec_draft_tokens > 0, "drafts were verified"
    assert len(compared) > 20 and max(compared) > 1


def test_gathered_decodes_match_the_module_forward(model, monkeypatch) -> None:
    model, tokenizer = copy.deepcopy(model[0]), model[1]
    gathering(monkeypatch)
    compared = both_ways(monkeypatch)
    engine = run(model, tokenizer, max_num_seqs=4, max_num_batched_tokens=24)
    assert engine.runner.rows.copied_in == 0
    assert len(compared) > 20


def test_the_engine_streams_what_it_streams_through_the_modules(
    tiny_model_dir, monkeypatch
) -> None:
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")  # not yet packed in place
    (lean, lean_model), (plain, _) = texts_with_and_without(
        model, tokenizer, monkeypatch, "lean_forward", lambda model: None
    )
    assert lean == plain
    assert lean_forward(lean_model) is not None, "the first engine took the lean forward"


def test_models_it_does_not_know_keep_the_module_forward(tiny_model_dir) -> None:
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")
    assert lean_forward(model) is None, "unfused layers"
    engine = Engine(model, tokenizer, num_kv_blocks=16, block_size=8)
    assert engine.runner.lean is not None, "the engine fuses first"
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert lean_forward(model) is None, "another activation"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_transformers_own_bit_for_bit(dtype) -> None:
    """At the default model's width, with a residual stream of its range (up to ~25,000)."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x = (torch.randn(2, 37, 576) * torch.logspace(0, 4, 576)).to(dtype)
    assert torch.equal(llama_rms_norm(x, (576,), norm.weight, norm.variance_epsilon), norm(x))
