"""What a load user expects of an answer, and how a broken one becomes a locust failure.

A failure is anything a client of sluicegate should never see: a 5xx, an unexpected 4xx, a
malformed frame, a stream without `[DONE]`, an error frame other than an expected `cancelled`,
a resume that skips or repeats an event, a repeat that is not the same run. A 429 with
`retry-after` for a tenant whose limits the load means to hit is not one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import requests
from locust.clients import ResponseContextManager
from sse_frames import ChatStream, StreamViolation

REFUSAL_CODES = ("rate_limit_exceeded", "insufficient_quota")


class Unexpected(Exception):
    """An answer that is well formed but not what sluicegate promises."""


@contextlib.contextmanager
def checked(resp: ResponseContextManager) -> Iterator[ResponseContextManager]:
    """Report `resp` as failed, with the reason, when the block finds it broken."""
    with resp:
        try:
            yield resp
        except (StreamViolation, Unexpected) as exc:
            resp.failure(str(exc))
        except (requests.RequestException, ValueError) as exc:  # a cut connection, bad JSON
            resp.failure(f"{type(exc).__name__} while reading the answer")


def error_code(resp: requests.Response) -> str:
    """The OpenAI-shaped error's code, or what is wrong with the body instead."""
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "(not an OpenAI error body)"
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= error.keys():
        return "(error body without message, type, param and code)"
    return str(error["code"])


def unexpected_status(resp: requests.Response, what: str) -> Unexpected:
    return Unexpected(f"{what} answered HTTP {resp.status_code} {error_code(resp)}")


def expect_retry_after(resp: requests.Response) -> None:
    """A tenant's expected 429: OpenAI's error shape, a refusal code and `retry-after`."""
    code = error_code(resp)
    if code not in REFUSAL_CODES:
        raise Unexpected(f"a 429 with code {code}")
    raw = resp.headers.get("retry-after")
    if raw is None:
        raise Unexpected("a 429 without retry-after")
    try:
        seconds = float(raw)
    except ValueError:
        raise Unexpected(f"a 429 with retry-after {raw[:20]!r}") from None
    if seconds < 0:
        raise Unexpected("a 429 with a negative retry-after")


def expect_event_stream(resp: requests.Response) -> None:
    content_type = resp.headers.get("content-type", "")
    if not content_type.startswith("text/event-stream"):
        raise Unexpected(f"a stream answered with content-type {content_type[:40]!r}")


def expect_finished(stream: ChatStream) -> None:
    """The stream ended as a completed run's does: a finish reason, usage, no error frame."""
    if stream.error is not None:
        raise Unexpected(f"error frame {stream.error['code']!r}")
    if stream.finish_reason is None:
        raise Unexpected("a stream that ended with no finish_reason")
    if stream.usage is None:
        raise Unexpected("no usage chunk though stream_options.include_usage was set")


def expect_cancelled(stream: ChatStream, status: str) -> None:
    """The stream agrees with what `…/cancel` answered."""
    if status == "completed":
        expect_finished(stream)
    elif stream.error is None or stream.error["code"] != "cancelled":
        got = "no error frame" if stream.error is None else f"error {stream.error['code']!r}"
        raise Unexpected(f"the cancel answered 'cancelled' but the stream ended with {got}")


def expect_same_text(stream_text: str, final: dict) -> None:
    """What the client assembled from frames is the run's final text, no more and no less."""
    choices = final.get("choices") or [{}]
    content = (choices[0].get("message") or {}).get("content") or ""
    if stream_text != content:
        common = len(_common_prefix(stream_text, content))
        raise Unexpected(
            f"streamed text differs from the run's final text at character {common} "
            f"({len(stream_text)} streamed, {len(content)} final)"
        )


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]
