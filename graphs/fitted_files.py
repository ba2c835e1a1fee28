"""The files fitted node kinds read (classifier probes, span pointers): written whole, read once per version.

Both node kinds keep what they learned in a JSON file beside the workflow; the file's bytes are part of
the node's fingerprint (so a refit is a new workflow version), it is written under a temporary name and
renamed (a crash mid-write leaves the old file), and it is parsed once per modification time, not per run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_CACHE: dict[tuple[str, int], Any] = {}


def write_json(path: Path, data: Any) -> None:
    """Written whole or not at all (a temporary name, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    tmp.replace(path)


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes ("" while it does not exist: a workflow can register before fitting)."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def load_cached(path: Path, parse: Callable[[Any], T], error: type[Exception], what: str) -> T:
    """``parse(json of path)``, cached by (path, modification time); a missing or unreadable file raises
    ``error`` naming ``what`` and how to make one."""
    if not path.exists():
        raise error(f"no {what} at {path}; fit one with `elesium fit-classifier`")
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _CACHE:
        try:
            _CACHE[key] = parse(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise error(f"cannot read {what} {path}: {exc}") from None
    return _CACHE[key]
