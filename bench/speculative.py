"""Prompt-lookup speculation: the engine with `--speculative off` and `prompt-lookup`, side by side.

One process, one model (SmolLM2-135M-Instruct by default), two engines that differ only in the
speculation setting, on input-grounded chat requests: edits of code given in the prompt, a
paragraph to correct, notes to turn into a summary that quotes them. Each concurrency runs waves
of c requests (greedy, EOS allowed, up to `--max-new-tokens`); the two modes take turns wave by
wave, repeated `--repeats` times, so a slow spell of the shared machine falls on both.

  tok/s    output tokens / wall time of the timed waves (prefill included)
  tok/cpu-s  output tokens / CPU seconds this process spent on them (all its threads): on a
           machine others load, wall time swings with their work, CPU time far less, so the
           speed-up is shown on both
  ITL      gap between a request's consecutive token deliveries, per token (a delivery of k
           tokens counts k times, gap / k), median and p90
  accept   draft tokens the model agreed with / draft tokens verified
  tok/ver  tokens a verifying sequence emitted per step (accepted + the model's own one)
  same     requests whose output is identical in both modes, token for token (expected in
           float32; in bfloat16 a verification's rounding could part them at a near-tie, which
           speculative.py's docstring says how often was measured)

    .venv/bin/python bench/speculative.py                 # c=1 and c=8, bfloat16
    .venv/bin/python bench/speculative.py --concurrency 1 --repeats 1 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("off", "prompt-lookup")

CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            if int(age) >= 18:
                users.append({"name": name, "email": email, "age": int(age)})
    return users
"""
PARAGRAPH = (
    "The comittee met on tuesday to discuss the new budget. After a long debate, they agreed "
    "to increase funding for the public library by ten percent, and to postpone the decision "
    "on the new parking garage until next month, when the traffic study will be finished."
)
NOTES = (
    "- Ana: the data migration is two weeks late because the legacy export drops rows with "
    "empty dates.\n- Ben proposes a cleanup script instead of patching the exporter.\n- We "
    "agreed to try Ben's script on last month's export first and compare row counts.\n- Dan "
    "will ask finance whether the cloud credits expire in June or in December."
)
TASKS = (
    f"Rename the function load_users to read_adults and the variable f to handle. Return the "
    f"whole updated code.\n\n{CODE}",
    f"Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n"
    f"{PARAGRAPH}",
    f"Add a docstring to this function and return the full function:\n\n{CODE}",
    f"Summarize these meeting notes, quoting each decision exactly as written:\n\n{NOTES}",
    f"Rewrite this code so it skips blank lines, and return all of it:\n\n{CODE}",
    f"Copy this paragraph, then add one sentence at the end:\n\n{PARAGRAPH}",
    f"List every action item from these notes, word for word:\n\n{NOTES}",
    f"Add type hints to this function and return the whole function:\n\n{CODE}",
)


def build_prompts(tokenizer: Any, count: int, offset: int = 0) -> list[list[int]]:
    from workers.chat import render_prompt

    return [
        render_prompt(tokenizer, [{"role": "user", "content": TASKS[(offset + k) % len(TASKS)]}])
        for k in range(count)
    ]


@dataclass(slots=True)
class Tally:
    """One mode's timed waves at one concurrency."""

    wall: float = 0.0
    cpu: float = 0.0  # this process's CPU seconds (all threads) over the same waves
    tokens: int = 0
    itls: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index → output ids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_wave(engine: Any, prompts: dict[int, list[int]], max_new: int, tally: Tally | None) -> None:
    """Submit the wave, step until done; stamp each text line when `step()` returns."""
    from wire.sampling_params import SamplingParams
    from workers.request import EngineRequest

    params = SamplingParams(max_tokens=max_new, temperature=0.0)
    before = engine.speculator.stats
    drafted, accepted, verified = before.draft_tokens, before.accepted_tokens, before.verifications
    last: dict[str, float] = {}
    ids: dict[str, list[int]] = {}
    started, cpu_started = time.perf_counter(), time.process_time()
    for k, prompt in prompts.items():
        engine.add_request(EngineRequest(f"p{k}", prompt, params))
        last[f"p{k}"], ids[f"p{k}"] = started, []
    gaps: list[float] = []
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            for line in out.events:
                event = line.wire()
                if event["type"] == "text" and event.get("tokens"):
                    count = event["tokens"]
                    if ids[out.request_id]:  # the first delivery is TTFT, not a gap
                        gaps += [(now - last[out.request_id]) / count] * count
                    last[out.request_id] = now
                    ids[out.request_id] += event.get("ids") or []
    if tally is None:
        return
    tally.wall += time.perf_counter() - started
    tally.cpu += time.process_time() - cpu_started
    tally.itls += gaps
    tally.tokens += sum(map(len, ids.values()))
    after = engine.speculator.stats
    tally.drafted += after.draft_tokens - drafted
    tally.accepted += after.accepted_tokens - accepted
    tally.verifications += after.verifications - verified
    for k in prompts:
        tally.outputs[k] = ids[f"p{k}"]


def make_engines(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from workers.engine import Engine
    from workers.model_loader import load_model, resolve_model_path

    model, tokenizer = load_model(resolve_model_path(args.model), args.device, args.dtype)
    engines = {
        mode: Engine(
            model,
            tokenizer,
            max_num_seqs=max(args.concurrency),
            speculative=mode,
            spec_tokens=args.spec_tokens,
            kv_cache_memory="512MiB",
        )
        for mode in MODES
    }
    return tokenizer, engines


def measure(args: argparse.Namespace, tokenizer: Any, engines: dict[str, Any], c: int) -> dict:
    tallies = {mode: Tally() for mode in MODES}
    warm = dict(enumerate(build_prompts(tokenizer, c, offset=3)))
    for engine in engines.values():
        run_wave(engine, warm, 8, None)
    waves = max(1, math.ceil(args.requests / c))
    for r in range(args.repeats):
        for w in range(waves):
            wave = build_prompts(tokenizer, c, offset=w * c)
            prompts = {w * c + i: p for i, p in enumerate(wave)}
            order = MODES if (r + w) % 2 == 0 else MODES[::-1]
            for mode in order:
                run_wave(engines[mode], prompts, args.max_new_tokens, tallies[mode])
    return tallies


def print_table(args: argparse.Namespace, results: dict[int, dict[str, Tally]]) -> None:
    print(
        f"\n== {args.dtype} | up to {args.max_new_tokens} new tokens/request, greedy | "
        f"spec-tokens {args.spec_tokens} | {args.repeats} repeat(s) | ITL in ms =="
    )
    print(
        f"{'speculative':<16}{'c':>3}{'tokens':>8}{'tok/s':>8}{'ITL p50':>9}{'p90':>8}"
        f"{'tok/cpu-s':>10}{'accept':>8}{'tok/ver':>8}{'same':>7}{'wall x':>8}{'cpu x':>7}"
    )
    for c, tallies in results.items():
        base = tallies["off"]
        for mode, t in tallies.items():
            tok_s = t.tokens / t.wall
            accept = f"{t.accepted / t.drafted:.0%}" if t.drafted else "-"
            emitted = t.accepted + t.verifications
            per_ver = f"{emitted / t.verifications:.2f}" if t.verifications else "-"
            matching = sum(t.outputs[k] == out for k, out in base.outputs.items())
            same = f"{matching}/{len(base.outputs)}"
            ratio = tok_s / (base.tokens / base.wall)
            cpu_ratio = (t.tokens / t.cpu) / (base.tokens / base.cpu)
            print(
                f"{mode:<16}{c:>3}{t.tokens:>8}{tok_s:>8.1f}"
                f"{percentile(t.itls, 50) * 1000:>9.1f}{percentile(t.itls, 90) * 1000:>8.1f}"
                f"{t.tokens / t.cpu:>10.1f}{accept:>8}{per_ver:>8}{same:>7}"
                f"{ratio:>7.2f}x{cpu_ratio:>6.2f}x"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--requests", type=int, default=8, help="at least this many per concurrency")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--spec-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    if args.spec_tokens is None:
        from workers.speculative import DEFAULT_SPEC_TOKENS

        args.spec_tokens = DEFAULT_SPEC_TOKENS
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, engines = make_engines(args)
    print(
        f"speculative: torch {torch.__version__}, {torch.get_num_threads()} threads, device "
        f"{args.device}; concurrency {args.concurrency}; >= {args.requests} requests each",
        flush=True,
    )
    results = {c: measure(args, tokenizer, engines, c) for c in args.concurrency}
    print_table(args, results)


if __name__ == "__main__":
    main()
