"""HF safetensors directories: load a Llama-family checkpoint, and export one.

Export exists so that anything we load (the bundled GGUF included) can be handed to other tools,
and so the tests can check that GGUF -> HF -> Elesium round-trips to the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from elesium.inference.runtime.config import ModelConfig
from elesium.inference.weights.tokenizer import Tokenizer


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Return (config, float32 state dict) from ``config.json`` and ``*.safetensors`` shards."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json; expected an HF model directory")
    config = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            state[name] = tensor.float()
    return config, state


def write_hf_dir(path: Path, config: ModelConfig, state: dict[str, torch.Tensor],
                 tokenizer: Tokenizer) -> None:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json``."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    tokenizer.backend.save(str(path / "tokenizer.json"))

    def name(i: int | None) -> str | None:
        return tokenizer.backend.id_to_token(i) if i is not None else None

    eos = next((i for i in sorted(tokenizer.eos_ids) if name(i) in ("<|im_end|>", "<|eot_id|>")),
               min(tokenizer.eos_ids) if tokenizer.eos_ids else None)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": name(tokenizer.bos_id),
        "eos_token": name(eos),
        "add_bos_token": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
    }, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(tokenizer.eos_ids)}))
