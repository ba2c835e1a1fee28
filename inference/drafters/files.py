"""Draft heads on disk: a manifest plus safetensors, matched to a base model by sha256.

A heads directory holds ``manifest.json`` (format, base model, head config, storage), ``heads.safetensors``
and, for Hydra heads with the attention drafter, ``drafter.safetensors``. An ``eagle`` drafter tree
(``drafter_tree.py``) is the drafter alone: manifest and ``drafter.safetensors``, no heads file.
The manifest's ``format`` is
``elesium-draft-heads/1``; directories written before the rename say ``elesium-medusa-heads/1`` and still
load.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elesium.inference.drafters.medusa import MedusaHeads
from elesium.inference.drafters.storage import Scheme, read_state, write_state

MANIFEST_FORMAT = "elesium-draft-heads/1"
# Formats this version reads: the current one, and the name used before Hydra heads and the drafter existed.
READABLE_FORMATS = (MANIFEST_FORMAT, "elesium-medusa-heads/1")
WEIGHTS_FILE = "heads.safetensors"
MANIFEST_FILE = "manifest.json"
DRAFTER_FILE = "drafter.safetensors"  # attention_drafter.py's weights, beside the heads'


class HeadsMismatchError(ValueError):
    """The heads were trained for a different base model than the one loaded."""


def default_heads_dir() -> Path:
    """The heads shipped with the package, trained for the bundled SmolLM2-135M-Instruct."""
    return Path(__file__).resolve().parent / "shipped" / "smollm2-135m-instruct"


if TYPE_CHECKING:
    from elesium.inference.drafters.hydra import HeadsModule


def save_heads(heads: HeadsModule, directory: str | Path, manifest: dict[str, Any],
               storage: Scheme = "float") -> Path:
    """Write ``heads.safetensors`` and ``manifest.json`` to ``directory``.

    ``storage`` is ``float`` (the heads' current dtype), or ``int8`` / ``int4`` / ``mixed`` weight
    matrices with the biases in the heads' dtype (``storage.py`` says why and how). ``manifest``
    must carry ``base_model.sha256``; the head config, storage and format tag are filled in here so
    they can never disagree with the weights.
    """
    directory = Path(directory)
    sha = (manifest.get("base_model") or {}).get("sha256")
    if not sha:
        raise ValueError("the manifest needs base_model.sha256 (the base model the heads were trained on)")
    directory.mkdir(parents=True, exist_ok=True)
    drafter = heads.drafter
    own = {k: v for k, v in heads.state_dict().items() if not k.startswith("drafter.")}
    if own:
        write_state(directory / WEIGHTS_FILE, own, storage, heads.dtype, {"format": MANIFEST_FORMAT})
    elif (directory / WEIGHTS_FILE).exists():
        (directory / WEIGHTS_FILE).unlink()  # heads from an earlier run here; a drafter tree has none
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
        raise FileNotFoundError(f"no {MANIFEST_FILE} in {directory}; expected a directory written by "
                                "save_heads (`elesium train-heads --out DIR`)")
    manifest = json.loads(manifest_path.read_text())
    fmt = manifest.get("format", MANIFEST_FORMAT)
    if fmt not in READABLE_FORMATS:
        raise ValueError(f"{manifest_path}: unknown heads format {fmt!r}; this version reads "
                         f"{', '.join(READABLE_FORMATS)}")
    return manifest


def load_heads(path: str | Path | None, *, base_sha256: str, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> HeadsModule:
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
            f"draft heads in {directory} were trained for base model sha256 {trained_for}, but the loaded "
            f"model is sha256 {base_sha256}; train heads for this model with `elesium train-heads`")
    kind = manifest["heads"].get("kind")
    weights = directory / WEIGHTS_FILE
    if kind != "eagle" and not weights.exists():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
    drafter_cfg = manifest["heads"].get("drafter")
    if drafter_cfg is not None and kind not in ("hydra", "eagle"):
        raise ValueError(f"{directory}: the manifest names a drafter, which is only supported with "
                         "hydra heads and eagle drafter trees")
    if kind == "eagle" and drafter_cfg is None:
        raise ValueError(f"{directory}: an eagle drafter tree needs the manifest's heads.drafter block")
    heads = build_heads(manifest["heads"])
    digest = hashlib.sha256()
    if kind != "eagle":
        heads.load_state_dict(read_state(weights))
        digest.update(weights.read_bytes())
    if drafter_cfg is not None:
        from elesium.inference.drafters.attention_drafter import FeatureDrafter

        drafter_file = directory / drafter_cfg.get("file", DRAFTER_FILE)
        if not drafter_file.exists():
            raise FileNotFoundError(f"the manifest in {directory} names a drafter, but "
                                    f"{drafter_file.name} is missing")
        drafter = FeatureDrafter.from_config(drafter_cfg)
        drafter.load_state_dict(read_state(drafter_file))
        heads.drafter = drafter
        digest.update(drafter_file.read_bytes())
    # Tuning profiles record which heads they measured (drafter included); this is how they are matched.
    heads.source_sha256 = digest.hexdigest()
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_heads(cfg: dict[str, Any]) -> HeadsModule:
    """Untrained heads of the shape a manifest's ``heads`` block (or the heads' ``config()``) names."""
    from elesium.inference.drafters.attention_drafter import FeatureDrafter
    from elesium.inference.drafters.drafter_tree import DrafterTree
    from elesium.inference.drafters.hydra import HydraHeads

    kind = cfg.get("kind", "medusa")
    size, num, layers = int(cfg["hidden_size"]), int(cfg["num_heads"]), int(cfg["num_layers"])
    if kind == "medusa":
        return MedusaHeads(size, num, layers)
    if kind == "hydra":
        return HydraHeads(size, num, layers, cfg.get("conditioning", "concat"))
    if kind == "eagle":  # the drafter is the whole module; its block names its shape
        return DrafterTree(FeatureDrafter.from_config(cfg["drafter"]), num)
    raise ValueError(f"unknown heads kind {kind!r} in the manifest; this version knows medusa, hydra and "
                     "eagle")


def _heads_dir(path: str | Path | None) -> Path:
    if path is None:
        return default_heads_dir()
    p = Path(path).expanduser()
    if p.is_file():  # heads.safetensors or manifest.json given directly
        return p.parent
    if not p.exists():
        raise FileNotFoundError(f"heads not found: {p} (expected a directory with {WEIGHTS_FILE} and "
                                f"{MANIFEST_FILE})")
    return p
