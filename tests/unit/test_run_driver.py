"""The run driver over a scripted upstream and the in-process store: every terminal path writes
its last event, reaches exactly one terminal state, stops the upstream, and is accounted once."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adapters.base import BackendFailed, BackendRejected
from adapters.events import Admitted, ErrorEvent, Event, Finish, TextDelta, Usage
from adapters.requests import ChatRequest, Message
from gateway.http.errors import terminal_error
from gateway.metrics import GatewayMetrics
from gateway.runs.deadlines import Deadlines
from gateway.runs.driver import RunDriver
from gateway.runs.endings import LOST_CAUSE, ending
from gateway.runs.spec import RunSpec
from gateway.runs.status import RunStatus
from gateway.state.run_store import RunRecord, TerminalRecord
from gateway.state.run_store_memory import MemoryRunStore
from testkit.scripted_adapter import ScriptedAdapter, text_script


async def make_driver(
    script,
    deadlines=None,
    *,
    abortable=True,
    confirm_timeout=5.0,
    store=None,
    stages=(),
    settle=None,
    **chat,
):
    store = store or MemoryRunStore()
    adapter = ScriptedAdapter("m", script, abortable=abortable)
    await store.create(RunRecord("run-1", "t", "m", 0.0))
    request = ChatRequest("m", [Message("user", "hi")], stream=True, **chat)
    spec = RunSpec("run-1", request, adapter, "t", deadlines=deadlines or Deadlines())
    driver = RunDriver(
        spec,
        store,
        metrics=GatewayMetrics(),
        confirm_timeout=confirm_timeout,
        stages=stages,
        settle=settle,
    )
    return store, adapter, driver


class StatusLog(MemoryRunStore):
    """The in-process store, noting the status its record holds after each change the driver
    asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.entered: list[RunStatus] = []

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        moved = await super().advance(run_id, status)
        self.entered.append((await self.get(run_id)).status)
        return moved

    async def finish(self, run_id: str, terminal: TerminalRecord, final=None) -> bool:
        won = await super().finish(run_id, terminal, final)
        self.entered.append((await self.get(run_id)).status)
        return won


class SlowJudge:
    """A stage that lets everything through, but holds the batch with `text` in it until its
    verdict is given (a remote checker's round trip)."""

    stop_source = None

    def __init__(self, text: str) -> None:
        self.text = text
        self.judging = asyncio.Event()
        self.verdict = asyncio.Event()

    async def feed(self, events: list[Event]) -> list[Event]:
        if any(type(e) is TextDelta and e.text == self.text for e in events):
            self.judging.set()
            await self.verdict.wait()
        return events

    async def finish(self) -> list[Event]:
        return []


async def log(store) -> list[dict]:
    return [orjson.loads(e[1]) for e in await store.read("run-1", 0)]


async def streaming(store, events: int = 1) -> None:
    """Until the run's log holds its role chunk and `events` more: the stream is flowing."""
    await asyncio.wait_for(store.wait("run-1", events), 5)


def texts(events: list[dict]) -> str:
    return "".join(
        c["delta"].get("content") or "" for e in events if "choices" in e for c in e["choices"]
    )


def samples(driver: RunDriver, name: str) -> dict[tuple, float]:
    """The series counted (every known one is exported at 0 from the start)."""
    text = generate_latest(driver.acct.metrics.registry).decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.value
    }


async def test_a_completed_run_logs_every_chunk_and_its_object():
    store, adapter, driver = await make_driver(text_script(["a", "b", "c"]), include_usage=True)
    record = (await driver.start()).terminal
    events = await log(store)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert texts(events) == "abc"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert record.status == RunStatus.COMPLETED and record.finish_reason == "stop"
    assert record.completion_object()["choices"][0]["message"]["content"] == "abc"
    assert (await store.get("run-1")).status == RunStatus.COMPLETED
    assert adapter.aborted == {"run-1": False}
    assert samples(driver, "sluice_tokens_total") == {
        (("kind", "sent"),): 3.0,
        (("kind", "generated"),): 3.0,
        (("kind", "prompt"),): 5.0,
    }
    assert samples(driver, "sluice_cancellations_total") == {}


async def test_cancel_mid_stream_ends_cancelled_is_confirmed_and_clean():
    store, adapter, driver = await make_driver(
        text_script([f"t{i}" for i in range(100)], delay=0.01)
    )
    task = driver.start()
    await streaming(store, 3)
    assert driver.cancel("client")
    assert not driver.cancel("disconnect")  # idempotent: the first source stands
    record = (await task).terminal
    assert (record.status, record.cause) == (RunStatus.CANCELLED, "cancel:client")
    events = await log(store)
    assert events[-1]["error"]["code"] == "cancelled"
    assert adapter.abort_calls == ["run-1"]
    assert adapter.aborted == {"run-1": True}
    assert driver.acct.tail_tokens == 0
    assert samples(driver, "sluice_cancellations_total") == {
        (("outcome", "clean"), ("source", "client")): 1.0
    }
    latency = samples(driver, "sluice_cancel_latency_seconds_count")
    assert latency == {(): 1.0}


async def test_a_cancel_asks_the_upstream_and_ends_the_run_in_the_cancellers_step():
    """The stop starts eagerly (gateway/eager_tasks.py): by the time `cancel` returns, the
    abort has been asked for and the ending is in the log, not a turn of the loop later."""
    store, adapter, driver = await make_driver(
        text_script([f"t{i}" for i in range(100)], delay=0.01)
    )
    task = driver.start()
    await streaming(store, 3)
    assert driver.cancel("client")
    assert adapter.abort_calls == ["run-1"]
    assert driver.terminal is not None and driver.terminal.status is RunStatus.CANCELLED
    assert (await log(store))[-1]["error"]["code"] == "cancelled"
    assert (await task).terminal is driver.terminal


async def test_tokens_arriving_after_the_cancel_are_tail_not_sent():
    gate = asyncio.Event()

    async def slow_stop(request_id):  # the upstream takes a while to stop: two more tokens
        gate.set()
        return True

    def script(request):
        return [TextDelta("a"), 0.2, TextDelta("b", tokens=2), Finish("stop"), Usage(5, 3)]

    store, adapter, driver = await make_driver(script, abortable=False)
    adapter.abort = slow_stop  # in-band, but the script does not listen: it just finishes
    task = driver.start()
    await streaming(store)  # "a" is in the log
    driver.cancel("client")
    record = (await task).terminal
    assert record.status == RunStatus.CANCELLED
    assert texts(await log(store)) == "a"  # "b" never reached the log
    assert (driver.acct.sent_tokens, driver.acct.tail_tokens) == (1, 2)
    assert driver.acct.generated_tokens == 3
    assert samples(driver, "sluice_cancellations_total") == {
        (("outcome", "tail"), ("source", "client")): 1.0
    }
    assert samples(driver, "sluice_cancel_tail_tokens_sum") == {(): 2.0}


async def test_an_upstream_without_in_band_abort_has_its_stream_closed_unconfirmed():
    store, adapter, driver = await make_driver(
        text_script([f"t{i}" for i in range(100)], delay=0.01), abortable=False
    )
    task = driver.start()
    await streaming(store, 3)
    driver.cancel("client")
    record = (await task).terminal
    assert record.status == RunStatus.CANCELLED
    assert adapter.aborted == {"run-1": True}  # closed early
    assert samples(driver, "sluice_cancellations_total") == {
        (("outcome", "unconfirmed"), ("source", "client")): 1.0
    }


async def test_an_upstream_that_never_confirms_is_closed_after_the_confirm_timeout():
    async def ignore(request_id):
        return True  # claims it will confirm, then never does

    store, adapter, driver = await make_driver(
        lambda r: [TextDelta("a"), 30.0, TextDelta("b")], abortable=False, confirm_timeout=0.1
    )
    adapter.abort = ignore
    task = driver.start()
    await streaming(store)
    driver.cancel("client")
    outcome = await asyncio.wait_for(task, 2)
    assert outcome.status == RunStatus.CANCELLED
    assert adapter.aborted == {"run-1": True}
    assert outcome.cancel_outcome == "unconfirmed"


async def test_a_cancel_before_the_first_step_still_ends_the_run():
    _store, adapter, driver = await make_driver(text_script(["a"]))
    task = driver.start()
    driver.cancel("client")  # before the task ran a line
    outcome = await task
    assert outcome.status == RunStatus.CANCELLED
    assert adapter.requests == []  # the upstream was never asked
    assert outcome.cancel_outcome == "clean"


@pytest.mark.parametrize(
    ("script", "deadlines", "cause"),
    [
        (lambda r: [1.0, TextDelta("late")], Deadlines(queue=0.05), "deadline:queue"),
        (lambda r: [Admitted(), 1.0, TextDelta("late")], Deadlines(ttft=0.05), "deadline:ttft"),
        (
            lambda r: [TextDelta("a"), 1.0, TextDelta("b")],
            Deadlines(inter_token=0.05),
            "deadline:inter_token",
        ),
        (
            text_script(["x"] * 100, delay=0.01),
            Deadlines(total=0.1, inter_token=5),
            "deadline:total",
        ),
    ],
)
async def test_each_deadline_is_its_own_cause_and_stops_the_upstream(script, deadlines, cause):
    store, adapter, driver = await make_driver(script, deadlines)
    record = (await driver.start()).terminal
    assert (record.status, record.cause) == (RunStatus.TIMED_OUT, cause)
    assert (await log(store))[-1]["error"]["code"] == "timeout"
    assert adapter.aborted == {"run-1": True}
    assert samples(driver, "sluice_cancellations_total") == {
        (("outcome", "clean"), ("source", "timeout")): 1.0
    }


async def test_admission_lifts_the_queue_deadline():
    _store, _, driver = await make_driver(
        lambda r: [Admitted(), 0.15, TextDelta("a"), Finish("stop")], Deadlines(queue=0.05)
    )
    assert (await driver.start()).status == RunStatus.COMPLETED


async def test_an_upstream_error_event_fails_the_run_with_its_own_error():
    store, _, driver = await make_driver(
        lambda r: [TextDelta("a"), ErrorEvent("worker_error", "x"), TextDelta("never")]
    )
    outcome = await driver.start()
    record = outcome.terminal
    assert (record.status, record.cause) == (RunStatus.FAILED, "upstream:worker_error")
    assert outcome.tail_tokens == 0  # the stream is closed at the failure: "never" is not read
    events = await log(store)
    assert texts(events) == "a"
    assert events[-1]["error"] == {
        "message": "x",
        "type": "server_error",
        "param": None,
        "code": "worker_error",
    }


async def test_a_backend_exception_mid_stream_fails_the_run_with_an_error_frame():
    store, _, driver = await make_driver(lambda r: [TextDelta("a"), BackendFailed("gone")])
    record = (await driver.start()).terminal
    assert record.status == RunStatus.FAILED and not record.refused
    assert (await log(store))[-1]["error"]["code"] == "upstream_error"


async def test_a_refusal_before_any_event_is_an_http_error_not_a_stream():
    store, _, driver = await make_driver(lambda r: [BackendRejected("bad temp", "temperature")])
    record = (await driver.start()).terminal
    assert record.status == RunStatus.REJECTED and record.refused
    assert record.error["param"] == "temperature"
    assert terminal_error(record).status == 400  # the request answers with a plain 400
    assert await log(store) == []  # nothing to stream


async def test_cancel_racing_completion_gives_one_terminal_state():
    for delay in (0.0, 0.001, 0.005):
        store, _, driver = await make_driver(
            lambda r: [TextDelta("a"), Finish("stop"), Usage(1, 1)]
        )
        task = driver.start()
        await asyncio.sleep(delay)  # NOTE: the race itself: the cancel lands at varied points
        driver.cancel("client")
        record = (await task).terminal
        stored = await store.get("run-1")
        assert stored.terminal == record
        assert record.status in (RunStatus.COMPLETED, RunStatus.CANCELLED)
        errors = [e for e in await log(store) if "error" in e]
        assert len(errors) == (record.status == RunStatus.CANCELLED)
        finished = samples(driver, "sluice_runs_finished_total")
        assert sum(finished.values()) == 1.0  # one usage record either way


async def test_cancel_racing_a_deadline_gives_one_terminal_state():
    store, _, driver = await make_driver(
        lambda r: [TextDelta("a"), 1.0, TextDelta("b")], Deadlines(inter_token=0.05)
    )
    task = driver.start()
    await streaming(store)
    await asyncio.sleep(0.05)  # NOTE: the race itself: the cancel lands as the deadline fires
    driver.cancel("client")
    record = (await task).terminal
    assert record.status in (RunStatus.CANCELLED, RunStatus.TIMED_OUT)
    assert len([e for e in await log(store) if "error" in e]) == 1
    assert sum(samples(driver, "sluice_cancellations_total").values()) == 1.0


async def test_a_run_enters_each_status_in_turn():
    store = StatusLog()
    _, _, driver = await make_driver(
        lambda r: [Admitted(), TextDelta("a"), TextDelta("b"), Finish("stop"), Usage(5, 2)],
        store=store,
    )
    assert (await driver.start()).status == RunStatus.COMPLETED
    assert store.entered == [
        RunStatus.QUEUED,
        RunStatus.ADMITTED,
        RunStatus.DECODING,
        RunStatus.FINALIZING,
        RunStatus.COMPLETED,
    ]


@pytest.mark.parametrize("ended", ["cancelled here", "failed by another replica"])
async def test_a_batch_a_stop_kept_out_during_a_stage_is_generated_once(ended):
    judge = SlowJudge("b")
    store, adapter, driver = await make_driver(
        lambda r: [TextDelta("a"), TextDelta("b", tokens=2), 5.0, TextDelta("never")],
        stages=[judge],
    )
    task = driver.start()
    await asyncio.wait_for(judge.judging.wait(), 5)
    if ended == "cancelled here":
        driver.cancel("client")
    else:  # the log closes under the batch: another replica took this one for dead
        await store.finish("run-1", *ending(RunStatus.FAILED, LOST_CAUSE))
    judge.verdict.set()
    outcome = await task
    assert texts(await log(store)) == "a"  # "b" was kept out of the log
    assert adapter.aborted == {"run-1": True}
    assert driver.acct.aborted_tokens == 3  # the upstream's own count: "a" and "b"
    assert (outcome.sent_tokens, outcome.tail_tokens, outcome.generated_tokens) == (1, 0, 3)
    assert samples(driver, "sluice_tokens_total")[(("kind", "generated"),)] == 3.0


async def test_a_run_cut_at_shutdown_writes_its_ending_and_still_settles():
    settled = []

    async def settle(outcome):
        settled.append(outcome)

    store, adapter, driver = await make_driver(
        text_script([f"t{i}" for i in range(100)], delay=0.01), settle=settle
    )
    task = driver.start()
    await streaming(store, 3)
    task.cancel()  # the gateway shutting down (RunManager.close)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(o.status, o.terminal.cause) for o in settled] == [(RunStatus.FAILED, "shutdown")]
    assert (await store.get("run-1")).terminal == settled[0].terminal
    assert (await log(store))[-1]["error"]["code"] == "upstream_error"
    assert adapter.aborted == {"run-1": True}
    assert sum(samples(driver, "sluice_runs_finished_total").values()) == 1.0  # run end, once


class SlowSettle:
    """A settle that waits for its release, noting when it began and what it settled."""

    def __init__(self) -> None:
        self.begun, self.release, self.done = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.settled: list = []

    async def __call__(self, outcome) -> None:
        self.begun.set()
        await self.release.wait()
        self.settled.append(outcome)
        self.done.set()


async def test_a_cancel_as_the_run_settles_waits_for_the_settlement():
    settle = SlowSettle()
    _, _, driver = await make_driver(text_script(["a"]), settle=settle)
    task = driver.start()
    await asyncio.wait_for(settle.begun.wait(), 5)
    task.cancel()
    settle.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [o.status for o in settle.settled] == [RunStatus.COMPLETED]  # whole, then cancelled


async def test_a_second_cancel_stops_the_wait_not_the_settlement():
    settle = SlowSettle()
    store, _, driver = await make_driver(
        text_script([f"t{i}" for i in range(100)], delay=0.01), settle=settle
    )
    task = driver.start()
    await streaming(store)
    task.cancel()
    await asyncio.wait_for(settle.begun.wait(), 5)
    task.cancel()  # gateway/tasks.py's second try: the driver's task ends now
    with pytest.raises(asyncio.CancelledError):
        await task
    assert settle.settled == []
    settle.release.set()  # the settlement goes on by itself
    await asyncio.wait_for(settle.done.wait(), 5)
    assert [(o.status, o.terminal.cause) for o in settle.settled] == [
        (RunStatus.FAILED, "shutdown")
    ]


class PassThrough:
    """A stage that lets everything through: every batch takes the pipeline's general path."""

    stop_source = None

    async def feed(self, events: list[Event]) -> list[Event]:
        return events

    async def finish(self) -> list[Event]:
        return []


async def test_text_after_the_first_token_is_logged_and_accounted_as_through_a_stage():
    """A run with no stage records its plain text after the first token in fewer steps
    (RunPipeline.plain_text); its log, object, token counts and inter-token samples are those of
    the same run through a stage that passes everything."""
    pieces = ["Hel", "lo", " there", "", "!"]
    runs = {}
    for name, stages in (("fast", ()), ("general", (PassThrough(),))):
        store, _, driver = await make_driver(text_script(pieces), stages=stages)
        fast_batches = []
        record_text = driver._record_text

        async def counted(batch, chunks, seen=fast_batches, record=record_text):
            seen.append(batch)
            return await record(batch, chunks)

        driver._record_text = counted
        outcome = await driver.start()
        # the first token goes the general way, then every text with some text in it
        assert len(fast_batches) == (3 if not stages else 0)
        gaps = samples(driver, "sluice_inter_token_seconds_count")
        chunks = [{k: v for k, v in e.items() if k != "created"} for e in await log(store)]
        answer = outcome.terminal.completion_object()["choices"]
        runs[name] = (chunks, answer, outcome.sent_tokens, gaps)
        assert outcome.sent_tokens == outcome.generated_tokens == len(pieces)

    assert runs["fast"] == runs["general"]
    assert runs["fast"][3] == {(): len(pieces) - 1}  # a gap after each token but the first
