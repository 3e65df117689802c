"""Owns the model's tensors: runs forward passes and keeps each sequence's KV cache.

This is the simple placeholder core: one transformers `DynamicCache` per sequence and one forward
per sequence per step. The paged-KV runner of the next milestone replaces this class behind the
same two calls (`forward`, `free`), so the engine does not change.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache


class ModelRunner:
    """Runs the model for one sequence at a time; caches keyed by the sequence's key."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._caches: dict[tuple[str, int], DynamicCache] = {}
        # transformers 5 renamed `past_key_values` to `cache`; take whichever forward() knows.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def num_cached(self) -> int:
        return len(self._caches)

    def input_ids_for(
        self, key: tuple[str, int], prompt_ids: list[int], output_ids: list[int]
    ) -> list[int]:
        """What the next forward must feed: the whole prompt first, then one token at a time."""
        if key not in self._caches:
            return prompt_ids + output_ids
        return output_ids[-1:]

    @torch.inference_mode()
    def forward(self, key: tuple[str, int], input_ids: list[int]) -> torch.Tensor:
        """Feed `input_ids` after what the cache holds; return the last position's logits."""
        cache = self._caches.get(key)
        if cache is None:
            cache = DynamicCache(config=self.model.config)
            self._caches[key] = cache
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        kwargs = {self._cache_kwarg: cache}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[0, -1]

    def free(self, key: tuple[str, int]) -> None:
        """Drop a sequence's cache; freeing an unknown key is a no-op."""
        self._caches.pop(key, None)
