"""What the Responses renderer costs beside a chat stream, per event and per resume.

A response's log holds the same chat chunks as a chat completion's; its stream renders them as
typed events (gateway/responses/render.py), and a resume renders the log again from its start
to number the events. This builds logs of text deltas (as the driver appends them) and times,
in one run and side by side:

- `chat`: what a chat stream does per log event: frame it for SSE;
- `responses`: read the chunk back as events, render their typed event(s), serialise and frame
  them;
- `resume at end`: a resume after the last event: the whole log rendered, nothing sent.

Shown per event in µs and as a ratio to the chat row: the machine is shared, so read ratios.

    .venv/bin/python bench/responses_render.py
    .venv/bin/python bench/responses_render.py --events 256 4096 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from adapters.chat_chunks import ChunkRenderer, logged_events
from adapters.events import Finish, TextDelta
from gateway.responses.render import ResponseRenderer
from gateway.responses.request import ResponseParams
from gateway.responses.stream import numbered

RID = "resp_" + "0" * 32


def log_of(events: int) -> list[bytes]:
    """A run's log of `events` chunks: a role chunk, text deltas, the finish."""
    chunks = ChunkRenderer(RID, "bench", 0)
    payloads = [chunks.role(0)]
    payloads += [chunks.render(TextDelta(f" wörd{i}")) for i in range(events - 2)]
    payloads.append(chunks.render(Finish("stop")))
    return payloads


def chat(log: list[bytes]) -> None:
    b"".join(b"id: %d\ndata: %b\n\n" % (seq, p) for seq, p in enumerate(log, 1))


def responses(log: list[bytes], after: int = -1) -> None:
    renderer = ResponseRenderer(RID, "bench", 0, ResponseParams())
    events = renderer.opening()
    for payload in log:
        events += renderer.feed(logged_events(payload))
    framed = numbered(events, after)
    b"".join(b"id: %d\ndata: %b\n\n" % (e[0], e[1]) for e in framed)


def timed(work: Callable[[], None], repeats: int) -> float:
    """The median seconds of `repeats` runs of `work`."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'log events':>10} | {'row':<14} | {'µs/event':>9} | {'x chat':>7}")
    print(f"{'-' * 10}-+-{'-' * 14}-+-{'-' * 9}-+-{'-' * 7}")
    for count in args.events:
        log = log_of(count)
        rows = {
            "chat": timed(lambda log=log: chat(log), args.repeats),
            "responses": timed(lambda log=log: responses(log), args.repeats),
            "resume at end": timed(lambda log=log: responses(log, 10**9), args.repeats),
        }
        for name, seconds in rows.items():
            per = seconds / count * 1e6
            ratio = seconds / rows["chat"]
            print(f"{count:>10} | {name:<14} | {per:>9.2f} | {ratio:>7.1f}")


if __name__ == "__main__":
    main()
