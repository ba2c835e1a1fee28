"""Helpers shared by the routers: the role check, JSON shapes of the protocol's objects, SSE framing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from elesium.api.auth import PUBLIC, Forbidden, allows_any, principal, route_role
from elesium.api.errors import NotFound
from elesium.api.events import RunChannel
from elesium.api.execution import Services, assistant_id_of, iso
from elesium.graphs.replay import jsonable
from elesium.state.threads import RunRow, ThreadRow, public_id

log = logging.getLogger("elesium.api")


def services(request: Request) -> Services:
    """The app's :class:`Services` (installed by the lifespan, one per app)."""
    return request.app.state.services


def authorize(request: Request) -> None:
    """The one role check, installed by the app on every router: the route's role from
    :data:`elesium.api.auth.ROUTE_ROLES` (a route not declared there is refused: fail closed).

    Order: 401 (no key) before anything; then, when the role is missing, the ownership of the ids in
    the path (404 exactly as the route would answer for another tenant's or a missing object), and
    only then 403 naming the role, so a 403 never concerns another tenant's object. Auditor routes,
    and GET routes called with an auditor key (not admin or full access: those read as normal
    callers), get the audit view: deleted threads kept for audit are readable.
    """
    route = request.scope.get("route")
    path = getattr(route, "path", None) or request.url.path
    need = route_role(request.method, path)
    if need == PUBLIC:
        return
    who = principal(request)
    if need is None:
        raise Forbidden(f"{request.method} {path} declares no role requirement; refused")
    if not allows_any(who, need):
        _owned_or_404(request, who)
        roles = " or ".join(repr(r) for r in need.split("|"))
        raise Forbidden(f"{request.method} {path} needs the {roles} role; this API key has "
                        f"{', '.join(sorted(who.roles)) or 'no roles'}")
    explicit_auditor = "auditor" in who.roles and "admin" not in who.roles
    if need == "auditor" or (explicit_auditor and request.method == "GET"):
        request.state.principal = dataclasses.replace(who, audit_view=True)


def _owned_or_404(request: Request, who: Any) -> None:
    """404 when the path names a thread (or a run of it) the caller's tenant does not have (deleted
    threads kept for audit count as the tenant's)."""
    params = request.path_params
    if "thread_id" not in params:
        return
    store = services(request).store
    thread = store.get_thread(params["thread_id"], who.tenant)
    if thread is None:
        raise NotFound.of("thread", params["thread_id"])
    if "run_id" in params and store.get_run(params["run_id"], who.tenant, thread.thread_id) is None:
        raise NotFound.of("run", params["run_id"])


def detach(fn: Callable[..., Any], *args: Any) -> None:
    """Run blocking ``fn(*args)`` in the loop's executor without awaiting it.

    For cleanup in an async generator's ``finally`` (a client that left): an ``await`` there may be
    cancelled before it runs, and a direct call would block the event loop on Redis. A failure is
    logged, as it would otherwise surface nowhere.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # finalized outside the loop: nothing to block
        fn(*args)
        return
    future = loop.run_in_executor(None, fn, *args)

    def report(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.warning("%s%r failed after the client left", getattr(fn, "__name__", fn), args,
                        exc_info=done.exception())

    future.add_done_callback(report)


def assistant_json(wf: Any) -> dict[str, Any]:
    return {
        "assistant_id": assistant_id_of(wf),
        "graph_id": wf.name,
        "name": wf.name,
        "version": 1,
        "description": getattr(wf, "description", None) or None,
        "config": {},
        "context": {},
        "metadata": {"workflow_version": wf.version, "label": getattr(wf, "label", None)},
        "created_at": "1970-01-01T00:00:00+00:00",
        "updated_at": "1970-01-01T00:00:00+00:00",
    }


def thread_json(row: ThreadRow, values: Any = None,
                interrupts: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """A thread as the protocol shows it; ``interrupts`` maps a task id to the interrupts it raised."""
    return {
        "thread_id": public_id(row.thread_id),
        "created_at": iso(row.created_ms),
        "updated_at": iso(row.updated_ms),
        "metadata": row.metadata,
        "status": row.status,
        "values": values if values is not None else {},
        "interrupts": interrupts or {},
    }


def run_json(row: RunRow) -> dict[str, Any]:
    return {
        "run_id": row.run_id,
        "thread_id": public_id(row.thread_id),
        "assistant_id": row.assistant_id,
        "created_at": iso(row.created_ms),
        "updated_at": iso(row.updated_ms),
        "status": row.status,
        "metadata": row.metadata,
        "multitask_strategy": "reject",
        "kwargs": row.request,
        "workflow": row.workflow,
        "workflow_version": row.workflow_version,
        "seed": row.seed,
        "approver": row.approver,
        "error": row.error,
    }


def checkpoint_json(config: dict[str, Any] | None, thread_id: str) -> dict[str, Any] | None:
    if not config:
        return None
    cp = config.get("configurable", {})
    return {
        "thread_id": thread_id,
        "checkpoint_ns": cp.get("checkpoint_ns", ""),
        "checkpoint_id": cp.get("checkpoint_id"),
        "checkpoint_map": None,
    }


def state_json(snapshot: Any, thread_id: str) -> dict[str, Any]:
    """A LangGraph StateSnapshot as the protocol's ThreadState."""
    tasks = [
        {
            "id": t.id,
            "name": t.name,
            "error": str(t.error) if t.error else None,
            "interrupts": [jsonable(i) for i in t.interrupts],
            "checkpoint": None,
            "state": None,
            "result": jsonable(getattr(t, "result", None)),
        }
        for t in snapshot.tasks
    ]
    return {
        "values": jsonable(snapshot.values),
        "next": list(snapshot.next),
        "checkpoint": checkpoint_json(snapshot.config, thread_id),
        "metadata": jsonable(snapshot.metadata or {}),
        "created_at": snapshot.created_at,
        "parent_checkpoint": checkpoint_json(snapshot.parent_config, thread_id),
        "tasks": tasks,
        "interrupts": [jsonable(i) for i in getattr(snapshot, "interrupts", ())],
    }


def empty_state(thread_id: str) -> dict[str, Any]:
    return {
        "values": {},
        "next": [],
        "checkpoint": None,
        "metadata": {},
        "created_at": None,
        "parent_checkpoint": None,
        "tasks": [],
        "interrupts": [],
    }


def sse_frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


async def until_disconnect(request: Request) -> None:
    """Return when the client of a request whose body has been read goes away.

    For a non-streaming answer computed at length (a chat completion): awaited beside the work, it
    wakes the moment the server sees the connection close. Cancel it once the answer is ready.
    """
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def follow_until_disconnect(
    request: Request, channel: RunChannel, *, on_disconnect: Any = None
) -> AsyncIterator[tuple[str, Any]]:
    """The channel's events; stops (and calls ``on_disconnect``) when the client goes away.

    Polls for the disconnect every 0.2 s while no event arrives, so a client that leaves during a long
    generation frees the engine within a fraction of a second, not at the next event.
    """
    agen = channel.follow()
    pending: asyncio.Future[tuple[str, Any]] | None = None
    finished = False
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(agen.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=0.2)
            if not done:
                if await request.is_disconnected():
                    return
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                finished = True
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        if not finished and on_disconnect is not None and not channel.closed:
            on_disconnect()
