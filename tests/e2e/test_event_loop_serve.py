"""End to end, the `event_loop` setting: `sluice serve` runs on uvloop by default and on
asyncio's own loop when told, says which when it is ready, and streams, cancels and refuses
the same on either; a loop it does not know stops it at start with the setting named."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from gateway.backends.local_worker import free_port
from tests.support.processes import scripted_upstream_process
from tests.support.serve import serving

PROMPT = [{"role": "user", "content": "Count."}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with scripted_upstream_process() as url:
        yield url


@pytest.mark.parametrize("loop", [None, "uvloop", "asyncio"])
def test_serve_streams_and_cancels_on_the_loop_it_was_told(upstream, loop):
    env = {} if loop is None else {"SLUICE_EVENT_LOOP": loop}
    flags = ("--upstream", f"scripted={upstream}")
    with serving(None, *flags, env=env, stdout=subprocess.PIPE) as served:
        client = OpenAI(base_url=served.base_url, api_key=served.key, max_retries=0)
        stream = client.chat.completions.create(
            model="scripted", messages=PROMPT, max_tokens=5, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "tok0 tok1 tok2 tok3 tok4 "
        # a slow stream cancelled by its run's id ends `cancelled`, its stream with an error
        auth = {"Authorization": f"Bearer {served.key}"}
        body = {"model": "scripted", "messages": PROMPT, "max_tokens": 500, "stream": True}
        body["metadata"] = {"delay_ms": "20"}
        url = f"{served.base_url}/chat/completions"
        with httpx.stream("POST", url, headers=auth, json=body, timeout=30) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            run_id = json.loads(first.removeprefix("data: "))["id"]
            cancelled = httpx.post(f"{url}/{run_id}/cancel", headers=auth, timeout=30)
            assert cancelled.status_code == 200
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "cancelled"
        assert httpx.get(f"{url}/{run_id}", headers=auth).json()["status"] == "cancelled"
        refused = client.chat.completions.with_raw_response  # bad input: an OpenAI error
        with pytest.raises(Exception) as error:
            refused.create(model="scripted", messages=PROMPT, temperature=7)
        assert error.value.status_code == 400
        assert error.value.body["param"] == "temperature"
    ready = served.proc.stdout.read().decode()
    assert f"({loop or 'uvloop'})" in ready.splitlines()[-1]


def test_an_unknown_event_loop_stops_serve_at_start_naming_the_setting(upstream):
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--api-key", "sk-sluice-x"]
    cmd += ["--port", str(free_port()), "--upstream", f"scripted={upstream}"]
    done = subprocess.run(
        cmd, env={"SLUICE_EVENT_LOOP": "trio", "PATH": ""}, capture_output=True, timeout=60
    )
    assert done.returncode == 2
    assert "event_loop must be one of uvloop, asyncio, not 'trio'" in done.stderr.decode()
