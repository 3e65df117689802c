"""The CPU decode-attention kernel (workers/decode_kernel.py): what SDPA computes over each row's
own length, the engine taking it on CPU, and SDPA kept where it cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog.testing
import torch
import torch.nn.functional as F

from tests.support.model_equivalence import stream_texts
from workers import decode_kernel
from workers.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def reference(q, keys, values, rows, lengths, scale) -> torch.Tensor:
    """Each query's SDPA over its row's first `lengths[n]` positions, in float32."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for n, (row, length) in enumerate(zip(rows.tolist(), lengths.tolist(), strict=True)):
        k, v = keys[row, :, :length].float(), values[row, :, :length].float()
        out[n] = F.scaled_dot_product_attention(q[n].float(), k, v, scale=scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 16), (2, 16), (3, 64), (4, 32)])
def test_each_query_writes_its_k_v_and_reads_its_own_row_to_its_own_length(
    dtype, group, head_dim
) -> None:
    assert decode_kernel.supports(group, head_dim, dtype)
    gen = torch.Generator().manual_seed(group * head_dim)
    kv_heads, capacity = 2, 48
    # rows as the engine hands them over: a strided view (rows and positions sliced)
    whole = torch.randn(2, 9, kv_heads, capacity + 8, head_dim, generator=gen).to(dtype)
    keys, values = whole[0, :7, :, :capacity], whole[1, :7, :, :capacity]
    rows = torch.tensor([4, 0, 6, 2, 5])  # out of order, not every row
    lengths = torch.tensor([48, 1, 2, 17, 33])  # a full row, only the new position, ...
    q = torch.randn(len(rows), kv_heads, group, head_dim, generator=gen).to(dtype)
    # this step's K/V as the model makes it: [KV, N, D] seen as [N, KV, D] (a strided view)
    new_k, new_v = torch.randn(2, kv_heads, len(rows), head_dim, generator=gen).to(dtype)
    new_k, new_v = new_k.transpose(0, 1), new_v.transpose(0, 1)
    expected_keys, expected_values = keys.clone(), values.clone()
    for n, (row, length) in enumerate(zip(rows.tolist(), lengths.tolist(), strict=True)):
        expected_keys[row, :, length - 1] = new_k[n]
        expected_values[row, :, length - 1] = new_v[n]
    # the paged cache: [KV, slots, D]; each new K/V goes to its slot as well
    cache = torch.zeros(2, kv_heads, 40, head_dim, dtype=dtype)
    slots = torch.tensor([7, 0, 39, 12, 25])
    scale = head_dim**-0.5
    out = decode_kernel.decode_attention(
        q, (keys, values), (new_k, new_v), rows, lengths, (cache[0], cache[1]), slots, scale
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert torch.equal(cache[0][:, slots].transpose(0, 1), new_k)
    assert torch.equal(cache[1][:, slots].transpose(0, 1), new_v)
    assert cache[:, :, [s for s in range(40) if s not in slots.tolist()]].count_nonzero() == 0
    expected = reference(q, expected_keys, expected_values, rows, lengths, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    else:  # float32 sums, one rounding to bfloat16: within a bfloat16 step of the exact value
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=8e-3)
    # a row read to its one new position gives that position's V
    torch.testing.assert_close(out[1].float(), new_v[1].float().unsqueeze(1).expand(-1, group, -1))


def test_bad_rows_and_lengths_are_refused_not_read() -> None:
    keys = torch.zeros(3, 1, 8, 16)
    q, new = torch.zeros(2, 1, 2, 16), torch.zeros(2, 1, 16)

    def attend(rows, lengths, slots=(0, 1), q=q, keys=keys, new=new):
        rows, lengths, slots = torch.tensor(rows), torch.tensor(lengths), torch.tensor(slots)
        cache = keys[0]  # [KV, 8 slots, D]
        return decode_kernel.decode_attention(
            q, (keys, keys), (new, new), rows, lengths, (cache, cache), slots, 0.25
        )

    with pytest.raises(RuntimeError, match="row out of range"):
        attend([0, 3], [1, 1])
    with pytest.raises(RuntimeError, match="a row taken by two queries"):
        attend([1, 1], [1, 1])
    with pytest.raises(RuntimeError, match="length beyond the row"):
        attend([0, 1], [1, 9])
    with pytest.raises(RuntimeError, match="length beyond the row"):
        attend([0, 1], [0, 1])  # no position for the new K/V
    with pytest.raises(RuntimeError, match="slot out of range"):
        attend([0, 1], [1, 1], slots=(0, 8))
    wide = torch.zeros(3, 1, 8, 24)  # a head of 24 values: no compiled variant
    with pytest.raises(RuntimeError, match="no kernel for"):
        attend([0, 1], [1, 1], q=torch.zeros(2, 1, 2, 24), keys=wide, new=torch.zeros(2, 1, 24))
    assert not keys.any()  # nothing refused was written
    assert not decode_kernel.supports(9, 64, torch.float32)  # the engine keeps SDPA there
    assert not decode_kernel.supports(2, 16, torch.float64)


@pytest.mark.parametrize("speculative", ["off", "prompt-lookup"])
def test_the_engine_takes_the_kernel_on_cpu_and_streams_what_sdpa_streams(
    tiny, speculative, monkeypatch
) -> None:
    """Decodes over their rows, and short chunks (short prompts; speculating, the drafts'
    verifications) over their blocks, through the kernel: the same text as through SDPA."""
    model, tokenizer = tiny
    spans = []
    monkeypatch.setattr(decode_kernel, "span_attention", spy(decode_kernel.span_attention, spans))
    monkeypatch.setattr("workers.attention.span_attention", decode_kernel.span_attention)
    all_ids = [tokenizer.encode("x" * n) or [1] for n in (3, 40, 9, 25, 1, 33)]
    settings = dict(max_num_seqs=4, num_kv_blocks=96, block_size=8, speculative=speculative)
    lengths = [24, 30, 12, 24, 30, 18]  # requests join and leave the rows as others end
    kernel = Engine(model, tokenizer, **settings)
    assert kernel.runner.decode_kernel
    texts = stream_texts(kernel, all_ids, lengths)
    sdpa = Engine(model, tokenizer, decode_kernel=False, **settings)
    assert not sdpa.runner.decode_kernel
    assert stream_texts(sdpa, all_ids, lengths) == texts
    assert all(texts.values())
    assert spans  # short prompts (and, speculating, the drafts' verifications) took the kernel


def spy(function, calls: list):
    def called(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    return called


@pytest.mark.process
def test_without_a_compiler_the_engine_keeps_sdpa(tiny_model_dir, tmp_path) -> None:
    """A fresh cache and no working compiler: the build fails, leaves nothing half-written, the
    worker says so once and serves through SDPA."""
    program = f"""
import json
from workers import decode_kernel
from workers.engine import Engine
from workers.model_loader import load_model
from tests.support.model_equivalence import stream_texts
model, tokenizer = load_model({str(tiny_model_dir)!r}, "cpu", "float32")
engine = Engine(model, tokenizer, max_num_seqs=2, num_kv_blocks=32, block_size=8)
texts = stream_texts(engine, [[1, 2, 3], [4, 5]], [6, 6])
print(json.dumps({{"kernel": engine.runner.decode_kernel, "texts": texts}}))
"""
    env = {**os.environ, "SLUICE_KERNEL_CACHE": str(tmp_path), "CXX": "false"}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kernel"] is False
    assert all(len(text) > 0 for text in result["texts"].values())
    assert "decode attention kernel unavailable; using SDPA" in done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []  # no library, no temporary left


def test_a_shape_without_a_variant_keeps_sdpa_and_says_so(tiny, monkeypatch) -> None:
    model, tokenizer = tiny
    monkeypatch.setattr(decode_kernel, "supports", lambda group, head_dim, dtype: False)
    with structlog.testing.capture_logs() as logs:
        engine = Engine(model, tokenizer, max_num_seqs=2, num_kv_blocks=32, block_size=8)
    assert not engine.runner.decode_kernel
    (said,) = [e for e in logs if "kernel has no variant" in e["event"]]
    assert (said["query_heads_per_kv_head"], said["head_dim"]) == (2, 16)
    texts = stream_texts(engine, [[1, 2, 3], [4, 5]], [6, 6])
    assert all(texts.values())


@pytest.mark.process
def test_the_kernel_runs_on_torchs_threads_and_adds_no_openmp_runtime() -> None:
    """With two intra-op threads, both spend CPU inside the kernel's calls (built without
    OpenMP, ATen's parallel_for ran them on one thread), and the process still maps one
    OpenMP runtime: torch's."""
    program = """
import json, os, threading, torch
from workers import decode_kernel
torch.set_num_threads(2)
assert decode_kernel.available()
rows, kv, group, dim, capacity = 64, 3, 3, 64, 512
keys, values = torch.randn(2, rows, kv, capacity, dim)
q, new = torch.randn(rows, kv, group, dim), torch.randn(rows, kv, dim)
index, lengths = torch.arange(rows), torch.full((rows,), capacity)
cache = torch.zeros(kv, rows, dim)
def attend():
    decode_kernel.decode_attention(
        q, (keys, values), (new, new), index, lengths, (cache, cache), index, 0.125
    )
attend()  # the pool starts
def cpu_ticks():
    ticks = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks[task] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks
before = cpu_ticks()
for _ in range(400):
    attend()
after = cpu_ticks()
spent = sorted(after[t] - before.get(t, 0) for t in after)
with open("/proc/self/maps") as maps:
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
print(json.dumps({"spent": spent, "runtimes": sorted(runtimes)}))
"""
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    busiest, second = result["spent"][-1], result["spent"][-2]
    assert busiest >= 20, result  # the loop took at least 0.2 s of CPU: enough to compare
    assert second >= busiest // 4, result  # a second thread did a real share of the work
    assert len(result["runtimes"]) == 1, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_span_queries_read_their_blocks_in_place_to_their_own_lengths(dtype) -> None:
    """Each query of a short chunk over its sequence's blocks (out of order, a table padded with
    0s), to its own length: what SDPA gives over the same positions gathered."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, group, head_dim, block = 3, 3, 64, 16
    cache_k, cache_v = torch.randn(2, kv_heads, 40 * block, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([[5, 9, 2, 30], [7, 1, 0, 0], [12, 0, 0, 0]])
    spans = torch.tensor([0] * 5 + [1] * 4 + [2])  # a prompt tail, a draft, a lone token
    lengths = torch.tensor([41, 42, 43, 44, 45, 4, 5, 6, 7, 16])
    q = torch.randn(len(spans), kv_heads, group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = decode_kernel.span_attention(q, (cache_k, cache_v), tables, spans, lengths, block, scale)
    assert out.shape == q.shape and out.dtype == dtype
    for n, (span, length) in enumerate(zip(spans.tolist(), lengths.tolist(), strict=True)):
        slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in tables[span]])
        k, v = cache_k[:, slots[:length]].float(), cache_v[:, slots[:length]].float()
        expected = F.scaled_dot_product_attention(q[n].float(), k, v, scale=scale)
        if dtype == torch.float32:
            torch.testing.assert_close(out[n], expected, atol=2e-6, rtol=2e-5)
        else:
            torch.testing.assert_close(out[n].float(), expected, atol=1e-2, rtol=8e-3)


def test_span_tables_spans_and_lengths_out_of_range_are_refused() -> None:
    cache = torch.zeros(1, 32, 16)  # 4 blocks of 8
    q = torch.zeros(2, 1, 2, 16)

    def attend(tables, spans, lengths, block=8):
        decode_kernel.span_attention(
            q,
            (cache, cache),
            torch.tensor(tables),
            torch.tensor(spans),
            torch.tensor(lengths),
            block,
            0.25,
        )

    attend([[0, 3]], [0, 0], [1, 16])  # the whole of two blocks: fine
    for tables, spans, lengths, why in [
        ([[0, 4]], [0, 0], [1, 2], "block id out of range"),
        ([[0, -1]], [0, 0], [1, 2], "block id out of range"),
        ([[0, 3]], [0, 1], [1, 2], "span out of range"),
        ([[0, 3]], [0, 0], [1, 17], "length beyond"),
        ([[0, 3]], [0, 0], [0, 2], "length beyond"),
    ]:
        with pytest.raises(RuntimeError, match=why):
            attend(tables, spans, lengths)
    with pytest.raises(RuntimeError, match="whole blocks"):
        attend([[0, 3]], [0, 0], [1, 2], block=5)
