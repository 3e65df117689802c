"""The answer of a legacy completion with several prompts, not streamed: each prompt's run
waited for, then one `text_completion` as OpenAI gives it (the choices of every run, indexed
`prompt_index * n + choice`, the usage summed; the first run's id).

The first run to end any way but completed ends the call: the other runs are cancelled and the
answer is that run's error. A client that goes away cancels every run at once: with several
runs there is no one run to come back to, so no disconnect grace applies.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from gateway.app_keys import METRICS, RUNS
from gateway.completions.opening import PromptRun, cancel_runs
from gateway.completions.render import completion_object
from gateway.http.errors import terminal_error
from gateway.runs.follow import following
from gateway.runs.status import RunStatus
from gateway.state.run_store import TerminalRecord

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


def summed_usage(usages: list[dict[str, Any] | None]) -> dict[str, int]:
    """The runs' usage added up, as OpenAI reports a call with several prompts."""
    return {key: sum((usage or {}).get(key, 0) for usage in usages) for key in USAGE_KEYS}


def merged_object(runs: list[PromptRun], terminals: list[TerminalRecord]) -> dict[str, Any]:
    """One `text_completion` of every run's (completed) ending, in the prompts' order."""
    objects = [
        completion_object(t.completion, run.params)
        for run, t in zip(runs, terminals, strict=True)
        if t.completion is not None
    ]
    merged = dict(objects[0])
    merged["choices"] = [choice for obj in objects for choice in obj["choices"]]
    merged["usage"] = summed_usage([obj.get("usage") for obj in objects])
    return merged


async def merged_result(request: web.Request, runs: list[PromptRun]) -> dict[str, Any]:
    """Every run's ending, merged; the first run that fails ends the call with its error."""
    manager = request.app[RUNS]
    try:
        async with contextlib.AsyncExitStack() as stack:
            for run in runs:
                if run.ending is None:
                    await stack.enter_async_context(following(manager, run.run_id))
            terminals = await _endings(request, runs)
    except asyncio.CancelledError:
        request.app[METRICS].disconnects.inc()
        await asyncio.shield(cancel_runs(request.app, runs, "disconnect"))
        raise
    return merged_object(runs, terminals)


async def _endings(request: web.Request, runs: list[PromptRun]) -> list[TerminalRecord]:
    manager = request.app[RUNS]
    waits = {
        asyncio.ensure_future(manager.result(run.run_id)): i
        for i, run in enumerate(runs)
        if run.ending is None
    }
    endings: dict[int, TerminalRecord] = {
        i: run.ending for i, run in enumerate(runs) if run.ending is not None
    }
    try:
        for i in sorted(endings):  # a saved ending that failed ends the call at once
            _check(endings[i])
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                endings[waits[task]] = _check(task.result())
    except asyncio.CancelledError:
        raise  # the client went away: merged_result cancels the runs for that
    except BaseException:  # a run failed: the others are not wanted any more
        await asyncio.shield(cancel_runs(request.app, runs, "client"))
        raise
    finally:
        for task in waits:
            task.cancel()
    return [endings[i] for i in range(len(runs))]


def _check(terminal: TerminalRecord) -> TerminalRecord:
    """The ending of a completed run; else its error, which is the call's answer."""
    if terminal.status is RunStatus.COMPLETED and terminal.completion is not None:
        return terminal
    raise terminal_error(terminal)
