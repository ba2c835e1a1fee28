"""A workflow's version: a content hash of everything that decides what a run does.

Structure (nodes, edges, conditional branches and their targets), every node's code or, for LLM
nodes, its prompt, sampling settings and output grammar, the state and input schemas. Change any
of them and the version changes, so a run's recorded version says exactly which graph it ran.
Node code is hashed from source (``inspect.getsource``) plus, one module deep, the module-level
functions it calls (policy rules in a helper are part of the node's behaviour); where the source
is not available (code built at run time) the bytecode stands in.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import types
from typing import Any

from langgraph.graph import StateGraph

VERSION_CHARS = 16


def _code_of(fn: Any, seen: set[int]) -> Any:
    """Source of ``fn`` and of the same-module functions it names, recursively."""
    if id(fn) in seen:
        return None
    seen.add(id(fn))
    fingerprint = getattr(fn, "fingerprint", None)
    if callable(fingerprint) and not isinstance(fn, type):
        return fingerprint()
    target = fn.func if hasattr(fn, "func") and callable(fn.func) else fn  # RunnableCallable
    if target is not fn:
        return _code_of(target, seen)
    if isinstance(target, (types.FunctionType, types.MethodType)):
        raw = inspect.unwrap(target)
        try:
            body: Any = inspect.getsource(raw)
        except (OSError, TypeError):
            code = raw.__code__
            body = {"bytecode": code.co_code.hex(), "consts": repr(code.co_consts), "names": code.co_names}
        helpers = {}
        module = getattr(raw, "__module__", None)
        for name in getattr(raw.__code__, "co_names", ()):
            ref = raw.__globals__.get(name)
            if isinstance(ref, types.FunctionType) and ref.__module__ == module:
                sub = _code_of(ref, seen)
                if sub is not None:
                    helpers[name] = sub
        return {"source": body, "calls": helpers} if helpers else {"source": body}
    if callable(target) and not isinstance(target, type):
        return _code_of(type(target).__call__, seen)
    return repr(target)


def _schema_of(tp: Any) -> Any:
    if hasattr(tp, "model_json_schema"):
        return tp.model_json_schema()
    try:
        return inspect.getsource(tp)
    except (OSError, TypeError):
        return {k: repr(v) for k, v in getattr(tp, "__annotations__", {}).items()}


def describe_graph(builder: StateGraph, input_model: Any = None) -> dict[str, Any]:
    """The hashed description: JSON-able, sorted, free of memory addresses."""
    nodes = {name: _code_of(spec.runnable, set()) for name, spec in sorted(builder.nodes.items())}
    edges = sorted(
        [list(e) for e in builder.edges] + [[sorted(starts), end] for starts, end in builder.waiting_edges],
        key=json.dumps,
    )
    branches = {
        source: {
            name: {
                "path": _code_of(branch.path, set()),
                "ends": sorted([str(k), v] for k, v in (branch.ends or {}).items()),
            }
            for name, branch in sorted(by_name.items())
        }
        for source, by_name in sorted(builder.branches.items())
    }
    return {
        "nodes": nodes,
        "edges": edges,
        "branches": branches,
        "state": _schema_of(builder.state_schema),
        "input": _schema_of(input_model) if input_model is not None else None,
    }


def graph_version(builder: StateGraph, input_model: Any = None) -> str:
    """16 hex chars of sha256 over :func:`describe_graph`."""
    text = json.dumps(describe_graph(builder, input_model), sort_keys=True, default=repr, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:VERSION_CHARS]
