"""One run's trace, drawn: starts `sluice serve --otlp-endpoint` with its local worker (on the
tiny test model unless `--model` names one), streams one chat completion through it, collects
the spans a local OTLP/HTTP receiver gets (testkit/otlp_receiver.py) and writes them as an SVG
waterfall: one row per span, nested under its parent, its bar placed on the run's time line,
its name and duration beside it, its events as ticks. docs/tracing.md shows its output.

    .venv/bin/python bench/trace_waterfall.py docs/assets/trace-waterfall.svg
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from html import escape
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from openai import OpenAI

from testkit.otlp_receiver import SpanSeen, otlp_receiver, span_named
from tests.support.serve import serving

KEY = "sk-trace-waterfall"
ROW, LABEL_W, BAR_W, PAD = 30, 330, 560, 16
COLOURS = {"sluicegate": "#3b6fb6", "sluicegate-worker": "#d9822b"}


def ordered(spans: list[SpanSeen]) -> list[tuple[SpanSeen, int]]:
    """Depth-first from the roots, children by start time: (span, depth)."""
    children: dict[str, list[SpanSeen]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    out: list[tuple[SpanSeen, int]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            out.append((s, depth))
            walk(s.span_id, depth + 1)

    walk("", 0)
    return out


def waterfall(spans: list[SpanSeen]) -> str:
    """The SVG text for one trace's spans."""
    rows = ordered(spans)
    t0 = min(s.start_ns for s in spans)
    total = max(s.end_ns for s in spans) - t0 or 1
    height = PAD * 2 + ROW * (len(rows) + 1)
    width = LABEL_W + BAR_W + PAD * 2 + 90

    def x(ns: int) -> float:
        return LABEL_W + PAD + (ns - t0) / total * BAR_W

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="ui-monospace, monospace" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{PAD}" y="{PAD + 12}" font-weight="bold">trace {spans[0].trace_id}</text>',
        f'<text x="{LABEL_W + PAD}" y="{PAD + 12}" fill="#666">0 ms</text>',
        f'<text x="{LABEL_W + PAD + BAR_W}" y="{PAD + 12}" fill="#666" text-anchor="end">'
        f"{total / 1e6:.1f} ms</text>",
    ]
    for i, (s, depth) in enumerate(rows, start=1):
        y = PAD + ROW * i
        colour = COLOURS.get(s.service, "#5a9e5a")
        left, right = x(s.start_ns), max(x(s.end_ns), x(s.start_ns) + 2)
        out.append(
            f'<text x="{PAD + depth * 16}" y="{y + 17}">{escape(s.name)}'
            f'<tspan fill="#888"> ({escape(s.service)})</tspan></text>'
        )
        out.append(
            f'<rect x="{left:.1f}" y="{y + 5}" width="{right - left:.1f}" height="16" rx="3" '
            f'fill="{colour}"/>'
        )
        out.append(f'<text x="{right + 6:.1f}" y="{y + 17}">{s.seconds * 1000:.1f} ms</text>')
        for _name, _ in s.events:
            out.append(
                f'<line x1="{left:.1f}" x2="{left:.1f}" y1="{y + 2}" y2="{y + 24}" '
                'stroke="#c0392b" stroke-width="2"/>'
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def one_trace(spans: list[SpanSeen]) -> list[SpanSeen] | None:
    run = span_named(spans, "chat ")
    worker = span_named(spans, "generate ")
    if run is None or worker is None:
        return None
    mine = [s for s in spans if s.trace_id == run.trace_id]
    return mine if len(mine) >= 5 else None  # run, worker, queue, prefill, decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the SVG file to write")
    p.add_argument("--model", type=Path, help="a local HF model folder (default: a tiny one)")
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, otlp_receiver() as receiver:
        model = args.model
        if model is None:
            from testkit.tiny_model import build_tiny_model

            model = build_tiny_model(Path(tmp) / "tiny-llama")
        env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
        with serving(model, "--otlp-endpoint", receiver.endpoint, key=KEY, env=env) as gateway:
            client = OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0)
            (model_id,) = [m.id for m in client.models.list().data]
            stream = client.chat.completions.create(
                model=model_id,
                messages=[{"role": "user", "content": "Count to ten."}],
                max_tokens=args.max_tokens,
                stream=True,
            )
            for _ in stream:
                pass
            spans = receiver.wait_sync(one_trace, "one run's spans")
    args.out.write_text(waterfall(spans), encoding="utf-8")
    for s, depth in ordered(spans):
        print(f"{'  ' * depth}{s.name} [{s.service}] {s.seconds * 1000:.1f} ms")


if __name__ == "__main__":
    main()
