"""A run whose OpenAI-compatible member fails mid-stream goes on on another member from its text.

Two real `sluice serve` processes on the default model (greedy, float32: a text re-tokenized is
the tokens that wrote it, as the tiny random model's bytes are not) are the OpenAI-compatible
members of a third
gateway's pool; the first is reached through a TCP proxy that cuts a stream's connection after a
few chunks, as a dropped network or a dead server would. The run continues on the second member
with the text so far as an open assistant message (`continue_final_message`, which sluicegate's
own chat route takes): with greedy decoding the client's text equals an uninterrupted run's, its
event ids run on without a gap, nothing is repeated, its usage counts both members' tokens, and
the ledger keeps one record."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.test_worker_faults import model_id
from tests.support.serve import Served, serving
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import until_sync
from workers.model_loader import resolve_model_path

MAX_TOKENS = 40
CUT_AFTER_BYTES = 2400  # the role chunk and several content chunks


pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def members() -> Iterator[tuple[Served, Served, TcpProxy]]:
    model = resolve_model_path(None)
    with serving(model) as first, serving(model) as second:
        proxy = TcpProxy(first.port)
        try:
            yield first, second, proxy
        finally:
            proxy.close()


@pytest.fixture(scope="module")
def front(members, tmp_path_factory) -> Iterator[tuple[Served, Path]]:
    first, second, proxy = members
    model = model_id(first)
    ledger = tmp_path_factory.mktemp("front") / "usage.jsonl"
    flags = [
        *("--upstream", f"{model}=http://127.0.0.1:{proxy.port}/v1"),
        *("--upstream", f"{model}=http://127.0.0.1:{second.port}/v1"),
        *("--usage-file", str(ledger)),
        *("--pool-routing", "random"),
    ]
    upstream_key = {f"SLUICE_UPSTREAM_API_KEY_{model.upper().replace('-', '_')}": first.key}
    with serving(None, *flags, key=first.key, env=upstream_key) as gateway:
        yield gateway, ledger


def body(model: str, prompt: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def read_stream(gateway: Served, request: dict) -> dict:
    """One raw SSE stream: its event ids, text, ending and usage."""
    seen: dict = {"ids": [], "text": "", "pieces": [], "errors": [], "usage": None, "finish": None}
    url = f"{gateway.base_url}/chat/completions"
    with httpx.stream("POST", url, json=request, headers=gateway.auth, timeout=60) as resp:
        assert resp.status_code == 200
        seen["run_id"] = resp.headers["x-sluice-run-id"]
        for line in resp.iter_lines():
            if line.startswith("id: "):
                seen["ids"].append(int(line[4:]))
            elif line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    seen["errors"].append(chunk["error"])
                    continue
                seen["usage"] = chunk.get("usage") or seen["usage"]
                for choice in chunk["choices"]:
                    if piece := choice["delta"].get("content"):
                        seen["text"] += piece
                        seen["pieces"].append(piece)
                    seen["finish"] = choice["finish_reason"] or seen["finish"]
    return seen


def cut_run(gateway: Served, proxy: TcpProxy, request: dict) -> dict:
    """A stream that the proxy cut on the first member (routing is random: a run that went to
    the second member is not cut, and is tried again)."""
    cuts = proxy.cuts
    for _ in range(12):
        proxy.cut_streams_after(CUT_AFTER_BYTES)
        seen = read_stream(gateway, request)
        if proxy.cuts > cuts:
            return seen
    raise AssertionError("no run went to the first member in 12 tries")


def test_a_cut_stream_goes_on_on_another_member_from_its_text(members, front):
    first, second, proxy = members
    gateway, ledger = front
    request = body(model_id(first), "Tell me about the sea and the ships on it.")
    whole = read_stream(second, request)  # the uninterrupted run, straight from a member
    assert whole["finish"] and not whole["errors"]

    seen = cut_run(gateway, proxy, request)

    assert not seen["errors"], seen["errors"]
    assert seen["text"] == whole["text"]
    assert seen["finish"] == whole["finish"]
    assert seen["ids"] == list(range(1, len(seen["ids"]) + 1))  # no gap, nothing twice
    # both members' tokens: the first's (carried as text) and the second's own
    assert abs(seen["usage"]["completion_tokens"] - whole["usage"]["completion_tokens"]) <= 2
    assert abs(seen["usage"]["prompt_tokens"] - whole["usage"]["prompt_tokens"]) <= 2

    def records() -> list[dict]:
        lines = ledger.read_text().splitlines() if ledger.exists() else []
        return [r for r in map(json.loads, lines) if r["run_id"] == seen["run_id"]]

    (record,) = until_sync(records, "the run's usage record")
    assert record["status"] == "completed"
    metrics = httpx.get(f"{gateway.root}/metrics").text
    assert re.search(r'sluice_run_migrations_total\{[^}]*outcome="continued"[^}]*\} [1-9]', metrics)


def test_the_openai_client_sees_one_whole_answer_through_a_cut(members, front):
    first, second, proxy = members
    gateway, _ = front
    prompt = "Name three rivers."
    client = OpenAI(base_url=gateway.base_url, api_key=gateway.key, max_retries=0)
    direct = OpenAI(base_url=second.base_url, api_key=second.key, max_retries=0)
    kwargs = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS}
    model = model_id(first)
    whole = direct.chat.completions.create(model=model, temperature=0, **kwargs)

    cuts = proxy.cuts
    for _ in range(12):
        proxy.cut_streams_after(CUT_AFTER_BYTES)
        stream = client.chat.completions.create(model=model, temperature=0, stream=True, **kwargs)
        text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
        if proxy.cuts > cuts:
            break
    assert proxy.cuts > cuts
    assert text == whole.choices[0].message.content


def test_the_gateway_continues_a_final_assistant_message(members):
    """The form a continuing gateway asks in: the text so far as an open assistant message."""
    first, _, _ = members
    model = model_id(first)
    whole = read_stream(first, body(model, "Count with me."))
    head = "".join(whole["pieces"][: len(whole["pieces"]) // 2])  # cut between tokens
    request = body(model, "Count with me.")
    request["messages"].append({"role": "assistant", "content": head})
    request |= {"continue_final_message": True, "add_generation_prompt": False}
    rest = read_stream(first, request)
    # it goes on from the head (for up to max_tokens more, so perhaps past the whole's end)
    full = head + rest["text"]
    shared = min(len(full), len(whole["text"]))
    assert shared > len(head)
    assert full[:shared] == whole["text"][:shared]
