"""The heads' training recipe as plain values: one place for the library's and the CLI's defaults.

The defaults are the shipped heads' recipe (HEADS.md): Hydra heads with chain conditioning, two
blocks, 8,000 distillation prompts, 5,000 steps of 4,096 positions, an attention drafter for level 1
trained for 3,000 steps, stored ``mixed``. ``elesium train-heads`` reads its flags' defaults from
these fields, so ``TrainConfig()`` and the bare command train the same thing. Tests and quick
experiments pass their small values explicitly. No torch import here: ``elesium --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elesium.inference.drafters.storage import Scheme


@dataclass
class TrainConfig:
    """Plain values, nanoGPT style; every field but the last few is a ``train-heads`` flag."""

    out: Path = Path("heads-out")
    data: Path | None = None          # distillation JSONL; None: generate it (and save to out/)
    prompts: int = 8000               # prompts to generate when data is None
    distill_only: bool = False        # stop after writing out/distill.jsonl.gz
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 0.7)
    gen_batch: int = 64
    num_heads: int = 4
    num_layers: int = 2               # residual blocks per head
    kind: str = "hydra"               # "medusa", "hydra" (heads that also read the drafted tokens) or
    #                                   "eagle" (the attention drafter for every level, num_heads deep)
    conditioning: str = "chain"       # hydra only: "concat" (Hydra's) or "chain" (recurrent)
    loss: str = "kl"                  # "kl" (to the base distribution) or "ce" (to the sampled token)
    decay: float = 0.8                # lambda: head k's loss weight is decay**k
    steps: int = 5000
    batch_size: int = 4096            # positions per step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.0
    eval_every: int = 250
    ckpt_every: int = 500
    val_fraction: float = 0.03
    seed: int = 0
    resume: bool = False
    time_budget_s: float | None = None  # stop the loop early (and still save) past this many seconds
    eval_prompts: Path | None = None    # e.g. MT-Bench; scored at the end with eval_max_tokens
    eval_max_tokens: int = 256
    save_dtype: str = "float16"
    storage: Scheme = "mixed"           # weight matrices on disk: float (save_dtype), int8, int4 or mixed
    # "attention": also train attention_drafter.py's level-1 drafter (hydra only); "none": heads alone
    drafter: str = "attention"
    drafter_steps: int = 3000
    drafter_batch: int = 32             # whole sequences per drafter step
    drafter_lr: float = 1e-3
    drafter_intermediate: int | None = None  # the drafter layer's MLP width (None: the base model's)
    init_drafter: Path | None = None    # eagle: start from this heads directory's drafter
    # what the data's prompts are, for the manifest (train-heads --from-log names the runs instead)
    prompt_source: str = "elesium/data/distill_templates.jsonl (not MT-Bench)"
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
