"""Graph values as JSON: what checkpoints, stream events and replay reports carry."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel


def jsonable(obj: Any) -> Any:
    """A JSON-ready copy of graph values (pydantic models, dataclasses, messages, interrupts)."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, BaseModel):
        return jsonable(obj.model_dump(mode="json"))
    type_name = type(obj).__name__
    if type_name == "Interrupt":
        return {"value": jsonable(getattr(obj, "value", None)), "id": str(getattr(obj, "id", ""))}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "model_dump"):
        return jsonable(obj.model_dump())
    if hasattr(obj, "_asdict"):
        return jsonable(obj._asdict())
    return repr(obj)
