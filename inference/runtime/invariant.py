"""Shape-invariant numerics: the switch that makes a verify forward's per-node results equal 1-token decodes.

Greedy speculative decoding is exact only if a tree node's logits are the logits vanilla decoding
computes for the same token. In float32 the gaps between kernels chosen for M = 1 and for M = N
rarely matter; in bf16 they flip argmaxes, and speculative output drifts from vanilla (BENCHMARKS.md
measured 22-25 of 80 MT-Bench prompts identical). With the switch on, on CUDA, the model's
linear layers run ``kernels.invariant_matmul``, its norms ``kernels.invariant_norm`` and its tree
attention ``kernels.invariant_attention``: each row's arithmetic is then independent of how many
rows the forward holds, so every node of a verify gets bit-for-bit its 1-token result. The same
switch turns on the fused elementwise forward (``runtime/fused.py``: RoPE + cache write, residual
add + RMSNorm, SwiGLU, one program per row), which keeps that property and saves ~20 launches a layer.

Setting: ``Settings.invariant_numerics`` / ``ELESIUM_INVARIANT_NUMERICS`` = ``on`` | ``off`` |
``auto`` (on for CUDA, off elsewhere: the CPU path has its own kernels and is exact in float32).
The model is switched by changing the classes of its leaf modules to subclasses that only
override ``forward`` (no new state, so weights, ``state_dict`` and CUDA-graph capture are untouched),
and by a flag on each attention module; ``apply_invariant_numerics(model, False)`` undoes both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elesium.inference.runtime.model import Attention, RMSNorm, Transformer

CHOICES = ("on", "off", "auto")


def parse_setting(value: str | None) -> str:
    """Normalise ``on|off|auto`` (also true/false/1/0); raises ValueError with one line otherwise."""
    text = (value or "auto").strip().lower()
    text = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(text, text)
    if text not in CHOICES:
        raise ValueError(f"invariant numerics must be on, off or auto, not {value!r}")
    return text


def resolve(setting: str | None, device: torch.device | str) -> bool:
    """Whether invariant numerics run: ``auto`` means on CUDA only."""
    choice = parse_setting(setting)
    if choice == "auto":
        return torch.device(device).type == "cuda"
    return choice == "on"


class InvariantLinear(nn.Linear):
    """``nn.Linear`` whose CUDA forward is the M-invariant Triton matmul (autograd keeps ``F.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from elesium.kernels.invariant_matmul import invariant_linear, supports

            if supports(x, self.weight):
                return invariant_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class InvariantRMSNorm(RMSNorm):
    """RMSNorm with one Triton program per row on CUDA (torch's reductions pick layouts by shape)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            from elesium.kernels.invariant_norm import invariant_rms_norm

            return invariant_rms_norm(x, self.weight, self.eps)
        return super().forward(x)


_SWAPS: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: InvariantLinear, RMSNorm: InvariantRMSNorm}
_UNSWAPS = {new: old for old, new in _SWAPS.items()}


def apply_invariant_numerics(model: nn.Module, enabled: bool) -> nn.Module:
    """Switch ``model`` (a Transformer, or any module holding its layers) to invariant numerics or back.

    Only modules of exactly ``nn.Linear`` / ``RMSNorm`` change class, and only the attention
    modules' ``invariant`` flag changes: anything else (heads, a drafter) is left as it is.
    """
    table = _SWAPS if enabled else _UNSWAPS
    for module in model.modules():
        target = table.get(type(module))
        if target is not None:
            module.__class__ = target
        if isinstance(module, Attention):
            module.invariant = enabled
    if isinstance(model, Transformer):
        model.invariant_numerics = enabled
        # The fused elementwise kernels (runtime/fused.py) are row-wise too, so they ride on this switch.
        model.fused_pointwise = enabled
    return model


def is_invariant(model: nn.Module) -> bool:
    """Whether ``apply_invariant_numerics(model, True)`` is in effect."""
    return bool(getattr(model, "invariant_numerics", False))
