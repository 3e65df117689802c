"""End to end through LangChain, unchanged, against `sluice serve` and its own worker on the
tiny model: `OpenAIEmbeddings` (sending text, not tiktoken's token ids: it then needs no
download, and the test lets no connection leave the machine) and `ChatAnthropic` (invoke and
stream, the same greedy text)."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from langchain_anthropic import ChatAnthropic
from langchain_openai import OpenAIEmbeddings

from tests.e2e.conftest import E2E_KEY

TEXTS = ["the cat sat on the mat", "你好, café"]


@pytest.fixture
def loopback_only(monkeypatch):
    """Any connection to a non-loopback address fails the test (tiktoken's encodings are
    downloaded from the internet: nothing here may try)."""
    tried: list = []
    connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            tried.append(address)
            raise OSError(f"no network in this test: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield
    assert tried == []


def test_openai_embeddings_send_text_and_match_the_api(served, client, model, loopback_only):
    embeddings = OpenAIEmbeddings(
        model=model,
        base_url=served.base_url,
        api_key=E2E_KEY,
        check_embedding_ctx_length=False,  # text, not tiktoken ids: no encoding to download
        max_retries=0,
    )
    vectors = embeddings.embed_documents(TEXTS)
    direct = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert len(vectors) == 2
    for got, want in zip(vectors, direct.data, strict=True):
        assert got == pytest.approx(want.embedding, abs=1e-5)
    assert embeddings.embed_query(TEXTS[0]) == pytest.approx(vectors[0], abs=1e-5)


@pytest.fixture(scope="module")
def claude(served, model) -> ChatAnthropic:
    return ChatAnthropic(
        model=model,
        base_url=served.root,
        api_key=E2E_KEY,
        max_tokens=12,
        temperature=0,
        max_retries=0,
    )


def test_chat_anthropic_invokes_and_streams_the_same_text(claude):
    message = claude.invoke("Tell me a story about 你好 and café.")
    assert message.text
    assert message.usage_metadata["output_tokens"] == 12
    assert message.response_metadata["stop_reason"] == "max_tokens"
    streamed = "".join(
        chunk.text for chunk in claude.stream("Tell me a story about 你好 and café.")
    )
    assert streamed == message.text
