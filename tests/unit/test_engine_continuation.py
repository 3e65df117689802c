"""A run continued from another worker's exact token (`continuation`), on the tiny model.

The specification: cut an uninterrupted greedy run after any line that carried ids (what a
gateway has received when its worker dies), continue it with those ids, and what was received
plus what the continued run sends is the uninterrupted run, line content and ids alike, with the
same finish reason and usage. Cuts are taken at every such line, so they land where a stop-string
prefix or part of a code point is held back, and right before the end.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest

from tests.support.worker_lines import wire
from wire.output_spec import ResponseFormat, parse_tools
from wire.sampling_params import SamplingParams
from workers.engine import Engine
from workers.engine_outputs import ContextTooLong, InvalidContinuation
from workers.grammar import CompiledGrammar, GrammarCompiler, grammar_source
from workers.request import EngineRequest
from workers.stop import StopStringHoldback

PROMPT = "你好世界"
N = 24
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.fixture
def engine(tiny) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, max_num_seqs=4)


@pytest.fixture(scope="module")
def compiler(tiny) -> GrammarCompiler:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, max_num_seqs=1)
    return GrammarCompiler(tokenizer, model.config.vocab_size, engine.stop_ctx.eos_token_ids)


@dataclass
class Spec:
    """One request, to run whole or continued."""

    prompt: list[int]
    params: dict[str, Any]
    grammar: CompiledGrammar | None = None
    parse_tools: bool = False


def prompt_ids(tiny, text: str) -> list[int]:
    return tiny[1](text, add_special_tokens=False)["input_ids"]


def stream(engine: Engine, spec: Spec, continuation: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Every line the request produces, run alone to its end."""
    request_id = f"r{len(continuation)}"
    engine.add_request(
        EngineRequest(
            request_id,
            spec.prompt,
            SamplingParams(temperature=0.0, **spec.params),
            spec.grammar,
            spec.parse_tools,
            continuation=tuple(continuation),
        )
    )
    lines = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request_id
            lines.extend(wire(out.events))
    return lines


def content(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for x in lines if x["type"] in ("text", "tool_call")]


def ids_of(lines: list[dict[str, Any]]) -> list[int]:
    return [t for x in content(lines) for t in x["ids"]]


def text_of(lines: list[dict[str, Any]]) -> str:
    return "".join(x["text"] for x in lines if x["type"] == "text")


def cuts(lines: list[dict[str, Any]]) -> list[int]:
    """Where a gateway can stand: after each line that carried ids, as a line count."""
    return [0] + [
        i + 1 for i, x in enumerate(lines) if x["type"] in ("text", "tool_call") and x["ids"]
    ]


def received(lines: list[dict[str, Any]], cut: int) -> list[dict[str, Any]]:
    return [x for x in lines[:cut] if x["type"] in ("text", "tool_call")]


def check_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every text and tool-call line names the tokens it counts."""
    for line in content(lines):
        assert len(line["ids"]) == line["tokens"]
    return lines


def assert_continues(engine: Engine, spec: Spec, whole: list[dict[str, Any]], cut: int) -> None:
    """Continued from `cut`, the run is `whole`: nothing repeated, nothing missing, same end."""
    before = received(whole, cut)
    continued = check_lines(stream(engine, spec, ids_of(before)))
    assert content(before) + content(continued) == content(whole), cut
    assert continued[-2:] == whole[-2:], cut  # finish and usage lines
    assert continued[0] == {"type": "admitted"}


def pending_bytes(engine: Engine, ids: list[int]) -> bytes:
    """The bytes of an incomplete code point the detokenizer holds after `ids`."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(engine.table.text_bytes[t] for t in ids))
    return decoder.getstate()[0]


def hold_back(engine: Engine, ids: list[int], stops: list[str]) -> list[tuple[bool, str]]:
    """Per token of `ids`, with `stops`: whether it released text, and the text then held."""
    decoder, holdback = codecs.getincrementaldecoder("utf-8")("replace"), StopStringHoldback(stops)
    out = []
    for t in ids:
        released, _ = holdback.push(decoder.decode(engine.table.text_bytes[t]))
        out.append((bool(released), holdback.pending))
    return out


def held_text(engine: Engine, ids: list[int], stops: list[str]) -> str:
    """The text the stop-string hold-back keeps after `ids`."""
    return hold_back(engine, ids, stops)[-1][1] if ids else ""


# -- greedy, max_tokens ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def free(tiny) -> list[dict[str, Any]]:
    """The uninterrupted greedy run of PROMPT, N tokens, no stop strings."""
    return check_lines(stream(Engine(*tiny, max_num_seqs=1), plain(tiny)))


def plain(tiny, **params: Any) -> Spec:
    return Spec(prompt_ids(tiny, PROMPT), {"max_tokens": N, **params})


def cut_after(lines: list[dict[str, Any]], tokens: int) -> int:
    """The cut after the line that completes the first `tokens` ids."""
    [cut] = [c for c in cuts(lines) if len(ids_of(received(lines, c))) == tokens]
    return cut


def test_continued_at_0_1_the_middle_n_minus_1_and_n_tokens(engine: Engine, tiny, free) -> None:
    assert free[-2:] == [
        {"type": "finish", "index": 0, "reason": "length", "completion_tokens": N},
        {"type": "usage", "prompt_tokens": len(prompt_ids(tiny, PROMPT)), "completion_tokens": N},
    ]
    middle = min(cuts(free), key=lambda c: abs(len(ids_of(received(free, c))) - N // 2))
    for cut in (cut_after(free, 0), cut_after(free, 1), middle, cut_after(free, N - 1)):
        assert_continues(engine, plain(tiny), free, cut)
    assert_continues(engine, plain(tiny), free, cut_after(free, N))


def test_a_continuation_of_max_tokens_finishes_at_once(engine: Engine, tiny, free) -> None:
    continued = stream(engine, plain(tiny), ids_of(free))
    assert continued == [
        {"type": "admitted"},
        {"type": "finish", "index": 0, "reason": "length", "completion_tokens": N},
        {"type": "usage", "prompt_tokens": len(prompt_ids(tiny, PROMPT)), "completion_tokens": N},
    ]
    assert engine.stats().steps_total == 1  # a step boundary, no forward pass
    assert engine.stats().kv_blocks_used == 0


def test_a_cut_inside_a_code_point_holds_its_bytes(engine: Engine, tiny, free) -> None:
    """A line's last token began a character the next line completes: the continuing worker
    holds those bytes, as the first did, and writes the whole character."""
    split = [
        c
        for c in cuts(free)[1:-1]
        if pending_bytes(engine, ids_of(received(free, c)))
        and text_of(free[c:])[0] != "\ufffd"  # a real character, not an invalid sequence
    ]
    assert split, "the tiny model's greedy run splits a character at a line boundary"
    held = pending_bytes(engine, ids_of(received(free, split[0])))
    assert text_of(free[split[0] :])[0].encode().startswith(held)
    assert_continues(engine, plain(tiny), free, split[0])


@pytest.mark.parametrize("matches", [True, False])
def test_a_stop_string_spanning_the_cut(engine: Engine, tiny, free, matches: bool) -> None:
    """A stop string that starts in what was received and ends after it: at the cut the first
    worker held text of more than the last token back, and so does the continuing one. Also
    for a stop string that turns out not to match: the held text comes out later, once."""
    lines, text = content(free), text_of(free)
    for j in range(len(lines) // 2, len(lines) - 1):
        # lines j-2 and j-1 are held (a prefix of the first stop), line j releases j-2 and
        # holds j-1 and j (a prefix of the second), line j+1 completes the second, or not
        first, held, after = (x["text"] for x in (lines[j - 2], lines[j - 1], lines[j + 1]))
        held += lines[j]["text"]
        stops = [first + lines[j - 1]["text"] + "\x00", held + (after[0] if matches else "\x00")]
        released_holding = (True, held) in hold_back(engine, ids_of(free), stops)
        if released_holding and text.find(stops[1]) == (text.find(held) if matches else -1):
            break
    else:
        pytest.fail("no three lines of the tiny model's run hold back as this test needs")
    spec = plain(tiny, stop=stops)
    whole = check_lines(stream(engine, spec))
    assert text_of(whole) == (text[: text.find(held)] if matches else text)
    assert whole[-2]["reason"] == ("stop" if matches else "length")
    [cut] = [c for c in cuts(whole) if held_text(engine, ids_of(received(whole, c)), stops) == held]
    assert_continues(engine, spec, whole, cut)


def test_a_stop_token_right_after_held_text_finishes_at_once(engine: Engine, tiny, free) -> None:
    """The stop id's step flushes the held text onto a line that carries the id: a gateway that
    got that line but not `finish` continues with the stop id last."""
    lines = content(free)
    m = next(
        m
        for m in range(len(lines) // 2, len(lines))
        if lines[m]["ids"][0] not in ids_of(lines[:m]) and lines[m - 1]["text"]
    )
    stop_id, held = lines[m]["ids"][0], lines[m - 1]["text"]
    spec = plain(tiny, stop=[held + "\x00"], stop_token_ids=(stop_id,))
    whole = check_lines(stream(engine, spec))
    assert ids_of(whole)[-1] == stop_id
    assert text_of(whole) == text_of(free[: free.index(lines[m])])
    assert_continues(engine, spec, whole, cuts(whole)[-1])
    assert [x["type"] for x in stream(engine, spec, ids_of(whole))] == [
        "admitted",
        "finish",
        "usage",
    ]


def test_penalties_see_the_continuation(engine: Engine, tiny) -> None:
    spec = Spec(prompt_ids(tiny, "Ça va"), {"max_tokens": 16, "frequency_penalty": 2.0})
    whole = check_lines(stream(engine, spec))
    assert_continues(engine, spec, whole, cuts(whole)[len(cuts(whole)) // 2])


def test_every_line_names_its_tokens(engine: Engine, tiny) -> None:
    spec = Spec(prompt_ids(tiny, "Hello world"), {"max_tokens": 12, "n": 2, "logprobs": True})
    lines = check_lines(stream(engine, spec))
    for index in (0, 1):
        assert sum(len(x["ids"]) for x in content(lines) if x["index"] == index) == 12


# -- grammars and tool calls -------------------------------------------------------------------


def test_a_json_schema_run_continues_valid_and_equal(engine: Engine, tiny, compiler) -> None:
    grammar = compiler.build(grammar_source(ResponseFormat("json_schema", SCHEMA, "s"), None))
    spec = Spec(prompt_ids(tiny, PROMPT), {"max_tokens": 60}, grammar)
    whole = check_lines(stream(engine, spec))
    assert whole[-2]["reason"] == "stop"  # the grammar completed
    jsonschema.validate(json.loads(text_of(whole)), SCHEMA)
    at = cuts(whole)
    for cut in (at[1], at[len(at) // 2], at[-1]):  # the last: the grammar complete, at once
        assert_continues(engine, spec, whole, cut)


def test_a_forced_tool_call_continues_and_keeps_its_finish_reason(
    engine: Engine, tiny, compiler
) -> None:
    tools = parse_tools(TOOLS, "required")
    grammar = compiler.build(grammar_source(None, tools))
    spec = Spec(prompt_ids(tiny, PROMPT), {"max_tokens": 100}, grammar, parse_tools=True)
    whole = check_lines(stream(engine, spec))
    [call] = content(whole)
    assert (call["type"], call["call_index"], call["name"]) == ("tool_call", 0, "get_time")
    assert whole[-2]["reason"] == "tool_calls"
    assert_continues(engine, spec, whole, cuts(whole)[-1])  # `tool_calls` from the replay alone
    # mid-markup (no line ends there, but the parser is primed all the same)
    half = call["tokens"] // 2
    continued = stream(engine, spec, call["ids"][:half])
    assert content(continued) == [
        call | {"tokens": call["tokens"] - half, "ids": call["ids"][half:]}
    ]
    assert continued[-2:] == whole[-2:]


def test_a_continuation_the_grammar_refuses_is_refused(engine: Engine, tiny, compiler) -> None:
    grammar = compiler.build(grammar_source(ResponseFormat("json_schema", SCHEMA, "s"), None))
    not_json = prompt_ids(tiny, "Hello")
    request = EngineRequest("r", [1, 2], SamplingParams(), grammar, continuation=tuple(not_json))
    with pytest.raises(InvalidContinuation):
        engine.add_request(request)
    assert not engine.has_unfinished()


# -- what can never be a continuation ----------------------------------------------------------


def test_a_token_after_the_end_is_refused(engine: Engine, tiny) -> None:
    ids = prompt_ids(tiny, PROMPT)
    request = EngineRequest("r", ids, SamplingParams(stop_token_ids=(7,)), continuation=(5, 7, 9))
    with pytest.raises(InvalidContinuation, match=r"continuation\[1\]"):
        engine.add_request(request)
    assert not engine.has_unfinished()


def test_the_continuation_counts_against_max_tokens_and_the_context(engine: Engine) -> None:
    with pytest.raises(ContextTooLong) as refused:
        engine.check_fits(10, 4, 5)
    assert refused.value.param == "continuation"
    engine.check_fits(10, 4, 4)
    limit = engine.max_model_len
    engine.check_fits(10, None, limit - 10)
    with pytest.raises(ContextTooLong, match="continuation"):
        engine.check_fits(10, None, limit - 9)
