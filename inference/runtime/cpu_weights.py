"""Fast CPU linear layers built from the GGUF file's own quantised blocks.

The bundled model is Q4_1 (blocks of 32 weights ``w = d * q + m``, ``q`` in 0..15, ``d`` and ``m``
float16) for every layer and Q8_0 (``w = d * q``, ``q`` in -127..127) for the tied embedding and
``lm_head``. Dequantising to float32 and running MKL's GEMV reads 4 bytes a weight; this module
keeps the file's 4-bit codes and runs torch's own int4 CPU kernel (``_weight_int4pack_mm_for_cpu``,
the kernel torchao's int4 weight-only CPU path wraps), which reads about 0.6 bytes a weight.

What is exact and what is not (measured, torch 2.13, this AVX2 CPU):

* The kernel computes ``(q - 8) * scale + zero`` per group of 32, so ``scale = d`` and
  ``zero = m + 8 d`` would be Q4_1 exactly. It accepts float32 activations and scales, but that
  variant is not vectorised: 20-400x slower than the bfloat16 one (1.7 ms against 0.13 ms for a
  1536x576 layer at one row). float16 is as slow. So the fast path is bfloat16: the 4-bit codes
  are the file's, bit for bit, while ``d`` and ``m + 8 d`` are rounded to bfloat16 (8 significant
  bits instead of 11), and the layer's input and output are bfloat16. Everything between the
  matmuls (norms, RoPE, attention, the residual stream) stays float32.
* Q8_0 has no 8-bit grouped kernel, so a Q8_0 row is split into two nibbles, ``q = 16 (hi - 8) +
  lo``: ``lo`` is an int4 group with ``scale = d, zero = 8 d`` and ``hi`` one with ``scale = 16 d,
  zero = 0``. Concatenating the halves along K (the input repeated) gives one int4 matmul whose
  weights are ``bf16(d) * q``: the file's codes exactly, the scale rounded as above.
* Row invariance: the kernel's result for one row does not depend on how many rows the call
  holds (tests/test_cpu_fast.py checks the whole forward), which keeps greedy speculative
  decoding equal to vanilla.

The bfloat16 fallback (``CastLinear``) dequantises and stores weights in bfloat16 for sources with
no 4-bit form here (HF directories, other GGUF types).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from elesium.inference.runtime.model import Transformer

GROUP = 32
INNER_K_TILES = 8  # the packing layout the CPU kernel reads (K must be a multiple of 16 * this / 2)
WeightFormat = Literal["gguf-blocks", "bfloat16", "float32"]
WEIGHT_FORMATS: tuple[str, ...] = ("gguf-blocks", "bfloat16", "float32")
COMPUTE_DTYPE = torch.bfloat16


class Int4GroupLinear(nn.Module):
    """``y = x @ W.T`` with ``W`` held as 4-bit groups of 32 along K (torch's CPU int4 layout).

    ``repeat`` > 1 tiles the input along K first (the two-nibble Q8_0 form). The kernel runs in
    bfloat16 (its only vectorised type on x86); inputs of any float dtype are returned in their own.
    """

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int, in_features: int,
                 repeat: int = 1) -> None:
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        self.out_features = out_features
        self.in_features = in_features
        self.repeat = repeat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE)
        if self.repeat > 1:
            flat = flat.repeat(1, self.repeat)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        return out.view(*lead, self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        sz = self.scales_zeros
        return self.packed.numel() * self.packed.element_size() + sz.numel() * sz.element_size()


class CastLinear(nn.Module):
    """A bias-free linear layer whose weight is stored in a narrower float type (bf16 fallback)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(dtype).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


def _int4_linear(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, repeat: int = 1) -> Int4GroupLinear:
    """Pack ``q`` ``[N, K]`` (values 0..15) with per-group ``scale``/``zero`` ``[N, K / 32]`` (float32)."""
    n, k = q.shape
    codes = torch.from_numpy(q.astype(np.int32))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
    sz = torch.from_numpy(np.stack([scale.T, zero.T], axis=-1).astype(np.float32)).to(COMPUTE_DTYPE)
    sz = sz.contiguous()  # [K/32, N, 2]: scale | zero per group and output row
    return Int4GroupLinear(packed, sz, n, k // repeat, repeat)


def q4_1_linear(raw: np.ndarray, rows: int, cols: int) -> Int4GroupLinear:
    """An exact int4 layer from Q4_1 bytes ``[rows, cols / 32 * 20]`` (GGUF row order)."""
    blocks = raw.reshape(rows, cols // GROUP, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # element j | element j + 16
    return _int4_linear(q, d, m + 8 * d)  # [K/32, N, 2] scale | zero, rounded to bfloat16 in _int4_linear


def q8_0_linear(raw: np.ndarray, rows: int, cols: int) -> Int4GroupLinear:
    """An exact two-nibble int4 layer from Q8_0 bytes ``[rows, cols / 32 * 34]``."""
    blocks = raw.reshape(rows, cols // GROUP, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:34].copy().view(np.int8).astype(np.int16).reshape(rows, cols)
    lo = q & 0x0F
    hi = (q - lo) // 16 + 8  # q = 16 (hi - 8) + lo, hi - 8 in -8..7
    both = np.concatenate([lo, hi], axis=1)
    d = torch.from_numpy(d).to(COMPUTE_DTYPE).float().numpy()  # so that 16 d and 8 d round alike
    scale = np.concatenate([d, 16 * d], axis=1)
    zero = np.concatenate([8 * d, np.zeros_like(d)], axis=1)
    return _int4_linear(both, scale, zero, repeat=2)


def _unpermute_rows(raw: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp permutes Q/K rows for its RoPE layout; undo it on whole rows of blocks."""
    rows = raw.shape[0]
    return raw.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(raw.shape)


@dataclass
class FastWeightsReport:
    """What was swapped in, for ``--json`` output and run records."""

    weight_format: str
    lm_head: str
    layers_int4: int
    bytes_per_token: int

    def to_dict(self) -> dict[str, Any]:
        return {"weight_format": self.weight_format, "lm_head": self.lm_head, "layers_int4": self.layers_int4,
                "weight_bytes_per_token": self.bytes_per_token}


def _gguf_layers(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


def apply_gguf_blocks(model: Transformer, gguf_path: Path) -> FastWeightsReport:
    """Swap every linear layer of a float32 ``model`` for an exact int4 layer built from the file.

    The embedding stays float32 (a lookup reads one row). Raises ValueError when a tensor's type
    has no exact int4 form here (callers then fall back to bfloat16).
    """
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ValueError("the GGUF-block weights run a float32 model on the CPU")
    c = model.config
    tensors = _gguf_layers(gguf_path)

    def build(name: str, n_heads: int | None = None) -> Int4GroupLinear:
        t = tensors[name]
        cols, rows = (int(x) for x in t.shape.tolist())
        raw = np.asarray(t.data)
        if n_heads is not None:
            raw = _unpermute_rows(raw, n_heads)
        kind = t.tensor_type.name
        if kind == "Q4_1":
            return q4_1_linear(raw, rows, cols)
        if kind == "Q8_0":
            return q8_0_linear(raw, rows, cols)
        raise ValueError(f"{name} is {kind}: no exact int4 form for it")

    if c.qkv_bias:
        raise ValueError("qkv bias is not supported by the GGUF-block path")
    swapped = 0
    nbytes = 0
    new_layers = []
    for i in range(c.num_layers):
        p = f"blk.{i}."
        parts = [build(p + "attn_q.weight", c.num_heads), build(p + "attn_k.weight", c.num_kv_heads),
                 build(p + "attn_v.weight")]
        wqkv = _concat_rows(parts)
        wo = build(p + "attn_output.weight")
        w13 = _concat_rows([build(p + "ffn_gate.weight"), build(p + "ffn_up.weight")])
        w2 = build(p + "ffn_down.weight")
        new_layers.append((wqkv, wo, w13, w2))
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    head = build(head_name)
    for layer, (wqkv, wo, w13, w2) in zip(model.layers, new_layers, strict=True):
        layer.attn.wqkv, layer.attn.wo, layer.w13, layer.w2 = wqkv, wo, w13, w2
        swapped += 4
        nbytes += wqkv.nbytes + wo.nbytes + w13.nbytes + w2.nbytes
    model.lm_head = head
    nbytes += head.nbytes
    return FastWeightsReport("gguf-blocks", f"{tensors[head_name].tensor_type.name} as two int4 nibbles",
                             swapped, nbytes)


def _concat_rows(parts: list[Int4GroupLinear]) -> Int4GroupLinear:
    """Fuse layers that share their input (Q|K|V, gate|up) into one call: rows concatenate.

    Packed rows are independent in torch's CPU layout ([N, K/2] bytes), and scales/zeros are
    ``[K/32, N, 2]``, so both concatenate along N.
    """
    packed = torch.cat([p.packed for p in parts], dim=0)
    sz = torch.cat([p.scales_zeros for p in parts], dim=1).contiguous()
    rows = sum(p.out_features for p in parts)
    return Int4GroupLinear(packed, sz, rows, parts[0].in_features, parts[0].repeat)


def apply_bfloat16(model: Transformer) -> FastWeightsReport:
    """The fallback: keep float32 activations, store and multiply linear weights in bfloat16."""
    nbytes = 0
    for layer in model.layers:
        for owner, name in ((layer.attn, "wqkv"), (layer.attn, "wo"), (layer, "w13"), (layer, "w2")):
            lin = getattr(owner, name)
            setattr(owner, name, CastLinear(lin.weight, torch.bfloat16))
            nbytes += lin.weight.numel() * 2
    head = model.embed.weight if model.config.tie_word_embeddings else model.lm_head.weight
    model.lm_head = CastLinear(head, torch.bfloat16)
    nbytes += model.lm_head.weight.numel() * 2
    return FastWeightsReport("bfloat16", "bfloat16", 4 * len(model.layers), nbytes)


def apply_weight_format(model: Transformer, fmt: str, gguf_path: Path | None, *,
                        cache_dir: Path | None = None, sha256: str = "") -> FastWeightsReport | None:
    """Apply ``fmt`` ("gguf-blocks", "bfloat16", "float32" = the reference: nothing changes).

    "gguf-blocks" falls back to "bfloat16" when the source is not a GGUF file or a tensor type has
    no exact int4 form. Packing the blocks costs seconds on two cores, so with a ``cache_dir`` and
    the file's ``sha256`` the packed tensors are stored once and memory-mapped on later starts.
    """
    report = _apply(model, fmt, gguf_path, cache_dir, sha256)
    # Read by tuning profiles (profile.weights_of): a cost curve belongs to one weight format.
    model.weights_format = report.weight_format if report is not None else "float32"
    return report


def _apply(model: Transformer, fmt: str, gguf_path: Path | None, cache_dir: Path | None,
           sha256: str) -> FastWeightsReport | None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(WEIGHT_FORMATS)}")
    if fmt == "float32":
        return None
    if fmt == "gguf-blocks":
        if gguf_path is not None and gguf_path.is_file() and gguf_path.suffix == ".gguf":
            entry = (cache_dir / "cpu-weights" / f"{sha256}-gguf-blocks-v{_PACK_FORMAT}.safetensors"
                     if cache_dir is not None and sha256 else None)
            if entry is not None and entry.exists():
                return _load_packed(model, entry)
            try:
                report = apply_gguf_blocks(model, gguf_path)
            except (ValueError, KeyError):
                return apply_bfloat16(model)
            if entry is not None:
                _save_packed(model, report, entry)
            return report
    return apply_bfloat16(model)


_PACK_FORMAT = 1


def _int4_modules(model: Transformer) -> dict[str, Int4GroupLinear]:
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, Int4GroupLinear)}


def _save_packed(model: Transformer, report: FastWeightsReport, entry: Path) -> None:
    """Write the packed layers atomically (temp file, then rename), with what rebuilds the modules."""
    import json
    import os
    import tempfile

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, mod in _int4_modules(model).items():
        tensors[name + ".packed"] = mod.packed.contiguous()
        tensors[name + ".scales_zeros"] = mod.scales_zeros.contiguous()
        shapes[name] = [mod.out_features, mod.in_features, mod.repeat]
    meta = {"report": json.dumps(report.to_dict() | {"lm_head_desc": report.lm_head}),
            "shapes": json.dumps(shapes)}
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=entry.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the entry from other users of a shared cache
        os.replace(tmp, entry)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_packed(model: Transformer, entry: Path) -> FastWeightsReport:
    import json

    from safetensors import safe_open

    with safe_open(str(entry), "pt") as fh:
        meta = fh.metadata()
        shapes = json.loads(meta["shapes"])
        for name, (out_f, in_f, repeat) in shapes.items():
            mod = Int4GroupLinear(fh.get_tensor(name + ".packed"), fh.get_tensor(name + ".scales_zeros"),
                                  out_f, in_f, repeat)
            owner_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner_name) if owner_name else model, attr, mod)
    rep = json.loads(meta["report"])
    return FastWeightsReport(rep["weight_format"], rep["lm_head_desc"], rep["layers_int4"],
                             rep["weight_bytes_per_token"])


def resolve_cpu_weights(setting: str, device: torch.device, dtype_asked: str) -> str:
    """The weight format a CPU engine runs: ``setting`` unless "auto".

    "auto" is the 4-bit fast path ("gguf-blocks": the file's own codes; bfloat16 where the source has
    no 4-bit form) unless a dtype was asked for: ``--dtype float32`` keeps the float32 reference, and
    any other dtype runs as asked. On a quiet 2-core machine the fast path with its compiled step
    decodes ~4x faster than the reference (BENCHMARKS.md section 10b). Its greedy text is not the
    reference's token for token (bfloat16 activations into the int4 kernel); greedy speculative output
    equals its own vanilla output (the compiled step, ``cpu_step.py``), and whether the engine speculates
    by default follows the tuned profile (vanilla on the shipped 2-core ones). Not on CUDA:
    GPU runs keep their own dtype handling ("float32" here means "change nothing").
    """
    if device.type != "cpu":
        if setting not in ("auto", "float32"):
            raise ValueError(f"--cpu-weights {setting} applies to the CPU only")
        return "float32"
    if setting == "auto":
        return "gguf-blocks" if dtype_asked == "auto" else "float32"
    if setting not in WEIGHT_FORMATS:
        raise ValueError(f"unknown CPU weight format {setting!r}; "
                         f"use auto or one of {', '.join(WEIGHT_FORMATS)}")
    return setting


def resolve_cpu_compile(setting: str, device: torch.device, weight_format: str) -> bool:
    """Whether decode steps run through the compiled CPU step (``cpu_step.py``).

    "auto" compiles the fast formats and leaves the float32 reference eager: the reference is what
    the fast paths are measured against, so it stays the plain ``Transformer.forward``.
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"unknown --cpu-compile {setting!r}; use auto, on or off")
    if device.type != "cpu":
        if setting == "on":
            raise ValueError("--cpu-compile on applies to the CPU only (CUDA replays graphs)")
        return False
    return setting == "on" or (setting == "auto" and weight_format != "float32")
