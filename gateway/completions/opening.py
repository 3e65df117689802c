"""Opening a legacy completion's runs: one per prompt, each through its own RunLife (its own
Idempotency-Key claim, quota reservation, concurrency slot, deadlines and ledger record), in
the prompts' order.

A call whose later prompt is refused (a quota, a full queue) or whose client goes away while
the runs open leaves none of the earlier runs going: they are cancelled before the refusal is
answered, and settle (refund, ledger record) as any cancelled run does.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.app_keys import RUNS, TENANT
from gateway.completions.request import META, CompletionCall, CompletionParams
from gateway.runs.life import RunLife
from gateway.state.run_store import TerminalRecord

# NOTE: kept in the body an Idempotency-Key's fingerprint is taken of, so that a key first used
# for a chat completion with the same fields is a conflict here, not a replay in the wrong shape
ENDPOINT = {"__endpoint": "completions"}
RUN_IDS_HEADER = "x-sluice-run-ids"  # every run of the call, in the prompts' order


@dataclass(slots=True)
class PromptRun:
    """One prompt's run: its id and answer parameters; `ending` when it is answered from the
    saved ending of the run its Idempotency-Key started, which is no longer kept."""

    run_id: str
    params: CompletionParams
    ending: TerminalRecord | None = None
    headers: dict[str, str] = field(default_factory=dict)


async def open_runs(
    request: web.Request, call: CompletionCall, body: dict[str, Any]
) -> list[PromptRun]:
    """Every prompt's run, opened in order; none is left going when one cannot open."""
    opened: list[PromptRun] = []
    try:
        for chat, params in call.runs():
            opened.append(await _open(request, chat, params, body))
    except asyncio.CancelledError:
        await asyncio.shield(cancel_runs(request.app, opened, "disconnect"))
        raise
    except BaseException:
        await asyncio.shield(cancel_runs(request.app, opened, "client"))
        raise
    return opened


async def _open(
    request: web.Request, chat: Any, params: CompletionParams, body: dict[str, Any]
) -> PromptRun:
    cap = request[TENANT].limits.max_tokens
    if body.get("max_tokens") is None and cap is not None:  # the legacy default within the cap
        chat.max_tokens = min(chat.max_tokens or cap, cap)
    fingerprinted = body | ENDPOINT | ({"__prompt": params.index} if params.index else {})
    life = RunLife(
        request,
        chat,
        fingerprinted,
        run_id=f"cmpl-{uuid.uuid4().hex}",
        meta={META: params.to_meta()},
        key_part=params.index,
    )
    opened = await life.open()
    return PromptRun(opened.run_id, params, opened.ending, opened.headers)


async def cancel_runs(app: web.Application, runs: list[PromptRun], source: str) -> None:
    """Cancel the runs still going (idempotent: an ended run is left as it is)."""
    manager = app[RUNS]
    live = [run.run_id for run in runs if run.ending is None]
    await asyncio.gather(*(manager.cancel(run_id, source) for run_id in live))


def call_headers(runs: list[PromptRun]) -> dict[str, str]:
    """The answer's headers: the last run's (its rate limits are the latest), the first run's
    id, and every run's id."""
    headers = dict(runs[-1].headers)
    headers[RUN_IDS_HEADER] = ", ".join(run.run_id for run in runs)
    return headers
