"""Linear layers packed for oneDNN (or, float32 on an AMX CPU, packed for MKL's GEMM, or with
their weights transposed for the BLAS where torch has no MKL) compute what the loaded model
computes: same logits (within rounding), the same greedy tokens through `generate` and through
the engine; the engine packs only where it was measured to pay (CPU: bfloat16 with native
support, float32 on AVX2 and on AVX-512 without AMX, float32 for MKL on AMX), and a tied output
projection leaves the embedding it shares untouched."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from tests.support.model_equivalence import (
    assert_same_greedy,
    assert_same_logits,
    texts_with_and_without,
)
from workers import mkl_sgemm, packed_linear
from workers.fused_layers import fuse_projections
from workers.model_loader import cpu_has_native_bf16, load_model
from workers.packed_linear import (
    MklPackedLinear,
    PackedLinear,
    TransposedLinear,
    mkl_pack_linears,
    pack_linears,
    should_pack,
    should_pack_for_mkl,
    should_transpose,
    transpose_linears,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request, tiny_model_dir):
    """(fused, fused and packed, tokenizer): two copies of the tiny model in one dtype."""
    if request.param == "bfloat16" and not cpu_has_native_bf16():
        pytest.skip("oneDNN's bfloat16 kernels need a CPU with native bfloat16")
    model, tokenizer = load_model(tiny_model_dir, "cpu", request.param)
    fuse_projections(model)
    packed = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(packed) == linears == 4 * model.config.num_hidden_layers + 1
    return model, packed, tokenizer


def test_packing_replaces_every_linear_once_and_keeps_no_dense_copy(pair) -> None:
    _, packed, _ = pair
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)
    assert all(p.dim() != 2 or p is packed.model.embed_tokens.weight for p in packed.parameters())
    assert pack_linears(packed) == 0, "packing twice is a no-op"


def test_packed_model_computes_what_the_loaded_model_computes(pair) -> None:
    model, packed, tokenizer = pair
    assert_same_logits(model, packed, tokenizer)
    assert_same_greedy(model, packed, tokenizer)


def test_the_engine_packs_native_bfloat16_and_streams_what_it_streams_unpacked(
    tiny_model_dir, monkeypatch
) -> None:
    if not cpu_has_native_bf16():
        pytest.skip("oneDNN's bfloat16 kernels need a CPU with native bfloat16")
    model, tokenizer = load_model(tiny_model_dir, "cpu", "bfloat16")
    (packed, packed_model), (plain, plain_model) = texts_with_and_without(
        model, tokenizer, monkeypatch, "should_pack", lambda *args: False
    )
    assert plain == packed
    assert isinstance(packed_model.lm_head, PackedLinear)
    assert type(plain_model.lm_head) is nn.Linear


needs_mkl = pytest.mark.skipif(not mkl_sgemm.carried(), reason="this torch has no MKL")


@needs_mkl
def test_mkl_s_packed_gemm_is_available_wherever_torch_carries_it() -> None:
    """Its check passes here: a wrapper that broke it would otherwise only fall back quietly."""
    assert mkl_sgemm.available()


@needs_mkl
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 40, mkl_sgemm.PACKED_ROWS + 44])
def test_an_mkl_packed_linear_computes_what_the_layer_computes(rows: int) -> None:
    linear = nn.Linear(96, 200, bias=True).requires_grad_(False)
    packed = MklPackedLinear(linear)
    assert [p.dim() for p in packed.parameters()] == [1], "the bias; no dense weight is kept"
    x = torch.randn(rows, 96)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 192)[:, ::2]  # an input that is not contiguous
    torch.testing.assert_close(packed(strided), linear(strided), rtol=1e-5, atol=1e-5)
    batched = torch.randn(2, 3, 96)  # leading dimensions, as a forward pass has
    assert packed(batched).shape == (2, 3, 200)
    torch.testing.assert_close(packed(batched), linear(batched), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("rewrite", "layer"),
    [
        (transpose_linears, TransposedLinear),
        pytest.param(mkl_pack_linears, MklPackedLinear, marks=needs_mkl),
    ],
)
def test_a_float32_layout_computes_what_the_loaded_model_computes(
    tiny_model_dir, rewrite, layer
) -> None:
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")
    fuse_projections(model)
    laid_out = copy.deepcopy(model)
    untied_head = model.lm_head.weight is not model.model.embed_tokens.weight
    assert rewrite(laid_out) == 4 * model.config.num_hidden_layers + untied_head
    gate_up = laid_out.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, layer)
    assert layer is not TransposedLinear or gate_up.weight_t.is_contiguous()
    assert_same_logits(model, laid_out, tokenizer)
    assert_same_greedy(model, laid_out, tokenizer)
    assert rewrite(laid_out) == 0, "laying out twice is a no-op"


@needs_mkl
def test_mkl_is_not_used_where_its_packed_gemm_disagrees_with_f_linear(monkeypatch) -> None:
    def wrong(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows.shape[0], self.out_features)

    monkeypatch.setattr(mkl_sgemm.PackedWeight, "__call__", wrong)
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: True)
    mkl_sgemm.available.cache_clear()
    try:
        assert not mkl_sgemm.available()
        assert not should_pack_for_mkl(CPU, torch.float32)
        assert should_transpose(CPU, torch.float32), "the BLAS's layout instead"
    finally:
        mkl_sgemm.available.cache_clear()  # asked again once the real one is back


@needs_mkl
def test_an_mkl_packed_weight_is_never_copied_to_another_address() -> None:
    packed = MklPackedLinear(nn.Linear(8, 8).requires_grad_(False))
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(packed)
    with pytest.raises(TypeError, match="cannot be copied"):
        pickle.dumps(packed)


@needs_mkl
def test_mkl_s_packed_gemm_refuses_what_it_would_misread() -> None:
    with pytest.raises(ValueError, match="float32"):
        mkl_sgemm.pack(torch.zeros(8, 8, dtype=torch.bfloat16))
    packed = mkl_sgemm.pack(torch.randn(8, 6))
    for rows in (
        torch.zeros(2, 6, dtype=torch.bfloat16),  # MKL would read past its end
        torch.zeros(2, 6, dtype=torch.float64),
        torch.zeros(2, 5),
        torch.zeros(6, 2).t(),  # not contiguous
    ):
        with pytest.raises(ValueError, match="contiguous float32 CPU rows of 6"):
            packed(rows)


@pytest.mark.parametrize(
    ("capability", "amx", "mkl", "rewrite", "layer"),
    [
        ("AVX2", False, True, "should_pack", PackedLinear),
        pytest.param("AVX512", True, True, "should_pack_for_mkl", MklPackedLinear, marks=needs_mkl),
        ("AVX512", True, False, "should_transpose", TransposedLinear),  # a torch without MKL
    ],
)
def test_the_engine_lays_float32_out_for_its_cpu_and_streams_what_it_streams_as_loaded(
    tiny_model_dir, monkeypatch, capability, amx, mkl, rewrite, layer
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(mkl_sgemm, "available", lambda: mkl)
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")
    (laid_out, laid_out_model), (plain, plain_model) = texts_with_and_without(
        model, tokenizer, monkeypatch, rewrite, lambda *args: False
    )
    assert plain == laid_out
    assert isinstance(laid_out_model.model.layers[0].mlp.gate_up_proj, layer)
    assert type(plain_model.model.layers[0].mlp.gate_up_proj) is nn.Linear


def test_a_tied_output_projection_is_packed_apart_from_the_embedding() -> None:
    embedding = nn.Embedding(32, 8)
    head = nn.Linear(8, 32, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embed": embedding, "head": head}).requires_grad_(False)
    before = embedding.weight.clone()
    hidden = torch.randn(3, 8)
    expected = head(hidden)
    assert pack_linears(model) == 1
    assert model["embed"].weight is embedding.weight
    torch.testing.assert_close(model["embed"].weight, before, rtol=0, atol=0)
    torch.testing.assert_close(model["head"](hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("replace", "layer"),
    [
        (transpose_linears, TransposedLinear),
        pytest.param(mkl_pack_linears, MklPackedLinear, marks=needs_mkl),
    ],
)
def test_a_tied_output_projection_is_not_transposed_or_packed_for_mkl(replace, layer) -> None:
    embedding = nn.Embedding(32, 8)
    head = nn.Linear(8, 32, bias=False)
    head.weight = embedding.weight
    inner = nn.Linear(8, 8, bias=True)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.inner, self.head = embedding, inner, head

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

    model = Tied().requires_grad_(False)
    hidden = torch.randn(3, 8)
    expected = head(inner(hidden))
    assert replace(model) == 1
    assert model.head is head and model.head.weight is embedding.weight
    assert isinstance(model.inner, layer)
    torch.testing.assert_close(model.head(model.inner(hidden)), expected, rtol=1e-5, atol=1e-5)


def test_packing_happens_only_where_it_was_measured_to_pay(monkeypatch) -> None:
    monkeypatch.setattr(packed_linear, "cpu_has_native_bf16", lambda: True)
    assert should_pack(CPU, torch.bfloat16)
    assert not should_pack(CUDA, torch.bfloat16), "CUDA takes its weights as they are"
    assert not should_pack(CPU, torch.float16)
    cases = [  # (torch's CPU capability, AMX tiles, float32 packs)
        ("AVX2", False, True),
        ("AVX512", False, True),
        ("AVX512", True, False),
        ("NO AVX", False, False),
    ]
    for capability, amx, packs in cases:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(packed_linear, "cpu_has_amx", lambda a=amx: a)
        assert should_pack(CPU, torch.float32) is packs, (capability, amx)
        for mkl in (True, False):  # float32 on AMX: MKL's packing, else transposed
            monkeypatch.setattr(mkl_sgemm, "available", lambda m=mkl: m)
            for_mkl, transposes = amx and mkl, amx and not mkl
            assert should_pack_for_mkl(CPU, torch.float32) is for_mkl, (capability, amx, mkl)
            assert should_transpose(CPU, torch.float32) is transposes, (capability, amx, mkl)
            assert not should_pack_for_mkl(CPU, torch.bfloat16)
            assert not should_pack_for_mkl(CUDA, torch.float32)
        assert not should_transpose(CPU, torch.bfloat16), "bfloat16 is packed or left as loaded"
        assert not should_transpose(CUDA, torch.float32)
    assert not should_pack(CUDA, torch.float32)
    monkeypatch.setattr(packed_linear, "_kernels_available", lambda: False)
    assert not should_pack(CPU, torch.bfloat16), "a torch without oneDNN runs as loaded"
    monkeypatch.setattr(packed_linear, "_kernels_available", lambda: True)
    monkeypatch.setattr(packed_linear, "cpu_has_native_bf16", lambda: False)
    assert not should_pack(CPU, torch.bfloat16), "emulated bfloat16 is not packed"
