"""The remote checker: an OpenAI-compatible `POST /v1/moderations` endpoint judges the text.

A call per token would cost more than the generation, so the checker batches: it asks once at
least `batch_chars` of unjudged text are held (or the text is final), sending that text with a
little of what it already approved as context. Until it has approved text, that text stays
held. Each call has a deadline; what a timeout or a failure means is the policy's `on_error`:
`block` (the default: fail closed) or `allow`.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import aiohttp
import structlog

from safety.checkers import Held, Verdict

log = structlog.get_logger("sluice.safety")
_CONTEXT = 200  # characters of approved text sent again, so a call sees what came before


@dataclass(slots=True, frozen=True)
class ModerationSettings:
    url: str  # the full endpoint, e.g. https://api.openai.com/v1/moderations
    timeout: float = 2.0
    model: str | None = None
    api_key_env: str | None = None  # the environment variable holding its bearer key
    on_error: str = "block"  # or "allow"


class ModerationFailed(Exception):
    """The endpoint did not answer in time, or not with a verdict."""


class ModerationClient:
    """One HTTP session for every run's moderation calls (the app owns it and closes it)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def flagged(self, settings: ModerationSettings, text: str) -> bool:
        """Whether the endpoint flags `text`; raises ModerationFailed."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        body: dict = {"input": text}
        if settings.model:
            body["model"] = settings.model
        headers = {}
        if settings.api_key_env and (key := os.environ.get(settings.api_key_env)):
            headers["Authorization"] = f"Bearer {key}"
        try:
            async with asyncio.timeout(settings.timeout):
                async with self._session.post(settings.url, json=body, headers=headers) as resp:
                    if resp.status != 200:
                        raise ModerationFailed(f"status {resp.status}")
                    answer = await resp.json(content_type=None)
            return any(bool(r.get("flagged")) for r in answer["results"])
        except ModerationFailed:
            raise
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            raise ModerationFailed(type(exc).__name__) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class RemoteModeration:
    """The checker for one choice: it remembers how far its endpoint has approved the text."""

    name = "moderation"

    def __init__(
        self, client: ModerationClient, settings: ModerationSettings, batch_chars: int
    ) -> None:
        self.client = client
        self.settings = settings
        self.batch_chars = max(1, batch_chars)
        self.approved = 0  # in the choice's whole text

    async def check(self, held: Held) -> Verdict:
        end = held.offset + len(held.text)
        start = held.offset + held.start
        if self.approved < start:
            self.approved = start
        if end - self.approved < self.batch_chars and not (held.final and end > self.approved):
            return Verdict(self.approved - held.offset)
        begin = max(held.offset, self.approved - _CONTEXT) - held.offset
        try:
            flagged = await self.client.flagged(self.settings, held.text[begin:])
        except ModerationFailed as exc:
            log.warning("moderation check failed", reason=str(exc), on_error=self.settings.on_error)
            if self.settings.on_error == "allow":
                self.approved = end
                return Verdict(len(held.text), error=True)
            return Verdict(held.start, block=self.name, error=True)
        if flagged:
            return Verdict(held.start, block=self.name)
        self.approved = end
        return Verdict(len(held.text))
