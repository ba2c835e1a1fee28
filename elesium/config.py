"""Process-wide settings, read once from the environment.

Every knob has one environment variable and one CLI flag; the CLI flag wins. Nothing here imports
torch, so ``elesium --help`` stays instant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "elesium"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elesium"


@dataclass(frozen=True)
class Settings:
    """Where things live and which model runs on what.

    ``model`` is None for the bundled SmolLM2-135M-Instruct GGUF; otherwise a GGUF file or an HF
    safetensors directory. ``device`` is "cpu", "cuda" or "auto" (CUDA when available).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    data_dir: Path = field(default_factory=_default_data_dir)
    cache_dir: Path = field(default_factory=_default_cache_dir)
    redis_url: str | None = None

    @classmethod
    def from_env(cls) -> "Settings":
        env = os.environ
        return cls(
            model=env.get("ELESIUM_MODEL") or None,
            device=env.get("ELESIUM_DEVICE", "auto"),
            dtype=env.get("ELESIUM_DTYPE", "auto"),
            data_dir=Path(env["ELESIUM_DATA_DIR"]) if env.get("ELESIUM_DATA_DIR") else _default_data_dir(),
            cache_dir=Path(env["ELESIUM_CACHE_DIR"]) if env.get("ELESIUM_CACHE_DIR") else _default_cache_dir(),
            redis_url=env.get("REDIS_URL") or None,
        )
