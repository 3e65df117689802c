"""The tiny test checkpoint: the shape design §10 asks for, and the same bytes every build."""

from __future__ import annotations

from pathlib import Path

import torch

from testkit.tiny_model import END_OF_TEXT, IM_END, IM_START, build_tiny_model
from workers.model_loader import load_model


def test_same_files_every_build(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_shape_wide_init_untied_and_eos_row_zeroed(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 1024
    assert not config.tie_word_embeddings
    assert 0.15 < model.model.embed_tokens.weight.detach().std().item() < 0.25  # wide, not 0.02
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.eos_token_id == eos
    assert torch.count_nonzero(model.lm_head.weight[eos]) == 0
    assert len(tokenizer) == config.vocab_size == 600
    specials = {IM_START, IM_END, END_OF_TEXT}
    assert specials <= set(tokenizer.all_special_tokens)


def test_greedy_output_is_varied_and_multi_byte(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")
    ids = tokenizer("你好", add_special_tokens=False)["input_ids"]
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)
    generated = out[0, len(ids) :].tolist()
    assert len(generated) == 64  # no early EOS
    assert len(set(generated)) > 20  # not one repeated token
    text = tokenizer.decode(generated, skip_special_tokens=True)
    assert any(ord(c) > 127 for c in text)
