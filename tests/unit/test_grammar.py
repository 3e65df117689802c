"""Grammars for constrained decoding: what each request compiles to, how a refusal names the
field, and the batched mask matching llguidance's own, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from testkit.tiny_model import IM_END, build_tiny_tokenizer
from wire.output_spec import ResponseFormat, Tool, parse_tools
from workers.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarViolation,
    grammar_source,
    tool_call_lark,
)
from workers.grammar_mask import GrammarMasks, byte_table, mask_bias

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    return GrammarCompiler(tokenizer, len(tokenizer), [eos])


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_no_format_and_no_forced_call_is_no_grammar() -> None:
    assert grammar_source(None, None) is None
    assert (
        grammar_source(None, parse_tools([{"type": "function", "function": {"name": "f"}}], "auto"))
        is None
    )


def test_a_schema_is_enforced_in_json_dumps_spacing(compiler, tokenizer) -> None:
    grammar = compiler.build(grammar_source(ResponseFormat("json_schema", SCHEMA, "s"), None))
    matcher = grammar.matcher()
    for token in ids(tokenizer, '{"ok": true}'):
        matcher.consume(token)
    assert matcher.is_finished
    refused = grammar.matcher()  # a copy of the prototype, which nothing advanced
    with pytest.raises(GrammarViolation):
        for token in ids(tokenizer, '{ "ok":true}'):
            refused.consume(token)


def test_unimplemented_keywords_are_named(compiler) -> None:
    schema = {"type": "object", "not": {}, "dependentRequired": {"a": ["b"]}}
    with pytest.raises(GrammarError) as caught:
        compiler.build(grammar_source(ResponseFormat("json_schema", schema, "s"), None))
    error = caught.value
    assert (error.param, error.code) == (
        "response_format.json_schema.schema",
        "unsupported_parameter",
    )
    assert "not" in error.message and "dependentRequired" in error.message


def test_forced_call_grammar_takes_exactly_one_hermes_call(compiler, tokenizer) -> None:
    tools = parse_tools(
        [
            {"type": "function", "function": {"name": "a", "parameters": SCHEMA}},
            {"type": "function", "function": {"name": "b"}},
        ],
        "required",
    )
    matcher = compiler.build(grammar_source(None, tools)).matcher()
    for token in ids(
        tokenizer, '<tool_call>\n{"name": "a", "arguments": {"ok": false}}\n</tool_call>'
    ):
        matcher.consume(token)
    assert matcher.is_finished


def test_local_refs_still_resolve_once_nested_under_arguments() -> None:
    parameters = {
        "$defs": {"flag": {"type": "boolean"}},
        "type": "object",
        "properties": {"ok": {"$ref": "#/$defs/flag"}},
    }
    [rule] = [
        line
        for line in tool_call_lark([Tool("f", None, parameters)]).splitlines()
        if "%json" in line
    ]
    schema = json.loads(rule.split("%json", 1)[1])
    assert schema["properties"]["arguments"]["properties"]["ok"] == {
        "$ref": "#/properties/arguments/$defs/flag"
    }


def allowed_ids(words: bytes, vocab: int) -> list[int]:
    """llguidance's bitmask read bit by bit: the reference."""
    return [t for t in range(vocab) if words[t // 8] >> (t % 8) & 1]


def test_mask_matches_llguidance_and_leaves_free_rows_alone(compiler, tokenizer) -> None:
    grammar = compiler.build(grammar_source(ResponseFormat("json_object"), None))
    matcher = grammar.matcher()
    vocab = len(tokenizer)
    logits = torch.zeros(3, vocab)
    GrammarMasks().apply(logits, [None, matcher, None])
    expected = allowed_ids(matcher.ll.compute_bitmask(), vocab)
    assert (~torch.isinf(logits[1])).nonzero().flatten().tolist() == expected
    assert not torch.isinf(logits[0]).any() and not torch.isinf(logits[2]).any()
    assert expected and all(tokenizer.decode([t]).startswith("{") for t in expected)


def test_bias_of_bit_31_and_a_ragged_last_word() -> None:
    words = torch.tensor([[-(2**31), 1]], dtype=torch.int32)  # token 31 and token 32 allowed
    bias = mask_bias(words, 40, byte_table(torch.device("cpu")))
    assert bias.shape == (1, 40)
    assert (bias[0] == 0).nonzero().flatten().tolist() == [31, 32]
    assert torch.isinf(bias).sum() == 38
