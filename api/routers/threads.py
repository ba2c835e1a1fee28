"""Threads: create, get, search, patch, delete; state, state updates, history."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from elesium.api import retention
from elesium.api.auth import Principal, principal
from elesium.api.errors import Conflict, InvalidRequest, NotFound
from elesium.api.routers.common import empty_state, services, state_json, thread_json
from elesium.api.schemas import (
    HistoryRequest,
    StateCheckpointRequest,
    StateUpdate,
    ThreadCreate,
    ThreadPatch,
    ThreadSearch,
)
from elesium.graphs.replay import jsonable
from elesium.state.errors import StateError
from elesium.state.threads import public_id

router = APIRouter(tags=["threads"])


def _values(request: Request, row: Any) -> tuple[Any, dict[str, list[Any]]]:
    """The thread's current values and pending interrupts by the id of the task that raised them, as
    the Platform's ``Thread.interrupts`` (empty before its first run)."""
    graph = services(request).thread_graph(row)
    if graph is None:
        return {}, {}
    snap = graph.get_state({"configurable": {"thread_id": row.thread_id}})
    interrupts = {t.id: [jsonable(i) for i in t.interrupts] for t in snap.tasks if t.interrupts}
    return jsonable(snap.values), interrupts


@router.post("/threads")
def create_thread(
    body: ThreadCreate, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    row = services(request).create_thread(who, body.thread_id, body.metadata, body.if_exists)
    return thread_json(row)


@router.post("/threads/search")
def search_threads(
    body: ThreadSearch, request: Request, who: Principal = Depends(principal)
) -> list[dict[str, Any]]:
    rows = services(request).store.list_threads(who.tenant, limit=10_000)
    rows = [
        r
        for r in rows
        if (body.status is None or r.status == body.status)
        and (body.ids is None or public_id(r.thread_id) in body.ids)
        and all(r.metadata.get(k) == v for k, v in (body.metadata or {}).items())
    ]
    return [thread_json(r) for r in rows[body.offset : body.offset + body.limit]]


@router.post("/threads/count")
def count_threads(body: ThreadSearch, request: Request, who: Principal = Depends(principal)) -> int:
    return len(search_threads(body.model_copy(update={"limit": 1000, "offset": 0}), request, who))


@router.get("/threads/{thread_id}")
def get_thread(thread_id: str, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    row = services(request).thread_or_404(thread_id, who)
    values, interrupts = _values(request, row)
    return thread_json(row, values, interrupts)


@router.patch("/threads/{thread_id}")
def patch_thread(
    thread_id: str, body: ThreadPatch, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    svc = services(request)
    row = svc.thread_or_404(thread_id, who)
    svc.store.update_thread(row.thread_id, metadata={**row.metadata, **(body.metadata or {})})
    return thread_json(svc.thread_or_404(thread_id, who))


@router.delete("/threads/{thread_id}", status_code=204)
def delete_thread(thread_id: str, request: Request, who: Principal = Depends(principal)) -> Response:
    """Delete the thread: it answers 404 from now on, but its records (checkpoints, runs, LLM calls,
    acceptance log, replay reports) are kept for audit for ``audit_retention_days`` and then purged
    (at once when that is 0). See :mod:`elesium.api.retention`."""
    svc = services(request)
    row = svc.thread_or_404(thread_id, who)
    if row.deleted:  # an auditor's view: already deleted
        raise NotFound.of("thread", thread_id)
    if row.status == "busy":
        raise Conflict(f"thread {thread_id!r} has a run in progress; cancel it first")
    retention.delete_thread(svc, row, who)
    return Response(status_code=204)


@router.get("/threads/{thread_id}/state")
def get_state(thread_id: str, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    row = services(request).thread_or_404(thread_id, who)
    graph = services(request).thread_graph(row)
    if graph is None:
        return empty_state(thread_id)
    return state_json(graph.get_state({"configurable": {"thread_id": row.thread_id}}), thread_id)


def _state_at(request: Request, thread_id: str, checkpoint_id: str, who: Principal) -> dict[str, Any]:
    row = services(request).thread_or_404(thread_id, who)
    graph = services(request).thread_graph(row)
    cfg = {"configurable": {"thread_id": row.thread_id, "checkpoint_ns": "", "checkpoint_id": checkpoint_id}}
    if graph is None or graph.checkpointer.get_tuple(cfg) is None:
        raise NotFound.of("checkpoint", checkpoint_id)
    return state_json(graph.get_state(cfg), thread_id)


@router.get("/threads/{thread_id}/state/{checkpoint_id}")
def get_state_at(
    thread_id: str, checkpoint_id: str, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    return _state_at(request, thread_id, checkpoint_id, who)


@router.post("/threads/{thread_id}/state/checkpoint")
def post_state_at(
    thread_id: str, body: StateCheckpointRequest, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    if not body.checkpoint.checkpoint_id:
        return get_state(thread_id, request, who)
    return _state_at(request, thread_id, body.checkpoint.checkpoint_id, who)


@router.post("/threads/{thread_id}/state")
async def update_state(
    thread_id: str, body: StateUpdate, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    """Write values as if ``as_node`` returned them (on the engine thread, in order with runs)."""
    svc = services(request)
    parent = body.checkpoint_id or (body.checkpoint.checkpoint_id if body.checkpoint else None)
    cfg: dict[str, Any] = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}

    def check() -> Any:
        row = svc.thread_or_404(thread_id, who)
        cfg["configurable"]["thread_id"] = row.thread_id  # the stored id (tenant-scoped or not)
        if row.status == "busy":
            raise Conflict(f"thread {thread_id!r} has a run in progress")
        graph = svc.thread_graph(row)
        if graph is None:
            raise Conflict(f"thread {thread_id!r} has no state yet; start a run first")
        if parent:
            cfg["configurable"]["checkpoint_id"] = parent
            if graph.checkpointer.get_tuple(cfg) is None:
                raise NotFound.of("checkpoint", parent)
        if body.as_node is not None and body.as_node not in graph.nodes:
            raise InvalidRequest(f"as_node {body.as_node!r} is not a node of this graph")
        return graph

    graph = await run_in_threadpool(check)

    def apply() -> dict[str, Any]:
        stored = cfg["configurable"]["thread_id"]
        try:
            new = graph.update_state(cfg, body.values, as_node=body.as_node)
        except (StateError, RedisError):
            raise  # Redis failed: a server error (503/409/500), not the update's fault
        except Exception as exc:  # noqa: BLE001
            # Safe: LangGraph refuses an ambiguous or invalid update (or a reducer fails on the values)
            # before it puts a checkpoint, and nothing is recorded until add_op below.
            raise InvalidRequest(f"state update rejected: {exc}") from None
        new_id = new["configurable"]["checkpoint_id"]
        svc.store.add_op(
            stored,
            {
                "kind": "update",
                "values": body.values,
                "as_node": body.as_node,
                "checkpoint_id": parent,
                "result_checkpoint": new_id,
                "by": who.identity,
            },
        )
        snap = graph.get_state({"configurable": {"thread_id": stored}})
        status = "interrupted" if getattr(snap, "interrupts", ()) else "idle"
        svc.store.update_thread(stored, status=status)
        return {
            "checkpoint": {
                "thread_id": thread_id,
                "checkpoint_ns": "",
                "checkpoint_id": new_id,
                "checkpoint_map": None,
            }
        }

    return await svc.worker.run(apply)


@router.post("/threads/{thread_id}/history")
def history(
    thread_id: str, body: HistoryRequest, request: Request, who: Principal = Depends(principal)
) -> list[dict[str, Any]]:
    row = services(request).thread_or_404(thread_id, who)
    graph = services(request).thread_graph(row)
    if graph is None:
        return []
    before = body.before
    before_id = (
        before
        if isinstance(before, str)
        else (
            before.checkpoint_id if hasattr(before, "checkpoint_id") else (before or {}).get("checkpoint_id")
        )
    )
    before_cfg = (
        {"configurable": {"thread_id": row.thread_id, "checkpoint_ns": "", "checkpoint_id": before_id}}
        if before_id
        else None
    )
    snaps = graph.get_state_history(
        {"configurable": {"thread_id": row.thread_id}},
        limit=body.limit,
        before=before_cfg,
        filter=body.metadata or None,
    )
    return [state_json(s, thread_id) for s in snaps]


@router.get("/threads/{thread_id}/history")
def history_get(
    thread_id: str, request: Request, limit: int = 10, who: Principal = Depends(principal)
) -> list[dict[str, Any]]:
    return history(thread_id, HistoryRequest(limit=max(1, min(limit, 1000))), request, who)
