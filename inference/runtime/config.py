"""The shape of a Llama-family model: everything the runtime needs to build one, nothing more."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
"""The floating-point types by the names the CLI, the settings and the heads' manifests use."""


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyperparameters.

    Covers Llama 2/3, SmolLM and Qwen2 (``qkv_bias``). ``rope_scaling`` holds HF's dict verbatim
    (only the "llama3" type changes the frequencies; others are rejected at load time).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    tie_word_embeddings: bool = True
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read an HF ``config.json`` of a Llama-family model."""
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if hf.get("model_type") not in (None, "llama", "qwen2", "mistral") and "Llama" not in arch:
            raise ValueError(f"unsupported architecture {arch!r} (model_type={hf.get('model_type')!r}); "
                             "Elesium runs Llama-family models (Llama, SmolLM, Qwen2, Mistral)")
        n_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or hidden // n_heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=hf.get("rope_scaling"),
            qkv_bias=bool(hf.get("attention_bias", False)) or hf.get("model_type") == "qwen2",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            name=str(hf.get("_name_or_path") or hf.get("model_type") or "llama"),
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF ``config.json`` that transformers would load as LlamaForCausalLM (or Qwen2)."""
        qwen = self.qkv_bias
        return {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "attention_bias": self.qkv_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "_name_or_path": self.name,
        }

