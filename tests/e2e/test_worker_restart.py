"""The only local worker of a real `sluice serve` on the tiny model, SIGKILLed (design §11): from
its exit until the restarted process serves, `/readyz` is 503 and names it `restarting`; the
requests sent meanwhile through the real `openai` client, streaming and not, wait for it
`queued` and all succeed (none gets a 503); a waiting run can be retrieved and cancelled; and a
request that asks not to wait (`x-sluice-no-wait: true`) gets its 503 at once."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.test_worker_faults import metric, model_id
from tests.support.serve import serving
from tests.support.waiting import until_sync

# alone (tests/support/tiers.py): it times how soon a killed worker serves again
pytestmark = pytest.mark.alone

PING = 0.5  # a waiting stream's headers (and its run id) come within one ping interval
MESSAGES = [{"role": "user", "content": "Hi"}]


def complete(client: OpenAI, model: str) -> tuple[str, str]:
    """Greedy (no EOS drawn: testkit/tiny_model.py), so a whole answer is 8 tokens of text."""
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0
    )
    choice = answer.choices[0]
    return choice.message.content or "", choice.finish_reason


def stream(client: OpenAI, model: str) -> tuple[str, str]:
    chunks = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    )
    text, finish = "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_a_killed_only_worker_is_not_ready_until_it_serves_and_requests_wait_for_it(
    tiny_model_dir,
):
    with serving(tiny_model_dir, "--ping-interval", str(PING)) as gateway:
        client = OpenAI(base_url=gateway.base_url, api_key=gateway.key, max_retries=0)
        model = model_id(gateway)
        worker_url = gateway.worker_url()
        member = "local:" + worker_url.rsplit(":", 1)[1]
        readyz = f"{gateway.root}/readyz"
        first = gateway.worker_process()
        first.send_signal(signal.SIGKILL)
        first.wait(10)

        # out of readiness from the exit itself, not a probe later, and named
        gap = httpx.get(readyz)
        assert gap.status_code == 503
        assert gap.json()["status"] == "unavailable"
        assert gap.json()["restarting"] == {model: [member]}

        # the caller that may not wait: a 503 at once
        began = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(
                model=model,
                messages=MESSAGES,
                max_tokens=4,
                extra_headers={"x-sluice-no-wait": "true"},
            )
        assert refused.value.status_code == 503 and refused.value.code == "overloaded"
        assert time.monotonic() - began < 1.0

        with ThreadPoolExecutor(6) as pool:
            waiting = [pool.submit(complete, client, model) for _ in range(3)]
            waiting += [pool.submit(stream, client, model) for _ in range(3)]

            # a waiting run is a run: retrievable while queued, and cancellable
            cancelled = client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=8, stream=True
            )
            run_id = cancelled.response.headers["x-sluice-run-id"]
            runs = f"{gateway.base_url}/chat/completions/{run_id}"
            status = httpx.get(runs, headers=gateway.auth).json()["status"]
            assert httpx.get(readyz).status_code == 503  # so the run was still waiting
            assert status == "queued"
            cancel = httpx.post(f"{runs}/cancel", headers=gateway.auth)
            assert cancel.json()["status"] == "cancelled"
            cancelled.close()

            def serves() -> bool:
                """/readyz says 200 only once the new process itself answers ready."""
                if httpx.get(readyz).status_code != 200:
                    return False
                assert httpx.get(f"{worker_url}/health").status_code == 200
                return True

            until_sync(serves, "the restarted worker to serve", within=120)
            answers = [f.result(timeout=60) for f in waiting]  # none raised: no 503, no error
        assert all(text and finish == "length" for text, finish in answers), answers
        assert gateway.worker_process().pid != first.pid
        assert httpx.get(readyz).json() == {
            "status": "ready",
            "models": {model: True},
            "store": "in-process",
        }
        assert metric(gateway, "sluice_local_worker_restarts_total") == 1
