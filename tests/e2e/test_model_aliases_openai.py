"""End to end, a model alias: a real `sluice serve` in front of two OpenAI-compatible servers,
the first of which refuses connections, and the official `openai` client asking for the alias.
The answer comes from the second target, says so in its `model`, and the `x-sluice-route`
header says why the first was passed over; a config naming a model nobody serves does not
start."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from gateway.backends.local_worker import free_port
from tests.support.processes import scripted_upstream_process
from tests.support.serve import Served, serving

CONFIG = """\
[models."chat-default"]
targets = ["dead", "live"]
first_token_timeout = 5
"""
PROMPT = [{"role": "user", "content": "Which target answers?"}]


@pytest.fixture(scope="module")
def live_upstream() -> Iterator[str]:
    """The scripted OpenAI-compatible server as its own process; its base URL."""
    with scripted_upstream_process() as url:
        yield url


def config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def gateway(live_upstream, tmp_path_factory) -> Iterator[Served]:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there: connections refused
    config = config_file(tmp_path_factory.mktemp("alias"), CONFIG)
    flags = ("--upstream", f"dead={dead}", "--upstream", f"live={live_upstream}")
    with serving(None, *flags, "--config", config) as served:
        yield served


def test_the_alias_answers_from_the_second_target_and_says_why(gateway):
    client = OpenAI(base_url=gateway.base_url, api_key=gateway.key, max_retries=0)
    assert "chat-default" in {m.id for m in client.models.list().data}
    raw = client.chat.completions.with_raw_response.create(
        model="chat-default", messages=PROMPT, max_tokens=3
    )
    assert raw.headers["x-sluice-route"] == "dead;skipped=unavailable, live;served"
    completion = raw.parse()
    assert completion.model == "live"
    assert completion.choices[0].message.content == "tok0 tok1 tok2 "


def test_a_stream_for_the_alias_names_the_target_in_every_chunk(gateway):
    client = OpenAI(base_url=gateway.base_url, api_key=gateway.key, max_retries=0)
    with client.chat.completions.with_streaming_response.create(
        model="chat-default", messages=PROMPT, max_tokens=3, stream=True
    ) as response:
        assert response.headers["x-sluice-route"] == "dead;skipped=unavailable, live;served"
        chunks = list(response.parse())
    assert {c.model for c in chunks} == {"live"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "tok0 tok1 tok2 "
    )


def test_an_alias_over_a_model_nobody_serves_does_not_start(live_upstream, tmp_path):
    config = config_file(tmp_path, '[models.chat]\ntargets = ["live", "missing"]\n')
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--api-key", "sk-sluice-x"]
    cmd += ["--port", str(port), "--upstream", f"live={live_upstream}", "--config", config]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "target 'missing' is not a model any backend serves" in done.stderr
