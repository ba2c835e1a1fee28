"""Compact on-disk storage for trained heads: per-row int8 and group-wise int4 weights.

Why: the shipped Hydra ``chain`` heads (4 heads of 2 blocks: eight 576 x 1152 and four 576 x 576
matrices) are 13.3 MB in fp16, and tracked files must stay under 5 MiB. The matrices are not low-rank
(90% of their energy needs 200-300 of 576 singular values), so we quantise instead. Weights are
dequantised once at load time, to the dtype the engine runs in, so nothing downstream (CUDA graphs,
the Triton kernels, drafting) changes or pays for it.

Schemes (symmetric, round-to-nearest; scales are fp16):

* ``int8``: one scale per output row, ``q = round(w / s)`` with ``s = max|w_row| / 127``.
* ``int4``: one scale per group of 32 consecutive inputs of a row (16 or 8 where 32 does not divide
  the row), ``s = max|w_group| / 7``; two values per byte (low nibble first), stored as ``q + 8``.
* ``mixed``: int8 for Hydra's skip matrices ``R`` and int4 for everything else (the attention
  drafter's matrices included; its file is written by the same function). ``R`` carries ``h_t``
  straight to ``lm_head``, and is where int4 hurts: on MT-Bench (1-block heads), int4 everywhere cost
  head 1 1.1 points of top-1, int4 only on ``W`` 0.3 (HEADS.md has the table). int8 everywhere was
  lossless but, at 5.3 MB for those smaller heads, already over the limit.

Only 2-D weights are quantised; biases and anything else stay in the float dtype. A file records
its per-tensor schemes in the safetensors metadata, so a loader never has to guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

Scheme = Literal["float", "int8", "int4", "mixed"]
SCHEMES: tuple[Scheme, ...] = ("float", "int8", "int4", "mixed")
INT4_GROUP = 32
MIXED_INT8_SUFFIX = "skip.weight"  # Hydra's R: it carries h_t straight to lm_head
_METADATA_KEY = "elesium.quantization"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [R, C], scale fp16 [R, 1])`` with ``weight ~= q * scale``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).half()
    q = torch.round(_divide(w, scale)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


def quantize_int4(weight: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [R, C/2], scale fp16 [R, C/group])``.

    ``group`` defaults to the largest of 32, 16, 8 that divides ``C`` (the file records it through the
    scale's shape).
    """
    w = weight.detach().float()
    rows, cols = w.shape
    if group is None:
        group = next((g for g in (INT4_GROUP, 16, 8) if cols % g == 0), INT4_GROUP)
    if cols % group or group % 2:
        raise ValueError(f"int4 needs the input size ({cols}) to be a multiple of the (even) group size "
                         f"{group}")
    g = w.view(rows, cols // group, group)
    scale = (g.abs().amax(dim=2, keepdim=True) / 7).half()
    q = (torch.round(_divide(g, scale)).clamp_(-7, 7) + 8).to(torch.uint8).view(rows, cols)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale.view(rows, cols // group)


def _divide(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w / scale``, with 0 where the scale is 0 (an all-zero row or group, or one below fp16's range)."""
    s = scale.float()
    return torch.where(s > 0, w / torch.where(s > 0, s, 1), 0)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, half = packed.shape
    q = torch.stack((packed & 0xF, packed >> 4), dim=2).view(rows, 2 * half).float() - 8
    group = 2 * half // scale.shape[1]
    return (q.view(rows, -1, group) * scale.float()[:, :, None]).view(rows, 2 * half)


def encode_state(state: dict[str, torch.Tensor], scheme: Scheme,
                 float_dtype: torch.dtype = torch.float16) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to write, and the safetensors metadata that says how to read them back.

    ``float`` stores every tensor in ``float_dtype``; the others quantise the 2-D weights and keep the
    rest (biases) in ``float_dtype``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown heads storage {scheme!r}; use one of {', '.join(SCHEMES)}")
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, str] = {}
    for name, value in state.items():
        value = value.detach().cpu()
        if scheme == "float" or value.dim() != 2:
            tensors[name] = value.to(float_dtype).contiguous()
            continue
        own = scheme if scheme != "mixed" else "int8" if name.endswith(MIXED_INT8_SUFFIX) else "int4"
        q, scale = quantize_int8(value) if own == "int8" else quantize_int4(value)
        tensors[f"{name}.q"], tensors[f"{name}.scale"] = q.contiguous(), scale.contiguous()
        layout[name] = own
    return tensors, {_METADATA_KEY: json.dumps(layout, sort_keys=True)} if layout else {}


def decode_state(tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """Invert :func:`encode_state`: a plain float state dict (quantised weights come back as fp32)."""
    layout: dict[str, str] = json.loads((metadata or {}).get(_METADATA_KEY, "{}"))
    state = {name: value for name, value in tensors.items()
             if not (name.endswith((".q", ".scale")) and name.rsplit(".", 1)[0] in layout)}
    for name, scheme in layout.items():
        try:
            q, scale = tensors[f"{name}.q"], tensors[f"{name}.scale"]
        except KeyError as missing:
            raise ValueError(f"heads file is missing {missing} for the {scheme} weight {name!r}") from None
        if scheme == "int8":
            state[name] = dequantize_int8(q, scale)
        elif scheme == "int4":
            state[name] = dequantize_int4(q, scale)
        else:
            raise ValueError(f"heads file stores {name!r} as {scheme!r}, which this version cannot read")
    return state


def round_trip(state: dict[str, torch.Tensor], scheme: Scheme,
               float_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The weights exactly as a file written with ``scheme`` will load: evaluate these, not the originals."""
    return decode_state(*encode_state(state, scheme, float_dtype))


def write_state(path: str | Path, state: dict[str, torch.Tensor], scheme: Scheme, float_dtype: torch.dtype,
                metadata: dict[str, str]) -> None:
    tensors, layout = encode_state(state, scheme, float_dtype)
    save_file(tensors, str(path), metadata={**metadata, **layout})


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A heads file as a plain float state dict, whatever scheme wrote it."""
    with safe_open(str(path), framework="pt") as f:
        return decode_state({name: f.get_tensor(name) for name in f.keys()}, f.metadata())  # noqa: SIM118
