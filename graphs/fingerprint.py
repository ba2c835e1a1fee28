"""The engine fingerprint a run records: everything that decides which tokens come out.

Re-executing a run reproduces its tokens only on the same weights, draft heads, tree-policy profile,
dtype, device kind, decode mode and attention path. ``Engine.fingerprint()`` (contract C2) is the
source of truth; until every engine has it, :func:`engine_fingerprint` computes the same keys from
what the engine exposes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

FINGERPRINT_KEYS = (
    "model_sha256",
    "heads_sha256",
    "profile_id",
    "profile_version",
    "dtype",
    "device",
    "mode",
    "attention",
)


def engine_fingerprint(engine: Any, mode: str | None = None) -> dict[str, str]:
    """``engine.fingerprint(mode)`` when the engine has it, else the same keys computed here."""
    method = getattr(engine, "fingerprint", None)
    if callable(method):
        return {str(k): str(v) for k, v in method(mode).items()}
    weights = getattr(engine, "weights_info", None)
    heads = getattr(engine, "heads", None)
    model = engine.model
    policy = getattr(engine, "policy", None)
    profile = ""
    if policy is not None and dataclasses.is_dataclass(policy):
        public = {
            f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if not f.name.startswith("_")
        }
        profile = hashlib.sha256(json.dumps(public, sort_keys=True, default=repr).encode()).hexdigest()[:16]
    return {
        "model_sha256": str(getattr(weights, "sha256", "") or ""),
        "heads_sha256": str(getattr(heads, "source_sha256", "") or "") if heads is not None else "",
        "profile_id": profile,
        "profile_version": "",
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": model.device.type,
        "mode": str(mode or engine.default_mode),
        "attention": "reference",
    }
