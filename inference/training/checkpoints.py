"""Resumable training checkpoints: one module, its optimiser, the step and the evaluation history.

The heads and the drafter train in separate loops with the same resume contract (a resumed run draws
the same batches, so it must restore exactly these four things); both use this one format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def save_checkpoint(path: Path, name: str, module: nn.Module, opt: torch.optim.Optimizer, step: int,
                    history: list[dict[str, Any]], **extra: Any) -> None:
    """Write ``{name: weights, "optimizer", "step", "history", **extra}`` to ``path``."""
    torch.save({name: module.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history,
                **extra},
               path)


def load_checkpoint(path: Path, name: str, module: nn.Module, opt: torch.optim.Optimizer,
                    device: torch.device) -> tuple[int, list[dict[str, Any]]]:
    """Restore ``module`` and ``opt`` in place from ``path``; return (step, history)."""
    ckpt = torch.load(path, map_location=device, weights_only=False)
    module.load_state_dict(ckpt[name])
    opt.load_state_dict(ckpt["optimizer"])
    return ckpt["step"], ckpt["history"]
