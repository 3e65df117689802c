"""Grammars for constrained decoding (llguidance): a response format's JSON Schema, or a forced
tool call, compiled per request before it enters the engine.

Why llguidance (bench/grammar_choice.py, this 2-core CPU, SmolLM2's 49152-token vocabulary):
it compiles a mid-size schema in ~1.3 ms (xgrammar: ~28 ms cold), computes a step's mask in
~0.08 ms at batch 1 and ~1.5 ms at batch 32 (well under 2% of a 120-160 ms default-model step
at c=32), and it names the JSON Schema keywords it cannot enforce ("Unimplemented keys: [not]")
where xgrammar silently ignores them, so an unsupported schema is a 400 naming them rather than
output that does not validate. Its Lark grammars embed `%json{...}`, which is the forced call.

Compiling happens off the engine thread, on a small pool of its own, under a timeout: a
pathological schema must not freeze the engine (vLLM #54003). llguidance's own limits bound the
work too; the timeout is the net under them. A compile that overruns keeps its pool thread until
it ends, and the request gets a 400.

NOTE: JSON is constrained to json.dumps's spacing (`", "`, `": "`, no other whitespace): with
free whitespace a model, a random one certainly, can pad between tokens until max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf

from wire.output_spec import ResponseFormat, Tool, ToolSpec
from workers.tool_parser import CLOSE, OPEN

JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
DEFAULT_COMPILE_TIMEOUT_S = 5.0
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")


class GrammarError(ValueError):
    """A grammar cannot be built for this request: a 400 naming `param`, with `code`."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


class GrammarViolation(RuntimeError):
    """A token the grammar refuses reached the matcher (the mask should have prevented it)."""


@dataclass(frozen=True, slots=True)
class GrammarSource:
    """A grammar in llguidance's serialised form, the request field it comes from, and for a
    forced call the tools it offers (with their index in `tools`, to name a bad one)."""

    text: str
    param: str
    tools: tuple[tuple[int, Tool], ...] = ()


class Matcher:
    """One sequence's grammar state; the engine thread alone advances it."""

    __slots__ = ("ll",)

    def __init__(self, ll: llguidance.LLMatcher) -> None:
        self.ll = ll

    def consume(self, token_id: int) -> None:
        if not self.ll.consume_token(token_id):
            raise GrammarViolation("the sampled token is outside the grammar")

    def accepts(self, ids: Sequence[int]) -> bool:
        """Whether the grammar takes all of `ids` from here, in order; it does not advance."""
        return self.ll.validate_tokens(list(ids)) == len(ids)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow, so the sequence stops."""
        return self.ll.is_stopped()


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A checked matcher that is never advanced; each choice starts from a copy (~1 us)."""

    prototype: llguidance.LLMatcher

    def matcher(self) -> Matcher:
        return Matcher(self.prototype.deep_copy())

    def accepts(self, ids: Sequence[int]) -> bool:
        """Whether the grammar takes `ids` from its start (a continuation's check)."""
        return self.matcher().accepts(ids)


def _reroot(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s pointing below `base`, where it is being nested."""
    if isinstance(schema, dict):
        out = {k: _reroot(v, base) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(schema, list):
        return [_reroot(v, base) for v in schema]
    return schema


def _call_schema(tool: Tool) -> dict[str, Any]:
    """`{"name": <the tool's name>, "arguments": <its parameters>}`, in that order."""
    parameters = tool.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": _reroot(parameters, "#/properties/arguments"),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }


def tool_call_lark(tools: Collection[Tool]) -> str:
    """One Hermes call, `<tool_call>\\n{json}\\n</tool_call>`, to one of `tools`."""
    rules = [f"call_{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(tools)]
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = f"start: {json.dumps(OPEN + chr(10))} ({calls}) {json.dumps(chr(10) + CLOSE)}"
    return "\n".join([start, *rules]) + "\n"


def grammar_source(fmt: ResponseFormat | None, tools: ToolSpec | None) -> GrammarSource | None:
    """The grammar a request needs, or None: a forced tool call, else its response format."""
    forced = tools.forced if tools is not None else ()
    if forced and fmt is not None:
        raise GrammarError(
            "response_format",
            "response_format cannot be combined with tool_choice 'required' or a named function",
        )
    if forced:
        assert tools is not None
        lark = llguidance.LLMatcher.grammar_from_lark(tool_call_lark(forced))
        indexed = tuple((i, t) for i, t in enumerate(tools.tools) if t in forced)
        return GrammarSource(lark, "tools", indexed)
    if fmt is None:
        return None
    schema = {"type": "object"} if fmt.type == "json_object" else fmt.schema
    param = "response_format" if fmt.type == "json_object" else "response_format.json_schema.schema"
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(param, f"{param} is not a valid JSON Schema: {e}") from None
    return GrammarSource(text, param)


def _refusal(param: str, error: str) -> GrammarError:
    """An OpenAI-shaped 400 for llguidance's error text (the schema is the caller's own)."""
    unimplemented = _UNIMPLEMENTED.search(error)
    if unimplemented:
        keys = ", ".join(json.loads(unimplemented.group(1)))
        return GrammarError(
            param,
            f"{param} uses JSON Schema keywords this worker cannot enforce: {keys}",
            "unsupported_parameter",
        )
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    return GrammarError(param, f"{param} cannot be enforced: {first[:300]}")


class GrammarCompiler:
    """One per model: llguidance's view of the tokenizer (built once, ~1 s for 49k tokens) and
    the pool that compiles off the engine thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int],
        *,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self.timeout_s = timeout_s
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-grammar")

    def build(self, source: GrammarSource) -> CompiledGrammar:
        """Compile and check (blocking; llguidance drops the GIL meanwhile)."""
        matcher = llguidance.LLMatcher(
            self.ll_tokenizer, source.text, log_level=0, limits=self._limits
        )
        if matcher.is_error():
            raise self._which_tool(source) or _refusal(source.param, matcher.get_error())
        return CompiledGrammar(matcher)

    def _which_tool(self, source: GrammarSource) -> GrammarError | None:
        """For a forced call: the first tool whose parameters alone fail, named."""
        for i, tool in source.tools:
            if tool.parameters is None:
                continue
            text = llguidance.LLMatcher.grammar_from_json_schema(tool.parameters)
            problem = llguidance.LLMatcher.validate_grammar(text, self.ll_tokenizer)
            if problem:
                return _refusal(f"tools[{i}].function.parameters", problem)
        return None

    async def compile(
        self, fmt: ResponseFormat | None, tools: ToolSpec | None
    ) -> CompiledGrammar | None:
        """The request's grammar, or None; raises GrammarError (a 400) on a bad schema or a
        compile past the timeout."""
        source = grammar_source(fmt, tools)
        if source is None:
            return None
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.build, source)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                source.param,
                f"compiling {source.param} took longer than {self.timeout_s:g} s; simplify it",
                "schema_too_complex",
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
