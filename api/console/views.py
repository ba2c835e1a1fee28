"""What the console's pages show, computed from the stores: no HTML here but the graph's SVG.

- :func:`graph_svg`: LangGraph's own ``graph.get_graph()`` laid out in layers (longest path from
  ``__start__``, back edges ignored) as inline SVG, the run's path highlighted;
- :func:`timeline`: the run's checkpoints, each with the node that wrote it and its channel changes;
- :func:`llm_calls`: every call's prompt and answer from the acceptance log, each answer token with the
  tree depth at which it was accepted (0: the base model's own token, d >= 1: a draft accepted at d);
- :func:`tau_per_node`: the acceptance summary per node.

Every string that reaches the SVG goes through :func:`html.escape`; the templates autoescape the rest.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from typing import Any

from elesium.graphs.replay import jsonable, read_checkpoint

MAX_DEPTH_CLASS = 5
"""Depths from here up share one shade (class ``d5``)."""


# ---------------------------------------------------------------- graph
def graph_svg(drawable: Any, visited: Iterable[str] = (), pending: Iterable[str] = ()) -> str:
    """``graph.get_graph()`` as an SVG: one row per layer, the visited nodes and the edges between
    consecutive visited nodes highlighted (classes ``visited``, ``taken``), pending nodes marked."""
    nodes = list(drawable.nodes)
    edges = [(e.source, e.target, bool(e.conditional)) for e in drawable.edges]
    visited_seq = list(visited)
    seen = set(visited_seq)
    pending_set = set(pending)
    out: dict[str, list[str]] = {n: [] for n in nodes}
    for s, t, _ in edges:
        out.setdefault(s, []).append(t)
    # Back edges (cycles) found by DFS from the start are left out of the layering.
    back: set[tuple[str, str]] = set()
    state: dict[str, int] = {}

    def dfs(n: str) -> None:
        state[n] = 1
        for t in out.get(n, []):
            if state.get(t) == 1:
                back.add((n, t))
            elif t not in state:
                dfs(t)
        state[n] = 2

    for root in (["__start__"] if "__start__" in out else []) + nodes:
        if root not in state:
            dfs(root)
    layer = {n: 0 for n in nodes}
    order = _topological(nodes, [(s, t) for s, t, _ in edges if (s, t) not in back])
    for n in order:
        for t in out.get(n, []):
            if (n, t) not in back and t in layer:
                layer[t] = max(layer[t], layer[n] + 1)
    rows: dict[int, list[str]] = {}
    for n in order:
        rows.setdefault(layer[n], []).append(n)
    char_w, box_h, gap_x, gap_y, pad = 7.2, 28, 24, 30, 16
    width_of = {n: max(70.0, len(n) * char_w + 24) for n in nodes}
    row_w = {k: sum(width_of[n] for n in r) + gap_x * (len(r) - 1) for k, r in rows.items()}
    total_w = max(row_w.values(), default=100) + 2 * pad + 120  # room for edges that bulge right
    pos: dict[str, tuple[float, float]] = {}
    for k, r in rows.items():
        x = (total_w - 120 - row_w[k]) / 2
        for n in r:
            pos[n] = (x, pad + k * (box_h + gap_y))
            x += width_of[n] + gap_x
    total_h = pad * 2 + (max(rows, default=0) + 1) * (box_h + gap_y) - gap_y
    taken = set(zip(visited_seq, visited_seq[1:]))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" role="img" aria-label="workflow graph" '
        f'width="{total_w:.0f}" height="{total_h:.0f}" viewBox="0 0 {total_w:.0f} {total_h:.0f}">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" class="arrowhead"/></marker>'
        '<marker id="arrow-taken" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" class="arrowhead taken"/></marker></defs>',
    ]
    for s, t, conditional in edges:
        if s not in pos or t not in pos:
            continue
        (sx, sy), (tx, ty) = pos[s], pos[t]
        x1, y1 = sx + width_of[s] / 2, sy + box_h
        x2, y2 = tx + width_of[t] / 2, ty
        if (s, t) in back or layer[t] - layer[s] != 1:
            # A skip over layers (or a loop back): a curve out to the right, clear of the boxes between.
            bulge = max(sx + width_of[s], tx + width_of[t]) + 60
            x1, y1 = sx + width_of[s], sy + box_h / 2
            x2, y2 = tx + width_of[t], ty + box_h / 2
            d = f"M{x1:.1f},{y1:.1f} C{bulge:.1f},{y1:.1f} {bulge:.1f},{y2:.1f} {x2:.1f},{y2:.1f}"
        else:
            d = f"M{x1:.1f},{y1:.1f} L{x2:.1f},{y2:.1f}"
        is_taken = (s, t) in taken
        cls = "edge" + (" conditional" if conditional else "") + (" taken" if is_taken else "")
        marker = "arrow-taken" if is_taken else "arrow"
        parts.append(
            f'<path class="{cls}" data-source="{html.escape(s)}" data-target="{html.escape(t)}" '
            f'd="{d}" marker-end="url(#{marker})"/>'
        )
    for n in nodes:
        if n not in pos:
            continue
        x, y = pos[n]
        cls = "node"
        if n in ("__start__", "__end__"):
            cls += " terminal"
        if n in seen:
            cls += " visited"
        if n in pending_set:
            cls += " pending"
        label = html.escape(n)
        parts.append(
            f'<g class="{cls}" data-node="{label}"><title>{label}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{width_of[n]:.1f}" height="{box_h}" rx="8"/>'
            f'<text x="{x + width_of[n] / 2:.1f}" y="{y + box_h / 2 + 4:.1f}" text-anchor="middle">'
            f"{label}</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _topological(nodes: list[str], edges: list[tuple[str, str]]) -> list[str]:
    """Kahn's order, stable in the graph's own node order (what is left in a cycle goes last)."""
    indeg = {n: 0 for n in nodes}
    for _, t in edges:
        if t in indeg:
            indeg[t] += 1
    order: list[str] = []
    ready = [n for n in nodes if indeg[n] == 0]
    while ready:
        n = ready.pop(0)
        order.append(n)
        for s, t in edges:
            if s == n and t in indeg:
                indeg[t] -= 1
                if indeg[t] == 0:
                    ready.append(t)
    return order + [n for n in nodes if n not in order]


# ---------------------------------------------------------------- checkpoints
def _short(value: Any, limit: int = 600) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} chars)"


def timeline(graph: Any, thread_id: str, checkpoint_ids: list[str]) -> list[dict[str, Any]]:
    """Each checkpoint of the run: step, the node(s) that wrote it, when, and its channel changes
    against the checkpoint before it (the first against its parent, from an earlier run or the input)."""
    items: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for i, cid in enumerate(checkpoint_ids):
        cfg = {"configurable": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": cid}}
        tup = graph.checkpointer.get_tuple(cfg)
        if tup is None:
            items.append({"checkpoint_id": cid, "missing": True, "changes": []})
            continue
        values, step, node = read_checkpoint(graph, thread_id, cid)
        if previous is None and tup.parent_config:
            parent_id = tup.parent_config["configurable"].get("checkpoint_id")
            previous = read_checkpoint(graph, thread_id, parent_id)[0] if parent_id else None
        values = values or {}
        before = previous or {}
        changes = []
        for key in sorted(set(values) | set(before)):
            if key.startswith("__"):
                continue
            old, new = before.get(key, _ABSENT), values.get(key, _ABSENT)
            if old == new:
                continue
            changes.append({
                "channel": key,
                "kind": "added" if old is _ABSENT else "removed" if new is _ABSENT else "changed",
                "old": None if old is _ABSENT else _short(old),
                "new": None if new is _ABSENT else _short(new),
            })
        meta = tup.metadata or {}
        items.append({
            "index": i,
            "checkpoint_id": cid,
            "step": step,
            "node": node or ("input" if meta.get("source") == "input" else None),
            "source": meta.get("source"),
            "created_at": tup.checkpoint.get("ts"),
            "changes": changes,
        })
        previous = values
    return items


_ABSENT = object()


def path_of(items: list[dict[str, Any]], next_nodes: Iterable[str] = ()) -> list[str]:
    """The nodes the run went through, in order, from its timeline (start and end included)."""
    path: list[str] = []
    for item in items:
        if item.get("source") == "input":
            path.append("__start__")
            continue
        for node in (item.get("node") or "").split(","):
            if node and node != "input" and (not path or path[-1] != node):
                path.append(node)
    if items and not list(next_nodes) and items[-1].get("source") == "loop":
        path.append("__end__")
    if path and path[0] != "__start__" and items and items[0].get("source") == "input":
        path.insert(0, "__start__")
    return path


# ---------------------------------------------------------------- LLM calls
def _pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text: the growth of the decoded prefix (so multi-byte characters land whole)."""
    if tokenizer is None:
        return [f"[{t}]" for t in ids]
    if len(ids) > 1024:
        return [tokenizer.decode([t]) for t in ids]
    out, prev = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1])
        out.append(text[len(prev):] if text.startswith(prev) else tokenizer.decode([ids[i]]))
        prev = text
    return out


def llm_calls(entries: list[Any], stored_calls: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """The run's calls: prompt text, and the answer as (text, depth) tokens from the acceptance log.

    A call's ``call`` entry commits its first token (the prefill: depth 0); each verification step
    commits its accepted drafts (depth 1, 2, ...) then the base model's own token (depth 0).
    """
    calls: list[dict[str, Any]] = []
    by_key: dict[tuple[str, int | None], dict[str, Any]] = {}
    for e in entries:
        key = (e.node_id, e.call_index)
        if e.kind == "call":
            call = {
                "node": e.node_id,
                "call": e.call_index,
                "seed": e.call_seed,
                "temperature": e.temperature,
                "mode": e.record.mode,
                "token_ids": list(e.tokens or ()),
                "prompt_ids": list(e.prompt) if e.prompt is not None else None,
                "depths": [0 for _ in e.record.tokens],
                "steps": 0,
            }
            by_key[key] = call
            calls.append(call)
        elif key in by_key:
            call = by_key[key]
            rec = e.record
            n = len(rec.tokens)
            call["depths"] += [min(j + 1, MAX_DEPTH_CLASS) if j < n - 1 else 0 for j in range(n)]
            call["steps"] += 1
    stored = {(c.get("node"), c.get("call")): c for c in stored_calls}
    for call in calls:
        ids = call["token_ids"]
        depths = call["depths"][: len(ids)] + [None] * max(0, len(ids) - len(call["depths"]))
        pieces = _pieces(tokenizer, ids)
        call["tokens"] = [{"text": t, "depth": d, "id": i} for t, d, i in zip(pieces, depths, ids)]
        call["accepted_drafts"] = sum(1 for d in depths if d)
        call["tau"] = (len(ids) - 1) / call["steps"] if call["steps"] else None
        if call["prompt_ids"] is not None and tokenizer is not None:
            call["prompt"] = tokenizer.decode(call["prompt_ids"])
        else:
            call["prompt"] = None
        rec = stored.get((call["node"], call["call"])) or {}
        call["text"] = rec.get("text")
        call["finish_reason"] = rec.get("finish_reason")
        call["prompt_sha256"] = rec.get("prompt_sha256")
    # Calls recorded on the run but absent from the log (trimmed log): shown without shading.
    logged = {(c["node"], c["call"]) for c in calls}
    for c in stored_calls:
        if (c.get("node"), c.get("call")) not in logged:
            calls.append({
                "node": c.get("node"), "call": c.get("call"), "seed": c.get("seed"), "temperature": None,
                "mode": c.get("mode"), "prompt": None, "text": c.get("text"), "steps": c.get("steps"),
                "tokens": [{"text": t, "depth": None, "id": i} for t, i in
                           zip(_pieces(tokenizer, c.get("token_ids", [])), c.get("token_ids", []))],
                "accepted_drafts": c.get("accepted"), "tau": None, "finish_reason": c.get("finish_reason"),
                "prompt_sha256": c.get("prompt_sha256"),
            })
    return calls


def tau_per_node(log: Any, run_id: str, nodes: Iterable[str]) -> list[dict[str, Any]]:
    rows = []
    for n in sorted(set(nodes)):
        s = log.summary(run_id, n)
        rows.append({"node": n, "steps": s.steps, "tokens": s.total_tokens, "tau": s.tau,
                     "by_depth": [round(x, 2) for x in s.acceptance_by_depth]})
    return rows


def interrupt_values(snapshot: Any) -> list[Any]:
    return [jsonable(getattr(i, "value", i)) for i in getattr(snapshot, "interrupts", ())]
