"""A mixed pool under a real `sluice serve`: a local worker, a `--worker-url` worker and an
`--upstream` (a second sluicegate) all serving the tiny model, through the `openai` client. Work
reaches every member, a cancel of a stream on the upstream member stops the run there, and a run
cut on the upstream member goes on on a worker from its text, never a hang."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_worker_faults import metric
from tests.support.serve import Served, serving
from tests.support.waiting import until_sync
from tests.support.worker_process import running_worker

UPSTREAM_KEY = "sk-sluice-upstream"


@pytest.fixture(scope="module")
def mixed(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[Served, Served, str]]:
    """One mixed pool for the module; its last test kills the upstream."""
    model = tiny_model_dir.name
    with (
        running_worker(tiny_model_dir, tmp_path_factory.mktemp("remote")) as remote,
        serving(tiny_model_dir, "--disconnect-grace", "0", key=UPSTREAM_KEY) as upstream,
    ):
        flags = ("--worker-url", remote.url, "--upstream", f"{model}={upstream.base_url}")
        env = {f"SLUICE_UPSTREAM_API_KEY_{model.upper().replace('-', '_')}": UPSTREAM_KEY}
        with serving(tiny_model_dir, *flags, env=env) as gateway:
            until_sync(lambda: len(members(gateway)) == 3, "all three members to be healthy")
            yield gateway, upstream, model


def members(gateway: Served) -> set[str]:
    """The healthy members' names: local:PORT, worker:URL, and the upstream's (its model)."""
    text = httpx.get(f"{gateway.root}/metrics").text
    return {
        s.labels["member"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sluice_pool_member_healthy" and s.value == 1
    }


def client(gateway: Served) -> OpenAI:
    return OpenAI(base_url=gateway.base_url, api_key=gateway.key, max_retries=0)


def stream_on_upstream(gateway: Served, model: str, max_tokens: int, pause=None):
    """A live stream the pool routed to the upstream member, its first chunk read (streams
    routed elsewhere are dropped until one is). `pause`: a process stopped (SIGSTOP) the moment
    the stream's first text is read, so the run has sent tokens and cannot end by itself."""
    for i in range(12):
        before = metric(gateway, "sluice_member_requests_total", member=model)
        stream = client(gateway).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"a long story {i}"}],
            max_tokens=max_tokens,
            temperature=0,  # greedy: a sampled EOS could end the stream before the test acts
            stream=True,
        )
        chunks = iter(stream)
        first = next(chunks)
        if metric(gateway, "sluice_member_requests_total", member=model) > before:
            if pause is not None:
                while not next(chunks).choices[0].delta.content:
                    pass
                pause.send_signal(signal.SIGSTOP)
            return first, chunks
        stream.close()
    raise AssertionError("no stream was routed to the upstream member")


def test_every_member_serves_and_a_cancel_on_the_upstream_stops_it_there(mixed):
    gateway, upstream, model = mixed
    names = members(gateway)
    for i in range(9):
        answer = client(gateway).chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=4,
            temperature=0,  # greedy: a sampled answer may draw EOS within its 4 tokens
        )
        assert answer.choices[0].finish_reason == "length"
    routed = {n: metric(gateway, "sluice_member_requests_total", member=n) for n in names}
    assert sum(routed.values()) == 9 and all(n >= 1 for n in routed.values()), routed

    first, chunks = stream_on_upstream(gateway, model, max_tokens=600)
    client(gateway).post(f"/chat/completions/{first.id}/cancel", cast_to=object)
    with pytest.raises(openai.APIError, match="cancelled"):
        list(chunks)  # the cancel's error frame ends the stream
    until_sync(
        lambda: metric(upstream, "sluice_cancellations_total") >= 1,
        "the upstream to have stopped its run",
    )


def test_a_run_cut_on_the_upstream_member_goes_on_from_its_text(mixed):
    gateway, upstream, model = mixed
    # NOTE: the tiny model writes 900 tokens in under a second; a loaded host could let the
    # upstream finish the run before the kill, so its worker is paused the moment the first
    # text is read: only the kill can end the run
    worker = upstream.worker_process()
    _, chunks = stream_on_upstream(gateway, model, max_tokens=900, pause=worker)
    upstream.proc.send_signal(signal.SIGKILL)
    worker.send_signal(signal.SIGCONT)  # it ends with its gateway
    # the upstream's text has no token ids: a worker goes on from the text itself (the tiny
    # model's bytes re-tokenize differently, so its text is not compared here; the default
    # model's is, in test_upstream_continuation.py)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    assert metric(gateway, "sluice_run_migrations_total", outcome="continued") == 1
