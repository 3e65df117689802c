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


class PassThrough:
    """A stage that lets everything through: the pipeline's general path."""

    stop_source = None

    async def feed(self, events: list) -> list:
        return events

    async def finish(self) -> list:
        return []


async def test_plain_text_renders_what_feed_renders() -> None:
    """The fast path for a batch of plain text makes the same chunks and the same completion
    as the stages' path."""
    fast, general = (
        RunPipeline("run-1", "m", 7, 2),
        RunPipeline("run-1", "m", 7, 2, [PassThrough()]),
    )
    for pipeline in (fast, general):
        await pipeline.feed([Accepted()])
    batch = [TextDelta("Hé", 0), TextDelta(' "quoted"\n', 1, tokens=2), TextDelta("!", 0)]

    chunks = fast.plain_text(batch)
    expected, _ = await general.feed(batch)

    assert chunks == expected
    assert general.plain_text(batch) is None  # a stage sits in it: every batch goes through it
    assert fast.completion(9) == general.completion(9)


@pytest.mark.parametrize(
    "event",
    [
        TextDelta("", tokens=1),  # a token of no text: counted, no chunk
        TextDelta("x", logprobs=[]),
        Finish("stop"),
    ],
)
async def test_plain_text_leaves_any_other_batch_to_feed(event) -> None:
    pipeline = RunPipeline("run-1", "m", 0, 1)
    assert pipeline.plain_text([TextDelta("a")]) is None  # its role chunk is not out yet
    await pipeline.feed([Accepted()])

    assert pipeline.plain_text([TextDelta("a"), event]) is None
    assert pipeline.plain_text([]) is None
    assert pipeline.completion(1) == RunPipeline("run-1", "m", 0, 1).completion(1)
