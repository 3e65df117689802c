"""A CPU model's weights leave the checkpoint's mapped file once the engine takes the model, so
the file is unmapped; the values, and the ties between modules, stay as they were."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from torch import nn

from tests.support.model_equivalence import engine_texts
from workers.model_loader import load_model
from workers.own_memory import own_weights


def mapped(path: Path) -> int:
    """Mappings of files under `path` in this process."""
    with open("/proc/self/maps") as maps:
        return sum(str(path) in line for line in maps)


def test_the_engine_lets_the_checkpoint_file_go(tiny_model_dir) -> None:
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")
    gc.collect()
    assert mapped(tiny_model_dir) > 0, "loading maps the checkpoint"
    texts = engine_texts(model, tokenizer)
    gc.collect()
    assert mapped(tiny_model_dir) == 0
    assert all(len(text) > 0 for text in texts.values())


def test_weights_keep_their_values_and_their_ties() -> None:
    embedding = nn.Embedding(16, 4)
    head = nn.Linear(4, 16, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embed": embedding, "head": head})
    model.register_buffer("table", torch.arange(6.0))
    before = {name: (t.data_ptr(), t.clone()) for name, t in model.state_dict().items()}
    own_weights(model)
    for name, tensor in model.state_dict().items():
        pointer, value = before[name]
        assert tensor.data_ptr() != pointer, f"{name} was not copied"
        torch.testing.assert_close(tensor, value, rtol=0, atol=0)
    assert model["head"].weight is model["embed"].weight
