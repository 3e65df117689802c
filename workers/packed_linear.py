"""Linear layers whose weights oneDNN (or MKL) has laid out once, for its own GEMM kernels (CPU).

Why: a plain `F.linear` on CPU hands the row-major weight to the BLAS on every call, and at
decode batch sizes the small-M GEMM spends much of its time on that layout. oneDNN can reorder
the weight once into its blocked form and then run every call on it. Measured on a 2-core AMX
host at the default model's shapes (q/k/v, o, gate/up, down, lm_head), per step:

  - bfloat16: 1.5x faster at 1 and 32 rows, 1.7x at 64 (AMX tiles), 1.6x at 128;
  - float32: 1.2-1.3x at 32-64 rows on the GEMMs alone, but a lone sequence's decode step took
    1.15-1.23x longer (the BLAS's own matrix-vector path wins at one row), and the engine bench
    read 1.02-1.05x at c=32/64, within its noise.

On a 2-core AVX2 host (AMD EPYC, no AVX-512) float32 is another matter: the packed GEMMs took
0.81x, 0.66x and 0.80x the BLAS's time at 1, 32 and 64 rows (the default model's shapes, one
step's worth), and the engine bench read 1.25x, 1.35x and 1.28x the tokens/s at c=1, 32, 64
(`--compare`, two repeats taking turns), for 114 MiB more RSS (995 against 881 MiB once the
weights have left the checkpoint's mapping, own_memory.py): the tied output projection's packed
copy.

On a 2-core AVX-512 host without AMX (AMD EPYC, Zen 4) float32 gains most: the packed GEMMs
took 0.56x, 0.53x and 0.55x the BLAS's time at 1, 32 and 64 rows (`bench/packed_gemm.py`), and
the engine bench read 1.74x, 1.73x and 1.44x the tokens/s at c=1, 32, 64 (`--compare`, two
repeats taking turns).

So bfloat16 is packed where the CPU computes it natively (AVX512-BF16, AMX), float32 on AVX2 and
AVX-512 CPUs without AMX for oneDNN, and on AMX CPUs for MKL's own GEMM (`MklPackedLinear`,
mkl_sgemm.py); CUDA never (its GEMMs take the weight as it is).

On the AMX host oneDNN's float32 packing cost a lone sequence (1.15-1.23x its step), and the
BLAS on a transposed weight (`[in, out]`, `TransposedLinear`) gained 1.02-1.05x at most. MKL's
packed GEMM pays at every batch size but one row. `bench/packed_gemm.py --dtype float32`, one
step's GEMMs over the default model's 30 layers of distinct weights (as a step reads them, from
memory rather than cache) and the head (every layout's own here; the engine leaves a tied head
as loaded), against `F.linear`'s x @ W.T:

    rows                1     8     32    64    256   512
    transposed (x @ W)  0.95  0.89  0.95  0.89  1.00  0.95
    packed (oneDNN)     1.14  0.60  0.83  0.91  0.71  0.98
    packed (MKL)        1.04  0.63  0.76  0.74  0.64  0.93

MKL packs each weight for a number of rows it is told (`mkl_sgemm.PACKED_ROWS`) and runs any
number on it. The transposed form stays for an AMX host whose torch has no MKL. Holding two
layouts and picking per step would double the weights' memory.

The packed (or transposed) weight replaces the layer's own; a tied output projection (lm_head
sharing the embedding's matrix) gets its own oneDNN-packed copy, the embedding keeps the
original. A tied projection is not transposed or packed for MKL: a second float32 copy of the
vocabulary's matrix (113 MiB for the default model) for 1-2 ms of a 70-150 ms step.
"""

from __future__ import annotations

import torch
from torch import nn

from workers import mkl_sgemm
from workers.model_loader import cpu_has_amx, cpu_has_native_bf16
from workers.module_swap import replace_modules


def _kernels_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a weight reordered once for oneDNN; same input and output."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # NOTE: a plain attribute, not a parameter: an opaque oneDNN tensor that `.to()`,
        # `state_dict()` and `parameters()` must not touch.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


class TransposedLinear(nn.Module):
    """`nn.Linear`'s forward on its weight stored transposed, `[in, out]`: the BLAS multiplies
    x @ W instead of x @ W.T; same input and output (within float32 rounding)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(x, self.weight_t)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, transposed"


class MklPackedLinear(nn.Module):
    """`nn.Linear`'s forward, float32, on a weight packed once for MKL's GEMM (mkl_sgemm.py);
    same input and output within float32 rounding. Not copyable (the packed weight is not)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # NOTE: a plain attribute, not a parameter or buffer: MKL's opaque layout, which `.to()`
        # and `state_dict()` must not touch (a float32 layout whatever the model is cast to: a
        # cast model's rows are refused, not misread)
        self.packed = mkl_sgemm.pack(linear.weight.detach())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.packed(x.reshape(-1, self.in_features).contiguous())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, MKL"


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packing pays for this model (the measurements in the module's docstring)."""
    if device.type != "cpu" or not _kernels_available():
        return False
    if dtype == torch.bfloat16:
        return cpu_has_native_bf16()
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return dtype == torch.float32 and vector and not cpu_has_amx()


def should_pack_for_mkl(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float32 weights are packed for MKL's GEMM instead (the AMX host's measurement)."""
    return _float32_on_amx(device, dtype) and mkl_sgemm.available()


def should_transpose(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float32 weights are stored transposed instead: an AMX host whose torch has no
    MKL, or one whose packed GEMM failed mkl_sgemm's check."""
    return _float32_on_amx(device, dtype) and not mkl_sgemm.available()


def _float32_on_amx(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and cpu_has_amx()


def transpose_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` but a tied output projection by its transposed
    form, in place; returns how many."""
    return _replace_untied(model, TransposedLinear)


def _replace_untied(model: nn.Module, layer: type[nn.Module]) -> int:
    """Every `nn.Linear` but one sharing the input embedding's matrix, as `layer(linear)`."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    shared = None if embed is None else embed.weight

    def replaced(linear: nn.Linear) -> nn.Module:
        return linear if linear.weight is shared else layer(linear)

    return replace_modules(model, {nn.Linear: replaced})


def mkl_pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` but a tied output projection by its MKL-packed form,
    in place; returns how many."""
    return _replace_untied(model, MklPackedLinear)


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by its packed form, in place; returns how many."""
    return replace_modules(model, {nn.Linear: PackedLinear})
