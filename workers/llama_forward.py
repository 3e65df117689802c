"""The engine's own forward pass for fused Llama-family models: the same arithmetic as
transformers' modules, without their call stack.

Why: a decode step is host-bound once the batch is small or the device is fast. Through
transformers, each of the ~30 layers goes through a dozen module calls, keyword-argument
decorators and output-capture wrappers, an 8-op RMSNorm twice, and rotary embeddings applied to q
and k apart; all of it is per-step host time (and, on a GPU, kernel launches) that does no
arithmetic the step needs. Here a layer is one function over the layer's own weights:
an RMSNorm of one call (`F.rms_norm`, in float32), one fused q/k/v GEMM, rotary on q and k
together, the paged attention, o_proj and the residual, one fused gate/up GEMM, SiLU, down and
the residual. The final norm runs only on the rows kept (those that sample, and an embedding's).

The operations are transformers' own, in its order, so float32 logits are bitwise the same (the
tests compare them, bfloat16 too); the rotary tables come from the model's own rotary module, so
every RoPE scaling it supports is supported here. Where an operation's result is a fresh tensor
used once, the next one writes into it (`mul_`, `add_`): the same arithmetic with fewer new
tensors, which matters because a step's GEMMs stream the weights through the cache and each new
tensor comes back from memory (a norm took ~65 us after a GEMM against 24 alone; bfloat16 engine
bench 1.09x at c=1, within noise at 32-64). Only models whose every layer is transformers'
`LlamaDecoderLayer` with the fused attention and MLP (fused_layers.py) and `LlamaRMSNorm`s take
this path; anything else keeps the module forward. `generate` is untouched either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from workers.attention import PagedBatch, paged_attention_forward
from workers.fused_layers import FusedGateUpMLP, FusedQKVAttention

# (input ids [1, T], positions [1, T], rows to keep [R], the batch) -> their final hidden states
# [R, D], after the last norm: the caller applies the LM head to those that sample
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]


def _is_lean_layer(layer: nn.Module) -> bool:
    return (
        type(layer) is LlamaDecoderLayer
        and type(layer.self_attn) is FusedQKVAttention
        and type(layer.mlp) is FusedGateUpMLP
        and type(layer.input_layernorm) is LlamaRMSNorm
        and type(layer.post_attention_layernorm) is LlamaRMSNorm
        and type(layer.mlp.act_fn) in (SiLUActivation, nn.SiLU)
    )


def lean_forward(model: nn.Module) -> Forward | None:
    """The lean forward for `model` (already fused), or None where it does not apply."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if (
        layers is None
        or not len(layers)
        or type(getattr(body, "norm", None)) is not LlamaRMSNorm
        or not all(_is_lean_layer(layer) for layer in layers)
        or not hasattr(model, "lm_head")
    ):
        return None
    return _LlamaForward(model)


def llama_rms_norm(
    x: torch.Tensor, shape: tuple[int], weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """transformers' `LlamaRMSNorm`: normalised in float32, rounded to x's dtype, then scaled.

    NOTE: `F.rms_norm` on bfloat16 scales before it rounds (one rounding where transformers has
    two). One bf16 ulp per value, but the default model's residual stream reaches ~25,000 and it
    is tuned to transformers' arithmetic: through the engine it answered "What is the capital of
    France?" with "L'Étoile, la Marseillaise," where transformers says Paris. float32 is one call
    (bitwise the same there).
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    return h.mul_(torch.rsqrt(variance.add_(eps))).to(x.dtype).mul_(weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin).add_(x * cos)


class _LlamaForward:
    def __init__(self, model: nn.Module) -> None:
        body = model.model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.norm = body.norm
        self.layers = list(body.layers)
        attention = self.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = attention.split_sizes[1] // attention.head_dim
        self.head_dim = attention.head_dim
        self.qk_width = (self.heads + self.kv_heads) * self.head_dim  # q and k, side by side
        self.hidden = (model.config.hidden_size,)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: PagedBatch
    ) -> torch.Tensor:
        hidden = self.embed(ids)
        cos, sin = self.rotary(hidden, position_ids=positions)
        # [1, T, D] -> [1, T, 1, D]: one table row per token, broadcast over q and k heads
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, batch)
        last = hidden[0].index_select(0, keep)
        return llama_rms_norm(last, self.hidden, self.norm.weight, self.norm.variance_epsilon)

    def _layer(
        self,
        layer: Any,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch,
    ) -> torch.Tensor:
        attention, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        x = llama_rms_norm(hidden, self.hidden, norm.weight, norm.variance_epsilon)
        tokens = x.shape[1]
        qkv = attention.qkv_proj(x)
        qk = _rotate(qkv[..., : self.qk_width].view(1, tokens, -1, self.head_dim), cos, sin)
        value = qkv[..., self.qk_width :].view(1, tokens, self.kv_heads, self.head_dim)
        out, _ = paged_attention_forward(
            attention,
            qk[:, :, : self.heads].transpose(1, 2),
            qk[:, :, self.heads :].transpose(1, 2),
            value.transpose(1, 2),
            None,
            scaling=attention.scaling,
            paged_batch=batch,
        )
        hidden = attention.o_proj(out.view(1, tokens, -1)).add_(hidden)
        norm = layer.post_attention_layernorm
        x = llama_rms_norm(hidden, self.hidden, norm.weight, norm.variance_epsilon)
        gate, up = mlp.gate_up_proj(x).split(mlp.intermediate_size, dim=-1)
        return mlp.down_proj(F.silu(gate).mul_(up)).add_(hidden)
