"""Per-hardware tuning profiles: the measured forward cost curve and head acceptance, and the tree
they imply. ``elesium tune`` writes one; the engine reads the one for its device.

Lookup order: ``<cache_dir>/profiles/<model sha[:16]>-<device kind>-<dtype>[-<weights>].json`` (tuned
here), then the profiles shipped in ``inference/tuning/profiles/<device kind>.json``, then the built-in
policy. On a CPU the device kind names the CPU model, the SIMD flags the kernels dispatch on and the
thread count, and a profile also records its weight format ("gguf-blocks", "bfloat16", "float32"):
a cost curve measured on one CPU or format says nothing about another. Profiles shipped before
that (``cpu-<threads>t.json``, no weight format) still serve the float32 reference.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from elesium.inference.decoding.drafts import FactoredDrafts
from elesium.inference.decoding.tree import top_paths
from elesium.inference.decoding.tree_policy import CostCurve, TreePolicy

SHIPPED = Path(__file__).resolve().parent / "profiles"


SIMD_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "avx_vnni", "avx2",
              "fma", "f16c", "asimd", "sve")
"""CPU flags that change which kernel torch, oneDNN or MKL runs (x86 and Arm), hence a cost curve."""


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def cpu_signature() -> str:
    """The CPU model and its kernel-relevant flags, filename-safe: "amd-epyc-avx2-fma-f16c"."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model in (platform.processor(), platform.machine()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return "-".join([_slug(model)[:40] or "unknown", *(f.replace("_", "") for f in SIMD_FLAGS if f in flags)])


def device_kind(device: torch.device) -> str:
    """A filename-safe name for the hardware: "cpu-amd-epyc-avx2-fma-f16c-2t" or "cuda-nvidia-h200"."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        return "cuda-" + "".join(c if c.isalnum() else "-" for c in name).strip("-")
    return f"cpu-{cpu_signature()}-{torch.get_num_threads()}t"


def weights_of(model: torch.nn.Module) -> str:
    """The weight format a model runs (``cpu_weights.apply_weight_format`` marks it); "float32" =
    the model's own dtype, unchanged."""
    return str(getattr(model, "weights_format", "float32"))


def profile_weights(weights: str, forward: str) -> str:
    """The key a profile's cost curve is filed under: the weight format, plus "-compiled" when CPU steps
    run the compiled graph (``runtime/cpu_step.py``), whose one-token step costs a fraction of the eager
    one: a curve measured on one path would mislead the other."""
    return f"{weights}-compiled" if forward == "compiled" else weights


@dataclass
class TuneProfile:
    device_kind: str
    dtype: str
    model_sha256: str
    cost_sizes: list[int]
    cost_ms: list[float]
    step_overhead_ms: float
    acceptance: list[list[float]]  # acceptance[d][r]: P(head d+1's rank-r token is right)
    kind: str = "dynamic"
    static_paths: list[list[int]] = field(default_factory=list)
    max_nodes: int = 64
    expected_tokens_per_step: float = 1.0
    # False when speculation measured slower than vanilla here: the engine then defaults to vanilla
    # (heads stay loaded, so --mode medusa still works).
    speculate: bool = True
    # The heads' weights file the acceptance and tree were measured with ("": any heads).
    heads_sha256: str = ""
    # The linear layers' format on a CPU ("gguf-blocks", "bfloat16"); "" / "float32": the model's dtype.
    weights: str = ""
    created: str = ""
    host: str = field(default_factory=platform.node)

    def cost_curve(self) -> CostCurve:
        """Forward cost plus the per-step overhead (heads, verification, compaction)."""
        return CostCurve(list(self.cost_sizes), [t + self.step_overhead_ms for t in self.cost_ms])

    def policy(self) -> TreePolicy:
        if self.kind == "static" and self.static_paths:
            return TreePolicy(kind="static", static_paths=tuple(tuple(p) for p in self.static_paths),
                              cost=self.cost_curve())
        return TreePolicy(kind="dynamic", max_nodes=self.max_nodes, cost=self.cost_curve())

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: Path) -> "TuneProfile":
        data: dict[str, Any] = json.loads(path.read_text())
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})


def profile_path(cache_dir: Path, model_sha256: str, device: torch.device, dtype: torch.dtype,
                 weights: str = "float32") -> Path:
    dt = str(dtype).removeprefix("torch.")
    suffix = "" if weights in ("", "float32") else f"-{weights}"
    return cache_dir / "profiles" / f"{model_sha256[:16]}-{device_kind(device)}-{dt}{suffix}.json"


def find_profile(cache_dir: Path, model_sha256: str, device: torch.device, dtype: torch.dtype,
                 heads_sha256: str = "", weights: str = "float32") -> TuneProfile | None:
    """The tuned profile for this model, device, dtype and weight format, unless it was tuned with
    other heads. A legacy CPU profile (named by thread count alone) serves only float32 weights."""
    kind = device_kind(device)
    weights = weights or "float32"
    legacy = SHIPPED / f"cpu-{torch.get_num_threads()}t.json"
    for candidate in (profile_path(cache_dir, model_sha256, device, dtype, weights), SHIPPED / f"{kind}.json",
                      legacy, SHIPPED / f"{device.type}.json"):
        if candidate.exists() and (candidate != legacy or device.type == "cpu"):
            prof = TuneProfile.load(candidate)
            if (prof.model_sha256 == model_sha256 and prof.heads_sha256 in ("", heads_sha256)
                    and (prof.weights or "float32") == weights):
                return prof
    return None


def best_static_tree(acceptance: list[list[float]], cost: CostCurve,
                     max_nodes: int = 128) -> tuple[list[list[int]], float]:
    """Sequoia's objective over Medusa trees: maximise expected tokens per unit time.

    Expected committed tokens of a tree = 1 (the bonus token) + the sum, over its nodes, of the
    probability that the whole path to the node is accepted (product of per-(depth, rank) rates).
    """
    import math

    logs = [[math.log(max(p, 1e-9)) for p in row] for row in acceptance]
    best: tuple[float, list[list[int]], float] = (1.0 / cost(1), [], 1.0)
    for n in range(2, max_nodes + 1):
        tree = top_paths(FactoredDrafts.from_scores(logs), n)
        expected = 1.0 + sum(math.exp(sum(logs[d][r] for d, r in enumerate(p))) for p in tree.paths[1:])
        rate = expected / cost(tree.size)
        if rate > best[0]:
            best = (rate, [list(p) for p in tree.paths[1:]], expected)
    return best[1], best[2]
