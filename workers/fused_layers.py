"""Fused projections for Llama-family decoder layers: q/k/v as one GEMM, gate/up as one.

Why: at decode batch sizes (tens of rows) each small GEMM runs far from the matmul peak and pays
its own dispatch; one wider GEMM per group does the same arithmetic in fewer, better-shaped calls
(7 GEMMs per layer become 4). The weights are concatenated once, when the engine takes the model,
and the originals are dropped, so memory does not grow. Outputs are split back as views.

Only the module classes whose forward is reproduced here are replaced (transformers' Llama
attention and MLP, which SmolLM2 and the tiny test model use); any other architecture runs as
loaded. The replacements keep the attributes the attention functions read (`layer_idx`,
`num_key_value_groups`, `is_causal`, ...), so `generate` still works on a fused model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from workers.module_swap import replace_modules

# What the attention functions (ours, sdpa, eager) read from the module they are given.
_ATTENTION_ATTRIBUTES = (
    "config",
    "layer_idx",
    "head_dim",
    "num_key_value_groups",
    "scaling",
    "attention_dropout",
    "is_causal",
)


def concat_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (same input, same dtype)."""
    first = parts[0]
    has_bias = first.bias is not None
    fused = nn.Linear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=has_bias,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


class FusedQKVAttention(nn.Module):
    """LlamaAttention with q, k and v computed by one GEMM; otherwise the same forward."""

    def __init__(self, attention: LlamaAttention) -> None:
        super().__init__()
        for name in _ATTENTION_ATTRIBUTES:
            setattr(self, name, getattr(attention, name))
        parts = [attention.q_proj, attention.k_proj, attention.v_proj]
        self.split_sizes = [p.out_features for p in parts]
        self.qkv_proj = concat_linears(parts)
        self.o_proj = attention.o_proj

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split(self.split_sizes, dim=-1)
        query = q.view(hidden_shape).transpose(1, 2)
        key = k.view(hidden_shape).transpose(1, 2)
        value = v.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


class FusedGateUpMLP(nn.Module):
    """LlamaMLP with gate and up computed by one GEMM: down(act(gate) * up)."""

    def __init__(self, mlp: LlamaMLP) -> None:
        super().__init__()
        self.intermediate_size = mlp.gate_proj.out_features
        self.gate_up_proj = concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


_FUSED: dict[type, type] = {LlamaAttention: FusedQKVAttention, LlamaMLP: FusedGateUpMLP}


def fuse_projections(model: nn.Module) -> int:
    """Replace every Llama attention and MLP in `model` by its fused form, in place.

    Returns how many modules were replaced (0 for other architectures, or when already fused).
    """
    return replace_modules(model, _FUSED)
