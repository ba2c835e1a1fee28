"""The invariant-numerics setting and the model switch, on the CPU.

The kernels themselves: test_invariant_kernels; their effect on decoding: test_gpu.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elesium.config import Settings, SettingsError
from elesium.inference.runtime.invariant import (
    InvariantLinear,
    InvariantRMSNorm,
    apply_invariant_numerics,
    is_invariant,
    parse_setting,
    resolve,
)
from elesium.inference.runtime.model import Attention, RMSNorm
from helpers import tiny_model


def test_setting_parses_and_resolves_by_device() -> None:
    assert [parse_setting(v) for v in ("ON", "off", None, " auto ", "1", "false")] == \
        ["on", "off", "auto", "auto", "on", "off"]
    with pytest.raises(ValueError, match="on, off or auto"):
        parse_setting("sometimes")
    assert resolve("auto", "cuda") and not resolve("auto", "cpu")
    assert resolve("on", "cpu") and not resolve("off", "cuda")


def test_settings_field_reads_the_environment_and_rejects_nonsense() -> None:
    assert Settings.from_env({}).invariant_numerics == "auto"
    assert Settings.from_env({"ELESIUM_INVARIANT_NUMERICS": "OFF"}).invariant_numerics == "off"
    with pytest.raises(SettingsError, match="ELESIUM_INVARIANT_NUMERICS"):
        Settings.from_env({"ELESIUM_INVARIANT_NUMERICS": "maybe"})


def test_switch_swaps_only_the_models_own_layers_and_undoes() -> None:
    model = tiny_model(1)
    extra = nn.Linear(4, 4)  # a subclass-free Linear outside the model stays as it is
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.tensor([[1, 5, 7, 2]])
    cache = model.new_cache(16)
    ref = model.logits(model(tokens, torch.arange(4), cache, 0))

    apply_invariant_numerics(model, True)
    assert is_invariant(model) and type(extra) is nn.Linear
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is InvariantLinear for m in linears)
    assert all(type(m) is InvariantRMSNorm for m in model.modules() if isinstance(m, RMSNorm))
    assert all(m.invariant for m in model.modules() if isinstance(m, Attention))
    assert model.lm_head.weight is model.embed.weight  # tied weights survive
    assert model.state_dict().keys() == before.keys()
    # Off CUDA the switched layers compute exactly what the plain ones do.
    assert torch.equal(model.logits(model(tokens, torch.arange(4), model.new_cache(16), 0)), ref)

    apply_invariant_numerics(model, False)
    assert not is_invariant(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(type(m) is RMSNorm for m in model.modules() if isinstance(m, RMSNorm))
    assert not any(m.invariant for m in model.modules() if isinstance(m, Attention))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_switched_layers_keep_autograd() -> None:
    """Training reads the base model's lm_head with gradients to the input: the switch must not break it."""
    model = apply_invariant_numerics(tiny_model(2), True)
    h = torch.randn(3, 32, requires_grad=True)
    model.logits(h).sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0
