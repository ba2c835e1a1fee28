"""Medusa heads: K small residual MLPs that guess the tokens after the base model's next one.

Design (Cai et al. 2024, "Medusa-1" heads; HEADS.md has the longer notes and the results):

* **Which hidden state.** Every head reads the base model's *final-norm* hidden state ``h_t`` at the
  current position, i.e. exactly what ``Transformer.forward`` returns and what ``lm_head`` consumes.
  ``lm_head(h_t)`` gives the base model's next token ``x_{t+1}``; head ``k`` (1-based) guesses
  ``x_{t+1+k}``. Reading the post-norm state means the speculative engine reuses the hidden states it
  already computed for verification: no extra base-model work per step.
* **Residual blocks, zero-initialised.** A head is one or more blocks ``x + SiLU(W x + b)`` with
  ``W, b = 0`` at init, so an untrained head computes ``lm_head(h_t)``: it starts as "the next token
  repeats" rather than noise, which is the Medusa recipe and makes training converge fast. Every
  block owns its weights (Medusa's reference code repeats one block object ``num_layers`` times,
  which silently shares weights between layers; we don't).
* **No per-head output layer.** Each head's transformed state goes through the base model's own
  frozen ``lm_head`` (tied to the embeddings for SmolLM2). A per-head ``[hidden, vocab]`` layer would
  be 576 x 49152 = 28M parameters per head (57 MB in fp16 for one head) for a 135M base model, would
  have to be learned from scratch, and would break the zero-init identity. Sharing it keeps the
  shipped file ~2.7 MB and puts all capacity where it is cheap (576 x 576 per block).

API used by the speculative engine (keep it stable): ``MedusaHeads.forward(hidden) -> [K, ..., H]``
(the caller applies ``model.logits``), ``head_logits``, ``teacher_forced`` (shared with
``HydraHeads``, the sequentially dependent variant in ``hydra_heads.py``), ``save_heads`` /
``load_heads`` (which builds either kind from the manifest).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from elesium.inference.head_storage import Scheme, read_state, write_state

MANIFEST_FORMAT = "elesium-medusa-heads/1"
WEIGHTS_FILE = "heads.safetensors"
MANIFEST_FILE = "manifest.json"
DRAFTER_FILE = "drafter.safetensors"  # feature_drafter.py's weights, beside the heads'


class HeadsMismatchError(ValueError):
    """The heads were trained for a different base model than the one loaded."""


def default_heads_dir() -> Path:
    """The heads shipped with the package, trained for the bundled SmolLM2-135M-Instruct."""
    return Path(__file__).resolve().parent / "heads" / "smollm2-135m-instruct"


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with ``W, b`` zero-initialised: the identity until trained."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` independent stacks of ``num_layers`` residual blocks over the final-norm hidden state.

    Example::

        heads = load_heads(None, base_sha256=engine.weights_info.sha256, device="cpu", dtype=torch.float32)
        hidden = engine.model(tokens, positions, cache, offset)[:, -1]      # [B, H]
        logits = heads.head_logits(engine.model, hidden)                    # [K, B, V] float32
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, num_layers: int = 1) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 1, got {num_heads} and {num_layers}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        # Fresh ResBlock objects for every (head, layer): no accidental weight sharing.
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads))

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0][0].linear.weight.dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformed hidden states ``[num_heads, ..., H]`` in ``hidden``'s dtype.

        Runs in the heads' own dtype (fp16 heads on a float32 model work) and casts back, so the
        result can go straight into ``model.logits``.
        """
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[-1]} does not match the heads' {self.hidden_size}")
        x = hidden.to(self.dtype)
        return torch.stack([head(x) for head in self.heads]).to(hidden.dtype)

    def head_logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[num_heads, ..., V]`` through the base model's shared ``lm_head``."""
        return model.logits(self(hidden))  # type: ignore[operator]

    def teacher_forced(self, model: nn.Module, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Same signature as ``HydraHeads.teacher_forced``; Medusa heads ignore the tokens."""
        return self(hidden)

    def config(self) -> dict[str, int | str]:
        return {"kind": "medusa", "num_heads": self.num_heads, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size}


if TYPE_CHECKING:
    from elesium.inference.hydra_heads import DraftHeads


def save_heads(heads: "DraftHeads", directory: str | Path, manifest: dict[str, Any],
               storage: Scheme = "float") -> Path:
    """Write ``heads.safetensors`` and ``manifest.json`` to ``directory``.

    ``storage`` is ``float`` (the heads' current dtype), or ``int8`` / ``int4`` / ``mixed`` weight
    matrices with the biases in the heads' dtype (``head_storage`` says why and how). ``manifest``
    must carry ``base_model.sha256``; the head config, storage and format tag are filled in here so
    they can never disagree with the weights.
    """
    directory = Path(directory)
    sha = (manifest.get("base_model") or {}).get("sha256")
    if not sha:
        raise ValueError("the manifest needs base_model.sha256 (the base model the heads were trained on)")
    directory.mkdir(parents=True, exist_ok=True)
    drafter = getattr(heads, "drafter", None)
    own = {k: v for k, v in heads.state_dict().items() if not k.startswith("drafter.")}
    write_state(directory / WEIGHTS_FILE, own, storage, heads.dtype, {"format": MANIFEST_FORMAT})
    block: dict[str, Any] = {**manifest.get("heads", {}), **heads.config(),
                             "dtype": str(heads.dtype).removeprefix("torch."), "storage": storage}
    block.pop("drafter", None)
    stale = directory / DRAFTER_FILE
    if drafter is not None:
        write_state(stale, drafter.state_dict(), storage, heads.dtype, {"format": MANIFEST_FORMAT})
        block["drafter"] = {**drafter.config(), "file": DRAFTER_FILE, "storage": storage}
    elif stale.exists():
        stale.unlink()  # a drafter from an earlier run in this directory no longer belongs to these heads
    full = {"format": MANIFEST_FORMAT, **manifest, "heads": block}
    (directory / MANIFEST_FILE).write_text(json.dumps(full, indent=2) + "\n")
    return directory


def read_manifest(path: str | Path | None = None) -> dict[str, Any]:
    """The manifest of a heads directory (None: the shipped default)."""
    directory = _heads_dir(path)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.exists():
        raise FileNotFoundError(f"no {MANIFEST_FILE} in {directory}; expected a directory written by save_heads "
                                "(`elesium train-heads --out DIR`)")
    return json.loads(manifest_path.read_text())


def load_heads(path: str | Path | None, *, base_sha256: str, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> "DraftHeads":
    """Load heads from a directory (None: the shipped default), checking they fit the base model.

    Raises:
        FileNotFoundError: no manifest or weights there.
        HeadsMismatchError: the manifest names another base model (heads are only meaningful on the
            exact hidden states they were trained on).
    """
    directory = _heads_dir(path)
    manifest = read_manifest(directory)
    trained_for = (manifest.get("base_model") or {}).get("sha256")
    if trained_for != base_sha256:
        raise HeadsMismatchError(
            f"Medusa heads in {directory} were trained for base model sha256 {trained_for}, but the loaded "
            f"model is sha256 {base_sha256}; train heads for this model with `elesium train-heads`")
    weights = directory / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
    drafter_cfg = manifest["heads"].get("drafter")
    if drafter_cfg is not None and manifest["heads"].get("kind") != "hydra":
        raise ValueError(f"{directory}: the manifest names a drafter, which is only supported with hydra heads")
    heads = build_heads(manifest["heads"])
    heads.load_state_dict(read_state(weights))
    digest = hashlib.sha256(weights.read_bytes())
    if drafter_cfg is not None:
        from elesium.inference.feature_drafter import FeatureDrafter

        drafter_file = directory / drafter_cfg.get("file", DRAFTER_FILE)
        if not drafter_file.exists():
            raise FileNotFoundError(f"the manifest in {directory} names a drafter, but {drafter_file.name} is missing")
        drafter = FeatureDrafter.from_config(drafter_cfg)
        drafter.load_state_dict(read_state(drafter_file))
        heads.drafter = drafter
        digest.update(drafter_file.read_bytes())
    # Tuning profiles record which heads they measured (drafter included); this is how they are matched.
    heads.source_sha256 = digest.hexdigest()
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_heads(cfg: dict[str, Any]) -> "DraftHeads":
    """Untrained heads of the shape a manifest's ``heads`` block (or ``DraftHeads.config()``) names."""
    from elesium.inference.hydra_heads import HydraHeads

    kind = cfg.get("kind", "medusa")
    size, num, layers = int(cfg["hidden_size"]), int(cfg["num_heads"]), int(cfg["num_layers"])
    if kind == "medusa":
        return MedusaHeads(size, num, layers)
    if kind == "hydra":
        return HydraHeads(size, num, layers, cfg.get("conditioning", "concat"))
    raise ValueError(f"unknown heads kind {kind!r} in the manifest; this version knows medusa and hydra")


def _heads_dir(path: str | Path | None) -> Path:
    if path is None:
        return default_heads_dir()
    p = Path(path).expanduser()
    if p.is_file():  # heads.safetensors or manifest.json given directly
        return p.parent
    if not p.exists():
        raise FileNotFoundError(f"heads not found: {p} (expected a directory with {WEIGHTS_FILE} and {MANIFEST_FILE})")
    return p
