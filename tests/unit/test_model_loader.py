"""Resolving and loading models: the default's one-time conversion, paths, devices, dtypes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from workers import model_loader
from workers.model_loader import (
    DEFAULT_MODEL_ID,
    ModelNotFound,
    ensure_default_model,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    served_model_id,
)


@pytest.fixture
def fake_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """A fake GGUF and a fake converter that records each conversion (slowly, to invite races)."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not really a gguf")
    conversions: list[Path] = []

    def convert(src: Path, out: Path) -> None:
        conversions.append(out)
        time.sleep(0.2)  # NOTE: a slow conversion, so the others find it under way
        (out / "config.json").write_text("{}")

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_loader, "default_gguf_path", lambda: gguf)
    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    return conversions


def test_default_is_converted_once_into_a_folder_named_by_the_gguf_hash(fake_default) -> None:
    first = ensure_default_model()
    again = resolve_model_path(None)
    assert first == again == resolve_model_path("default")
    assert first.parent == model_loader.cache_root()
    assert len(first.name) == 16 and int(first.name, 16) >= 0
    assert (first / "config.json").read_text() == "{}"
    assert len(fake_default) == 1


def test_racing_processes_convert_once_and_leave_no_temp_dirs(fake_default) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_default_model())) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_default) == 1
    assert len(set(results)) == 1 and len(results) == 4
    leftovers = [p.name for p in model_loader.cache_root().iterdir() if p.is_dir()]
    assert leftovers == [results[0].name]


def test_a_failed_conversion_leaves_nothing_behind(fake_default, monkeypatch) -> None:
    def broken(src: Path, out: Path) -> None:
        (out / "half-written").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_loader, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_default_model()
    assert [p for p in model_loader.cache_root().iterdir() if p.is_dir()] == []


def test_the_packaged_gguf_is_found_without_importing_its_package() -> None:
    path = model_loader.default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_local_folders(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert resolve_model_path(str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFound, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))


def test_served_model_ids(tiny_model_dir: Path) -> None:
    assert served_model_id(None, Path("/x/0123456789abcdef")) == DEFAULT_MODEL_ID
    assert served_model_id("default", Path("/x/0123456789abcdef")) == DEFAULT_MODEL_ID
    assert served_model_id(str(tiny_model_dir), tiny_model_dir) == tiny_model_dir.name


def test_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


@pytest.mark.parametrize(
    ("dtype", "device", "native_bf16", "cuda_bf16", "expected"),
    [
        ("float32", "cuda", True, True, torch.float32),
        ("float16", "cpu", False, False, torch.float16),
        ("bfloat16", "cpu", False, False, torch.bfloat16),
        ("auto", "cpu", True, False, torch.bfloat16),
        ("auto", "cpu", False, False, torch.float32),
        ("auto", "cuda", False, True, torch.bfloat16),
        ("auto", "cuda", False, False, torch.float16),
    ],
)
def test_dtypes(monkeypatch, dtype, device, native_bf16, cuda_bf16, expected) -> None:
    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    assert resolve_dtype(dtype, device) == expected


@pytest.mark.parametrize(
    ("capability", "probe", "flags", "amx", "native_bf16"),
    [
        ("AVX2", False, {"avx2"}, False, False),  # AMD EPYC, Zen 2/3
        ("AVX512", False, {"avx512f", "avx512_bf16"}, False, True),  # AMD EPYC, Zen 4
        ("AVX512", False, {"avx512f", "amx_tile", "amx_bf16"}, True, True),  # Intel, AMX
        ("AVX512", True, set(), True, True),  # torch's own probe says AMX
    ],
)
def test_the_cpu_features_read_from_torch_and_cpuinfo(
    monkeypatch, capability, probe, flags, amx, native_bf16
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: probe, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(model_loader, "_cpu_flags", lambda: flags)
    assert model_loader.cpu_has_amx() is amx
    assert model_loader.cpu_has_native_bf16() is native_bf16


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", "cpu")


def test_load_model_from_a_folder(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir, "cpu", "float32")
    assert model.dtype == torch.float32
    assert not model.training
    assert model.config.max_position_embeddings == 1024
    assert tokenizer.eos_token == "<|im_end|>"
