"""The engine benchmark's workload: chat prompts, waves, Poisson arrivals and abandoned requests.

Every row sees the same prompts (request k gets prompt k). `--arrivals poisson` adds long
documents to the chat prompts (every fourth request), so prompts of 30-180 and 400-800 tokens
mix, and the arrival times, the requests a client cancels mid-stream and those given a deadline
are drawn from one seed, so every row runs the same plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SYSTEM = "You are a concise, accurate assistant. Answer in plain prose."
AUDIENCES = ("a beginner", "an expert", "a child", "a manager", "a student", "an engineer")
TASKS = (  # NOTE: lengths alternate so the first few prompts (all that c=1 runs) are mixed too
    "Say hello.",
    "I am planning a week-long trip to Japan in spring. I like food, old temples and quiet "
    "places, and I dislike crowds. Suggest a rough itinerary, which cities to stay in, how to "
    "get between them, and a couple of dishes I should not miss.",
    "What is the capital of France?",
    "Here are my notes from today's project meeting. Turn them into a short summary with "
    "decisions, open questions and action items, each with an owner.\n\n- Ana: the data "
    "migration is two weeks late because the legacy export drops rows with empty dates; she "
    "wants to patch the exporter rather than clean the data afterwards.\n- Ben disagrees, says "
    "patching the exporter risks the billing job that shares it; proposes a cleanup script.\n"
    "- We agreed to try Ben's script on last month's export first and compare row counts.\n"
    "- Chloe asked who owns the new dashboard; nobody answered. Budget review moved to Friday.\n"
    "- Dan will ask finance whether the cloud credits expire in June or in December.",
    "Give me three tips for better sleep.",
    "A small bakery sells bread, croissants and cakes. Sales were flat last year, rent went up "
    "by ten percent, and a chain store opened across the street. The owner has a loyal morning "
    "crowd but few customers after noon. Write a short, practical plan with five concrete "
    "steps the owner could try over the next three months, each with a way to tell whether it "
    "is working, and note one risk for each step.",
    "Explain what a hash table is and when you would use one.",
    "Here is some Python code:\n\ndef f(xs):\n    out = []\n    for x in xs:\n        if x % 2 "
    "== 0:\n            out.append(x * x)\n    return out\n\nWhat does it do? Rewrite it as a "
    "list comprehension, add type hints, and explain any edge cases worth testing.",
    "Compare TCP and UDP.",
    "Write a short poem about the sea at night, with a calm mood and simple words.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in a few sentences, then say what the play is "
    "really about and why people still read it today.",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Describe how a bill becomes a law in a parliamentary system, step by step, and mention "
    "where it can fail along the way.",
    "What is 17 times 23? Show your working.",
    "Write a friendly two-paragraph email to a colleague asking to move our Tuesday meeting to "
    "Thursday afternoon because of a conflicting dentist appointment, and offer two times.",
)


# -- workload and statistics -----------------------------------------------------------------------


def build_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` distinct chat prompts (task x audience), rendered with the model's template."""
    from workers.chat import render_prompt

    prompts = []
    for k in range(count):
        task = TASKS[k % len(TASKS)]
        audience = AUDIENCES[(k // len(TASKS)) % len(AUDIENCES)]
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"For {audience}: {task}"},
        ]
        prompts.append(render_prompt(tokenizer, messages))
    return prompts


def make_waves(prompts: list[list[int]], concurrency: int) -> list[list[list[int]]]:
    return [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]


def document_prompt(tokenizer: Any, k: int) -> list[int]:
    """A long prompt (about 400-800 tokens): several tasks' texts, a different run of them per k,
    to summarize; distinct per k, so the prefix cache shares only the system prompt."""
    from workers.chat import render_prompt

    picked = [TASKS[(k + i) % len(TASKS)] for i in range(8 + k % 9)]
    audience = AUDIENCES[k % len(AUDIENCES)]
    text = f"Summarize these notes for {audience}, one line each:\n\n" + "\n\n".join(picked)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return render_prompt(tokenizer, messages)


def mixed_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """Chat prompts with a long document every fourth request."""
    chat = build_prompts(tokenizer, count)
    return [document_prompt(tokenizer, k) if k % 4 == 3 else chat[k] for k in range(count)]


def warmup_size(concurrency: int, burst: bool = True) -> tuple[int, int]:
    """(requests, new tokens each) of the untimed warm-up before a cell, on prompts of its own.

    NOTE: the warm-up is a burst of `concurrency` prompts of the cell's kind, so the engine's
    memory (the decode rows' arenas) has reached its working size before the clock starts, as
    a serving worker's has after its first minute, and as transformers' paged cache is when its
    manager starts. A cold engine's first growths fault in fresh memory, 150-600 ms in one step
    on a VM whose host has not backed the pages: in a wave of 64 that was 0.7-1.2 s of a 6-8 s
    wave. Without `burst`, two short prompts: `engine_steps.py --cold` traces that start."""
    return (concurrency, 16) if burst else (min(concurrency, 2), 4)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a run: when it arrives (seconds after the run starts), its prompt, and
    whether its client cancels it after some tokens or gives it a deadline."""

    at: float
    prompt: list[int]
    cancel_after: int | None = None  # tokens received, then the client cancels
    deadline_s: float | None = None  # since arrival, then the request times out


def plan(prompts: list[list[int]], args: Any, rate: float | None) -> list[Arrival]:
    """Arrivals for `prompts`: all at once (`rate` None) or a Poisson process of `rate` per
    second; `args.cancel_fraction` of them cancelled mid-stream, `args.deadline_fraction` with
    a deadline of `args.deadline_ms` (the same requests in every row, from `args.seed`)."""
    rng = random.Random(args.seed)
    at, times = 0.0, []
    for _ in prompts:
        times.append(at)
        if rate:
            at += rng.expovariate(rate)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    cancels = set(order[: round(len(prompts) * args.cancel_fraction)])
    deadlines = set(
        order[len(cancels) : len(cancels) + round(len(prompts) * args.deadline_fraction)]
    )
    arrivals = []
    for k, (t, prompt) in enumerate(zip(times, prompts, strict=True)):
        cancel = rng.randint(1, max(1, args.max_new_tokens - 1)) if k in cancels else None
        deadline = args.deadline_ms / 1000 if k in deadlines else None
        arrivals.append(Arrival(t, prompt, cancel, deadline))
    return arrivals
