"""Read a Llama-family GGUF into HF-named float32 tensors.

Two facts make this more than a rename:

* Weights are block-quantized; ``gguf.quants.dequantize`` understands every type the gguf package
  ships, so we dequantize through it rather than re-implementing formats.
* llama.cpp's converter permutes the rows of Q and K so that its NeoX-free RoPE (interleaved pairs)
  matches HF's ``rotate_half`` layout. We use rotate_half, so we invert that permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from elesium.inference.runtime.config import ModelConfig

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as Python values (strings decoded, arrays as lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                meta[key] = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            else:
                meta[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif field.types[0] == GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        else:
            meta[key] = field.parts[field.data[0]].tolist()[0]
    return meta


def config_from_metadata(meta: dict[str, Any], has_output: bool) -> ModelConfig:
    arch = meta.get("general.architecture", "llama")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"GGUF architecture {arch!r} is not Llama-family; Elesium loads llama/qwen2/mistral")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"unsupported RoPE scaling {get('rope.scaling.type')!r} in GGUF")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv") or heads),
        head_dim=int(get("attention.key_length") or hidden // heads),
        max_position_embeddings=int(get("context_length", 8192)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        qkv_bias=arch == "qwen2",
        tie_word_embeddings=not has_output,
        name=str(meta.get("general.name", arch)),
    )


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (weights or biases), back to rotate_half order."""
    rows = w.shape[0]
    rest = w.shape[1:]
    # llama.cpp wrote reshape(h, 2, d/2).swapaxes(1, 2); the inverse views it as (h, d/2, 2).
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _dequantized(tensor: Any) -> np.ndarray:
    data = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(data.reshape(shape), dtype=np.float32)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Return (config, HF-named float32 state dict, metadata)."""
    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, has_output="output.weight" in names)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        array = _dequantized(tensor)
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in _LAYER_NAMES:
                continue  # e.g. rope_freqs: recomputed from the config
            if kind == "attn_q":
                array = unpermute_qk(array, config.num_heads)
            elif kind == "attn_k":
                array = unpermute_qk(array, config.num_kv_heads)
            hf = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
        else:
            continue
        state[hf] = torch.from_numpy(np.array(array, copy=True))  # writable, owned memory
    return config, state, meta
