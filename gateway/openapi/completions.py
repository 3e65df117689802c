"""The legacy Completions API's part of the OpenAPI document (gateway/openapi/document.py): its
routes and schemas, as gateway/completions/request.py checks a request (the chat's ranges for
the shared fields; `prompt` text, token ids or lists of either; `echo` of text without
`logprobs`; `suffix` and `best_of` only when neutral) and as gateway/handlers/completions.py
answers."""

from __future__ import annotations

from typing import Any

from gateway.completions.opening import RUN_IDS_HEADER
from gateway.completions.request import MAX_LOGPROBS, MAX_PROMPTS
from gateway.openapi.document import (
    _RUN_ID,
    FOLLOW_TOKEN_HEADER,
    FOLLOW_TOKEN_PARAM,
    JSON,
    NOTHING_AFTER,
    SSE,
    _answer,
    _errors,
    _get,
)
from gateway.openapi.schemas import SERVICE_TIER, _needs, _nullable, _object, bounded, ref
from gateway.token_ids import MAX_TOKEN_ID
from wire.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS
from wire.share import TIERS

STREAM_TEXT = (
    "Server-sent events: `id: <seq>` and `data: <text_completion chunk>` frames (the event ids "
    "of the run's log, as for a chat completion; with several prompts, the merged stream's own "
    "frame numbers), `: ping` comments while idle, an `error` object if a run fails, then "
    "`data: [DONE]`."
)
RUN_IDS = {
    RUN_IDS_HEADER: {
        "description": "Every run of the call (one per prompt), in the prompts' order.",
        "schema": {"type": "string"},
    }
}


def _prompts() -> tuple[dict[str, Any], dict[str, Any]]:
    """(any prompt the parser takes, a text prompt's: what `echo` needs)."""
    text = {"type": "string", "minLength": 1}
    token_id = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
    ids = {"type": "array", "minItems": 1, "items": token_id}
    texts = {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": text}
    id_lists = {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": ids}
    any_prompt = {
        "anyOf": [text, texts, ids, id_lists],
        "description": "Text, token ids, or a list of either: each prompt is a run of its own; "
        "token ids at or above the model's vocabulary are a 400 naming `prompt`.",
    }
    return any_prompt, {"anyOf": [text, texts]}


def _request() -> dict[str, Any]:
    any_prompt, text_prompt = _prompts()
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    echo = {  # echo needs a text prompt, and no logprobs (the prompt's own are not available)
        "if": {"required": ["echo"], "properties": {"echo": {"const": True}}},
        "then": {"properties": {"prompt": text_prompt, "logprobs": {"type": "null"}}},
    }
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "description": "OpenAI's legacy Completions request; unknown fields are ignored. "
        "`echo` with token ids or with `logprobs`, `suffix`, and `best_of` other than `n` are "
        "a 400 naming them.",
        "allOf": [_needs("stream_options", {"type": "object"}, "stream"), echo],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "prompt": any_prompt,
            "stream": _nullable("boolean"),
            "stream_options": {
                "type": ["object", "null"],
                "description": "Only with `stream: true`.",
                "properties": {"include_usage": _nullable("boolean")},
            },
            "max_tokens": bounded("max_tokens", description="16 when absent, as OpenAI's."),
            "temperature": bounded("temperature"),
            "top_p": bounded("top_p"),
            "seed": bounded("seed"),
            "stop": {
                "anyOf": [
                    stop_string,
                    {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": stop_string},
                    {"type": "null"},
                ]
            },
            "n": bounded("n"),
            "logprobs": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": MAX_LOGPROBS,
                "description": "How many most likely alternatives to return per token.",
            },
            "presence_penalty": bounded("presence_penalty"),
            "frequency_penalty": bounded("frequency_penalty"),
            "echo": {
                "type": ["boolean", "null"],
                "description": "Each choice's text begins with its prompt.",
            },
            "suffix": {"enum": [None, ""]},
            "best_of": {
                "type": "null",
                "description": "Accepted only equal to `n` (then it changes nothing).",
            },
            "user": _nullable("string"),
            "service_tier": SERVICE_TIER,
        },
    }


def _completion() -> dict[str, Any]:
    choice = _object(
        ["text", "index", "logprobs", "finish_reason"],
        text={"type": "string"},
        index={"type": "integer"},
        logprobs={"type": ["object", "null"]},
        finish_reason={
            "enum": ["stop", "length", "content_filter", None],
            "description": "null for a choice that never finished (its run ended early).",
        },
    )
    return _object(
        ["id", "object", "created", "model", "choices"],
        id={"type": "string"},
        object={"const": "text_completion"},
        created={"type": "integer"},
        model={"type": "string"},
        service_tier={"enum": list(TIERS), "description": "The tier that served it."},
        choices={"type": "array", "items": choice},
        usage={"type": ["object", "null"]},
        status={
            "enum": ["queued", "in_progress", "completed", "cancelled", "timed_out", "failed"],
            "description": "The run's status (on a retrieved completion).",
        },
        follow_token={"type": "string", "description": "Reads this run by `?token=`."},
    )


def _paths() -> dict[str, Any]:
    completion = {JSON: {"schema": ref("TextCompletion")}}
    either = {**completion, SSE: {"schema": ref("TextCompletionStreamEvent")}}
    create = {
        "operationId": "createCompletion",
        "summary": "Start a run on a raw prompt (no chat template); answer it whole, or stream "
        "it (`stream: true`).",
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": ref("CompletionRequest")}},
        },
        "responses": {
            "200": _answer("The completion.", either, {**FOLLOW_TOKEN_HEADER, **RUN_IDS}),
            **_errors(400, 401, 403, 404, 408, 413, 415, 422, 429, 499, 502, 503, 504),
        },
    }
    stream = {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}}
    after = {
        "name": "starting_after",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 0},
        "description": "Resume: replay the events after this event id, then follow.",
    }
    retrieve = _get(
        "retrieveCompletion",
        {
            "200": _answer("The completion's run.", either, FOLLOW_TOKEN_HEADER),
            "204": NOTHING_AFTER,
            **_errors(400, 401, 404, 410, 503),
        },
        summary="The run's `text_completion` with its status and `follow_token`, or "
        "(`stream=true`) its events; `Last-Event-ID`, when sent, wins over `starting_after`.",
        parameters=[_RUN_ID, stream, after, FOLLOW_TOKEN_PARAM],
    )
    cancel = {
        "operationId": "cancelCompletion",
        "summary": "Cancel the run (idempotent); answers its terminal status.",
        "parameters": [_RUN_ID],
        "responses": {"200": _answer("The run as it ended.", completion), **_errors(401, 404, 503)},
    }
    return {
        "/v1/completions": {"post": create},
        "/v1/completions/{id}": retrieve,
        "/v1/completions/{id}/cancel": {"post": cancel},
    }


def with_completions(document: dict[str, Any]) -> dict[str, Any]:
    """The document with the legacy Completions routes and schemas added."""
    event = _object(["data"], id={"type": "string", "pattern": "^[0-9]+$"}, data={"type": "string"})
    event["description"] = STREAM_TEXT
    document["paths"].update(_paths())
    document["components"]["schemas"].update(
        {
            "CompletionRequest": _request(),
            "TextCompletion": _completion(),
            "TextCompletionStreamEvent": event,
        }
    )
    return document
