"""Where a decode step's time goes on a device: the host's work, kernel launches, the GPU's work.

For each concurrency, a wave of requests is run until every one decodes; then `--steps`
decode-only steps are timed (wall, and this thread's CPU) and profiled (torch.profiler, CPU and
CUDA): kernels launched per step, the GPU's busy time per step (the kernels' summed durations),
and the ops with the most host time. A first line times a bare op's launch on the device, the
floor under every kernel the step launches. `--graphs on,off` profiles each concurrency with the
decode-only steps replayed as CUDA graphs (decode_graphs.py) and eager: "launch calls" counts
the host's kernel and graph launches per step.

    python bench/device_profile.py --model PATH --device cuda --concurrency 1,64 --graphs on,off
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from engine_workload import build_prompts  # noqa: E402
from model_args import add_model_arguments, load_model_of  # noqa: E402


def launch_us(device: str, count: int = 2000) -> float:
    """Microseconds per launch of a one-element in-place add, queued back to back."""
    import torch

    x = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(100):
        x.add_(1)
    sync()
    started = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    sync()
    return (time.perf_counter() - started) / count * 1e6


def decoding_engine(model, tokenizer, concurrency: int, max_new: int, **settings):
    """An engine whose `concurrency` requests have all finished prefill and are decoding;
    `settings` go to the engine."""
    from wire.sampling_params import SamplingParams
    from workers.engine import Engine
    from workers.request import EngineRequest

    engine = Engine(model, tokenizer, max_num_seqs=concurrency, **settings)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(build_prompts(tokenizer, concurrency)):
        engine.add_request(EngineRequest(f"p{i}", ids, params))
    for _ in range(200):
        engine.step()
        running = engine.scheduler.running
        if len(running) == concurrency and all(s.num_uncomputed == 1 for s in running):
            break
    for _ in range(3):  # the decode rows at their working size
        engine.step()
    return engine


def profile_steps(
    engine, steps: int, device: str, shapes: bool = False
) -> tuple[list[float], list[float], object]:
    """Wall and thread-CPU seconds of `steps` steps, and the profiler that watched them
    (recording the ops' input shapes when `shapes`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    walls, cpus = [], []
    with profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(steps):
            wall, cpu = time.perf_counter(), time.thread_time()
            engine.step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
    return walls, cpus, prof


def summarize(
    walls: list[float], cpus: list[float], prof, steps: int, shapes: bool = False
) -> list[str]:
    events = prof.key_averages(group_by_input_shape=shapes)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    launches = [
        e for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch")
    ]
    gpu_ms = sum(e.device_time for e in kernels) / 1000 / steps
    launch_ms = sum(e.self_cpu_time_total for e in launches) / 1000 / steps
    lines = [
        f"  per step: wall {1000 * sorted(walls)[len(walls) // 2]:.1f} ms (median), "
        f"thread CPU {1000 * sorted(cpus)[len(cpus) // 2]:.1f} ms, "
        f"kernels {len(kernels) / steps:.0f}, GPU busy {gpu_ms:.2f} ms, "
        f"launch calls {sum(e.count for e in launches) / steps:.0f} "
        f"taking {launch_ms:.1f} ms",
        "  host time by op (self CPU, ms per step):",
    ]
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    for e in top:
        lines.append(
            f"    {e.key[:60]:<60} {e.self_cpu_time_total / 1000 / steps:7.2f}"
            f"  x{e.count / steps:.0f}" + (f"  {e.input_shapes}"[:120] if shapes else "")
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, device="cuda", dtype="bfloat16")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--shapes",
        action="store_true",
        help="rank ops by input shape too (how a copy inside a bf16 batched matmul was found)",
    )
    p.add_argument(
        "--graphs", default="on", help="on, off or on,off: decode steps as CUDA graphs, eager"
    )
    args = p.parse_args()
    model, tokenizer = load_model_of(args)
    print(f"device_profile: a bare launch takes {launch_us(args.device):.1f} us on {args.device}")
    for c in (int(x) for x in args.concurrency.split(",")):
        for graphs in args.graphs.split(","):
            engine = decoding_engine(
                model, tokenizer, c, max_new=args.steps + 400, cuda_graphs=graphs == "on"
            )
            walls, cpus, prof = profile_steps(engine, args.steps, args.device, args.shapes)
            print(f"c={c}, {args.dtype}, {args.steps} decode steps, CUDA graphs {graphs}")
            print("\n".join(summarize(walls, cpus, prof, args.steps, args.shapes)))
            held = getattr(engine.runner, "graphs", None)
            if held is not None:
                print(f"  decode graphs: {held.graph_count} captured, {held.replays} steps run")


if __name__ == "__main__":
    main()
