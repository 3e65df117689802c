"""The run pipeline's rendering of tokens that bring no text (docs/worker-api.md): a worker puts
the tokens that end a choice without text (an EOS, a stop string's own tokens) on a last line of
empty text and no logprobs; they are counted (the events go on to the run's accounting) but
shown as no chunk. A line of no text that carries logprobs is still a chunk."""

from __future__ import annotations

import orjson
import pytest

from adapters.events import Accepted, Finish, TextDelta
from gateway.runs.pipeline import RunPipeline


def _deltas(chunks: list) -> list[dict]:
    return [orjson.loads(payload)["choices"][0]["delta"] for payload, _, _ in chunks]


@pytest.mark.parametrize("logprobs", [None, []])
async def test_a_line_of_no_text_is_passed_on_but_shows_no_chunk(logprobs) -> None:
    pipeline = RunPipeline("run-1", "m", 0, 1)
    empty = TextDelta("", tokens=1, logprobs=logprobs)
    events = [Accepted(), TextDelta("Hi", tokens=1, logprobs=logprobs), empty, Finish("stop")]

    chunks, passed = await pipeline.feed(events)

    assert _deltas(chunks) == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {}]
    # the empty line still reaches the accounting: its token is counted as sent
    assert sum(e.tokens for e in passed if type(e) is TextDelta) == 2


async def test_a_line_of_no_text_with_logprobs_is_a_chunk() -> None:
    """As an OpenAI-compatible upstream may send it."""
    pipeline = RunPipeline("run-1", "m", 0, 1)
    eos = [{"token": "<|im_end|>", "logprob": -0.1, "bytes": [], "top_logprobs": []}]
    events = [Accepted(), TextDelta("", tokens=1, logprobs=eos), Finish("stop")]

    chunks, _ = await pipeline.feed(events)

    assert _deltas(chunks)[1] == {"content": ""}
    assert orjson.loads(chunks[1][0])["choices"][0]["logprobs"] == {"content": eos}
