"""Hermes tool calls parsed out of released text, whatever pieces the detokenizer made."""

from __future__ import annotations

import pytest

from workers.tool_parser import ToolCall, ToolCallParser, parse_call

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern", "days": 2}}\n</tool_call>'
)
WEATHER = ToolCall("get_weather", '{"city":"Bern","days":2}')


def run(pieces: list[str]) -> list[str | ToolCall]:
    """Push every piece, then flush; adjacent text segments merged, as the sequence does."""
    parser = ToolCallParser()
    out: list[str | ToolCall] = []
    for piece in [*(parser.push(p) for p in pieces), parser.flush()]:
        for segment in piece:
            if isinstance(segment, str) and out and isinstance(out[-1], str):
                out[-1] += segment
            else:
                out.append(segment)
    return out


def chars(text: str) -> list[str]:
    return list(text)


def test_plain_text_passes_through() -> None:
    assert run(["Hello, ", "world"]) == ["Hello, world"]


def test_a_call_split_into_single_characters() -> None:
    assert run(chars(CALL)) == [WEATHER]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11])
def test_a_call_split_anywhere_never_leaks_markup(size: int) -> None:
    text = "Let me check.\n" + CALL
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    parser = ToolCallParser()
    segments = [s for p in pieces for s in parser.push(p)] + parser.flush()
    assert "".join(s for s in segments if isinstance(s, str)) == "Let me check."  # no markup
    assert [s for s in segments if isinstance(s, ToolCall)] == [WEATHER]


def test_text_before_a_call_stays_text_and_the_separator_is_dropped() -> None:
    assert run(["Sure, checking.\n\n", CALL]) == ["Sure, checking.", WEATHER]


def test_two_calls_and_the_whitespace_between_them() -> None:
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert run([CALL, "\n", other, "\n"]) == [WEATHER, ToolCall("get_time", "{}")]


def test_text_after_a_call() -> None:
    assert run([CALL, "\nDone."]) == [WEATHER, "Done."]


def test_a_lone_angle_bracket_is_released_once_it_cannot_be_markup() -> None:
    parser = ToolCallParser()
    assert parser.push("a <tool") == ["a"]  # " <tool" could still begin a call
    assert parser.push("s>") == [" <tools>"]


def test_malformed_json_inside_the_tags_is_released_as_the_text_written() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert run(["Hi ", bad]) == ["Hi" + bad]


def test_a_body_without_a_name_is_text() -> None:
    bad = '<tool_call>{"arguments": {}}</tool_call>'
    assert run([bad]) == [bad]


def test_a_call_cut_off_by_the_end_is_text() -> None:
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    assert run([cut]) == [cut]


def test_a_whole_object_without_the_closing_tag_at_the_end_is_a_call() -> None:
    assert run([CALL.removesuffix("</tool_call>")]) == [WEATHER]


@pytest.mark.parametrize("kept", [1, 4, len("</tool_call>") - 1])
def test_a_whole_object_whose_closing_tag_was_cut_short_is_a_call(kept: int) -> None:
    # max_tokens ran out inside `</tool_call>`: the call itself was whole
    cut = CALL.removesuffix("</tool_call>") + "</tool_call>"[:kept]
    assert run(chars(cut)) == [WEATHER]


def test_arguments_given_as_a_string_are_kept_and_parameters_is_accepted() -> None:
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == ToolCall("f", '{"a": 1}')
    assert parse_call('{"name": "f", "parameters": {"a": 1}}') == ToolCall("f", '{"a":1}')


def test_calls_are_counted() -> None:
    parser = ToolCallParser()
    parser.push(CALL + CALL)
    assert parser.calls == 2
