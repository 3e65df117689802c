"""Hostile and malformed input against a real `sluice serve` with its default limits: always an
OpenAI-shaped 4xx naming what was wrong, never a 5xx, never an echo of the request."""

from __future__ import annotations

import httpx
import pytest

from tests.support.serve import Served, serving


@pytest.fixture(scope="module")
def gateway(tiny_model_dir) -> Served:
    with serving(tiny_model_dir) as served:
        yield served


@pytest.fixture(scope="module")
def model(gateway) -> str:
    return httpx.get(f"{gateway.base_url}/models", headers=gateway.auth).json()["data"][0]["id"]


def post(gateway: Served, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/chat/completions",
        json=body,
        headers={**gateway.auth, **headers},
        timeout=60,
    )


def expect_error(resp: httpx.Response, status: int, param: str | None, code: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert set(error) == {"message", "type", "param", "code"}
    assert resp.headers["x-should-retry"] == "false"
    assert resp.headers["x-request-id"].startswith("req_")


USER = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"messages": [{"role": [], "content": "Hi"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": {}, "content": "Hi"}]}, "messages[0].role", "invalid_value"),
        ({"tool_choice": []}, "tool_choice", "invalid_value"),
        ({"tool_choice": {}}, "tool_choice", "invalid_value"),
        ({"response_format": {"type": []}}, "response_format.type", "invalid_value"),
        ({"response_format": {"type": {}}}, "response_format.type", "invalid_value"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "unsupported_parameter",
        ),
    ],
)
def test_wrong_json_types_are_400s_naming_the_field(gateway, model, extra, param, code):
    expect_error(post(gateway, {"model": model, "messages": [USER], **extra}), 400, param, code)


def test_a_prompt_over_the_workers_old_limit_reaches_the_worker(gateway, model):
    """1.1 MB of prompt is under the gateway's 4 MiB: the worker takes it too, and says the
    prompt is longer than the model's context (the field named), instead of a 502."""
    huge = {"role": "user", "content": "word " * 220_000}
    expect_error(
        post(gateway, {"model": model, "messages": [huge]}),
        400,
        "messages",
        "context_length_exceeded",
    )


def test_an_over_long_stop_string_is_a_400_naming_stop(gateway, model):
    body = {"model": model, "messages": [USER], "stop": "x" * (1024 * 1024)}
    expect_error(post(gateway, body), 400, "stop", "invalid_value")


def test_a_body_over_the_gateways_limit_is_413(gateway, model):
    huge = {"role": "user", "content": "x" * (4 * 1024 * 1024 + 1)}
    expect_error(
        post(gateway, {"model": model, "messages": [huge]}), 413, None, "request_too_large"
    )
