"""A model alias's run through its targets (adapters/fallback.py, adapters/fallback_route.py),
with scripted targets: the order, every reason to pass a target over, the first-token deadline,
what is never retried, the retry budget, weighted stickiness, the route header, the config."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from adapters.base import BackendFailed, BackendRejected, BackendUnavailable
from adapters.events import Aborted, Accepted, Admitted, ErrorEvent, Finish, TextDelta
from adapters.fallback import FallbackAdapter
from adapters.fallback_route import Alias, Route, Target, parse_aliases, sticky_point
from adapters.requests import ChatRequest, Message
from adapters.retry_budget import RetryBudget
from common.config import ConfigError
from gateway.settings import load_settings
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.waiting import until

HOLD = 30.0  # a pause no test waits out


def request(*contents: str, model: str = "chat") -> ChatRequest:
    roles = ["user", "assistant"]
    return ChatRequest(
        model, [Message(roles[i % 2], text) for i, text in enumerate(contents or ("Hi",))]
    )


def serving(*pieces: str):
    return text_script(list(pieces) or ["ok"])


def make_alias(*scripts, timeout: float | None = None, **options) -> FallbackAdapter:
    """An ordered alias `chat` over targets a, b, c, … each running its script."""
    names = "abcdefgh"[: len(scripts)]
    adapters = {n: ScriptedAdapter(n, s) for n, s in zip(names, scripts, strict=True)}
    alias = Alias("chat", tuple(Target(n) for n in names), timeout)
    counted: list[str] = []
    fallback = FallbackAdapter(
        alias, adapters, on_outcome=lambda _, outcome: counted.append(outcome), **options
    )
    fallback.counted = counted  # what on_outcome saw, for the tests
    return fallback


async def run(fallback: FallbackAdapter, chat: ChatRequest | None = None, route=None):
    """(the batches of one run, its route)."""
    chat = chat or request()
    route = route or fallback.plan(chat)
    batches = [b async for b in fallback.run(route).stream(chat, "run-1")]
    return batches, route


def asked(fallback: FallbackAdapter, target: str) -> list[str]:
    return [r.model for r in fallback.targets[target].requests]


def text(batches) -> str:
    return "".join(e.text for b in batches for e in b if type(e) is TextDelta)


# -- the order and each reason to fall back ----------------------------------------------------


async def test_the_first_target_serves_and_the_run_learns_its_name():
    fallback = make_alias(serving("x", "y"), serving("never"))
    batches, route = await run(fallback)
    assert batches[0][0] == Accepted(model="a")
    assert text(batches) == "xy"
    assert asked(fallback, "a") == ["a"]  # the target's own name goes upstream
    assert asked(fallback, "b") == []
    assert route.header() == "a;served"
    assert fallback.counted == ["served_first"]


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (BackendUnavailable("down"), "unavailable"),
        (BackendFailed("broke"), "failed"),
        (ErrorEvent("worker_error", "failed while generating"), "failed"),
    ],
)
async def test_a_target_that_fails_before_its_first_token_is_passed_over(failure, reason):
    fallback = make_alias(lambda r: [Accepted(), failure], serving("from b"))
    batches, route = await run(fallback)
    assert text(batches) == "from b"
    assert batches[0][0] == Accepted(model="b")
    assert route.header() == f"a;skipped={reason}, b;served"
    assert route.skipped == {"a": reason}
    assert fallback.counted == ["fell_back"]


async def test_a_target_without_a_first_token_in_time_is_closed_and_passed_over():
    fallback = make_alias(
        lambda r: [Accepted(), HOLD, TextDelta("late")], serving("b"), timeout=0.05
    )
    batches, route = await run(fallback)
    assert text(batches) == "b"
    assert route.header() == "a;skipped=timeout, b;served"
    assert fallback.targets["a"].aborted == {"run-1": True}  # its stream was closed


async def test_the_last_target_has_no_first_token_deadline():
    fallback = make_alias(
        lambda r: [BackendUnavailable("down")], lambda r: [0.1, TextDelta("slow")], timeout=0.01
    )
    batches, route = await run(fallback)
    assert text(batches) == "slow"
    assert route.header() == "a;skipped=unavailable, b;served"


async def test_admitted_passes_before_the_first_token_and_accepted_waits_for_it():
    fallback = make_alias(lambda r: [[Accepted(), Admitted()], TextDelta("t"), Finish("stop")])
    batches, _ = await run(fallback)
    assert batches[0] == [Admitted()]
    assert batches[1] == [Accepted(model="a"), TextDelta("t")]


async def test_a_refusal_is_the_requests_own_fault_and_not_retried():
    fallback = make_alias(lambda r: [BackendRejected("bad", "temperature")], serving("b"))
    with pytest.raises(BackendRejected):
        await run(fallback)
    assert asked(fallback, "b") == []
    assert fallback.counted == []


async def test_a_failure_after_the_first_token_is_not_a_fallback():
    fallback = make_alias(lambda r: [TextDelta("x"), BackendFailed("cut")], serving("b"))
    seen = []
    with pytest.raises(BackendFailed):
        async for batch in fallback.run(fallback.plan(request())).stream(request(), "run-1"):
            seen.append(batch)
    assert text(seen) == "x"
    assert asked(fallback, "b") == []
    assert fallback.counted == ["served_first"]


async def test_with_every_target_failing_the_last_failure_is_the_answer():
    fallback = make_alias(
        lambda r: [BackendUnavailable("down")], lambda r: [BackendFailed("broken")]
    )
    route = fallback.plan(request())
    with pytest.raises(BackendFailed):
        await run(fallback, route=route)
    assert route.header() == "a;skipped=unavailable, b;skipped=failed"
    assert fallback.counted == ["exhausted"]


async def test_targets_passed_over_before_the_run_are_never_asked():
    fallback = make_alias(serving("a"), serving("b"), serving("c"))
    route = fallback.plan(request())
    route.skip("a", "not_allowed")
    route.skip("b", "shed")
    batches, _ = await run(fallback, route=route)
    assert text(batches) == "c"
    assert (asked(fallback, "a"), asked(fallback, "b")) == ([], [])
    assert route.header() == "a;skipped=not_allowed, b;skipped=shed, c;served"
    assert fallback.counted == ["fell_back"]


async def test_each_fallback_asks_the_retry_budget_and_a_refusal_ends_the_run():
    budget = RetryBudget(0.0)  # no retries at all
    fallback = make_alias(lambda r: [BackendUnavailable("down")], serving("b"), budget=budget)
    with pytest.raises(BackendUnavailable):
        await run(fallback)
    assert asked(fallback, "b") == []
    assert budget.counts["budget_exhausted"] == 1
    roomy = RetryBudget(0.2)
    fallback = make_alias(lambda r: [BackendUnavailable("down")], serving("b"), budget=roomy)
    batches, _ = await run(fallback)
    assert text(batches) == "b" and roomy.counts["fallback"] == 1


async def test_an_abort_before_the_first_token_goes_to_the_target_and_ends_the_fallbacks():
    fallback = make_alias(lambda r: [Accepted(), HOLD, TextDelta("late")], serving("b"))
    chat = request()
    fallback_run = fallback.run(fallback.plan(chat))
    stream = fallback_run.stream(chat, "run-1")
    reading = asyncio.ensure_future(anext(stream))
    target = fallback.targets["a"]
    await until(lambda: target.sleeping("run-1"), "the first target to hold the run")
    assert await fallback.abort("run-1") is True
    batches = [await reading] + [b async for b in stream]
    assert type(batches[-1][-1]) is Aborted
    assert asked(fallback, "b") == []


# -- weighted targets ---------------------------------------------------------------------------


def weighted(*weights: int) -> Alias:
    names = "abcdefgh"[: len(weights)]
    return Alias("canary", tuple(Target(n, w) for n, w in zip(names, weights, strict=True)))


def test_a_conversation_keeps_its_target_as_it_grows_and_on_every_call():
    alias = weighted(50, 50)
    for start in range(40):
        first = request(f"conversation {start}")
        chosen = alias.order(first)[0]
        later = request(f"conversation {start}", "an answer", "a follow-up question")
        assert {alias.order(first)[0] for _ in range(20)} == {chosen}
        assert alias.order(later)[0] == chosen


def test_weights_are_roughly_respected_across_conversations():
    alias = weighted(90, 10)
    firsts = Counter(alias.order(request(f"prompt number {i}"))[0] for i in range(4000))
    assert 0.87 < firsts["a"] / 4000 < 0.93


def test_the_others_follow_the_chosen_target_heaviest_first_and_weight_zero_is_fallback_only():
    alias = weighted(0, 30, 70)
    orders = {tuple(alias.order(request(f"p{i}"))) for i in range(500)}
    assert orders == {("b", "c", "a"), ("c", "b", "a")}


def test_the_sticky_point_is_the_same_in_every_process():
    # blake2b of the conversation's start: a fixed number, not Python's per-process hash
    assert sticky_point(request("Hi")) == sticky_point(request("Hi"))
    assert round(sticky_point(request("Hi")), 6) == round(sticky_point(request("Hi")), 6)
    assert sticky_point(request("Hi")) != sticky_point(request("Hello"))


# -- the route header ---------------------------------------------------------------------------


def test_the_header_names_targets_up_to_the_one_serving_or_being_tried():
    route = Route("chat", ["a", "b", "c"])
    assert route.header() == "a;trying"
    route.skip("a", "unavailable")
    route.trying = "b"
    assert route.header() == "a;skipped=unavailable, b;trying"
    route.serve("b")
    assert route.header() == "a;skipped=unavailable, b;served"
    route.skip("c", "not_allowed")  # passed over but after the one serving: left out
    assert route.header() == "a;skipped=unavailable, b;served"
    with pytest.raises(ValueError):
        route.skip("c", "bored")


# -- the config file's tables -------------------------------------------------------------------


def test_aliases_from_the_config_tables():
    (ordered, canary) = parse_aliases(
        {
            "chat-default": {"targets": ["qwen-7b", "smollm"], "first_token_timeout": 5},
            "canary": {"targets": [{"model": "a", "weight": 90}, {"model": "b", "weight": 10}]},
        }
    )
    assert ordered == Alias("chat-default", (Target("qwen-7b"), Target("smollm")), 5.0)
    assert not ordered.weighted and canary.weighted
    assert canary.targets == (Target("a", 90), Target("b", 10))


@pytest.mark.parametrize(
    ("tables", "message"),
    [
        ({"x": {"targets": ["a"], "first_token_timout": 1}}, "did you mean 'first_token_timeout'"),
        ({"x": {"target": ["a"]}}, "did you mean 'targets'"),
        ({"x": {"targets": []}}, "non-empty list"),
        ({"x": "a"}, "must be a table"),
        ({"x": {"targets": ["a", {"model": "b", "weight": 1}]}}, "not a mix"),
        ({"x": {"targets": [{"model": "a", "wieght": 1}]}}, "did you mean 'weight'"),
        ({"x": {"targets": [{"model": "a", "weight": -1}]}}, "weight = an integer"),
        ({"x": {"targets": [{"model": "a", "weight": 0}]}}, "weight above 0"),
        ({"x": {"targets": ["a", "a"]}}, "listed twice"),
        ({"x": {"targets": ["a"], "first_token_timeout": 0}}, "first_token_timeout"),
        ({"x": {"targets": ["x"]}}, "names itself"),
        ({"x": {"targets": ["y"]}, "y": {"targets": ["x"]}}, "is an alias too"),
    ],
)
def test_a_malformed_alias_is_a_config_error_naming_it(tables, message):
    with pytest.raises(ConfigError) as info:
        parse_aliases(tables)
    assert message in str(info.value)
    assert '[models."' in str(info.value)


def test_the_config_files_models_tables_reach_the_settings(tmp_path):
    path = tmp_path / "sluice.toml"
    path.write_text(
        '[models."chat-default"]\ntargets = ["qwen-7b", "smollm"]\nfirst_token_timeout = 5\n'
    )
    (alias,) = load_settings({"config": str(path)}, environ={}).aliases()
    assert alias == Alias("chat-default", (Target("qwen-7b"), Target("smollm")), 5.0)
    path.write_text('[models.chat]\ntargets = ["a"]\nfirst_token_timout = 5\n')
    with pytest.raises(ConfigError, match="did you mean 'first_token_timeout'"):
        load_settings({"config": str(path)}, environ={})
