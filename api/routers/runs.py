"""Runs: background, wait and SSE stream; get, list, join, cancel, delete (threaded and stateless).

Every Redis read or write runs off the event loop: routes that only answer once the call returns are
plain ``def`` (FastAPI runs them in its thread pool); those that must await a run's end or stream it
do their Redis work through ``run_in_threadpool`` and await only the run's channel.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from elesium.api.auth import Principal, principal
from elesium.api.errors import Conflict, InvalidRequest, NotFound
from elesium.api.events import RunChannel
from elesium.api.execution import Services
from elesium.api.routers.common import (
    detach,
    follow_until_disconnect,
    run_json,
    services,
    sse_frame,
    until_disconnect,
)
from elesium.api.schemas import RunCreate
from elesium.graphs.replay import jsonable
from elesium.state.threads import RunRow, ThreadRow, public_id

router = APIRouter(tags=["runs"])


IDEMPOTENCY_NS = uuid.UUID("3b6f0f0e-8d1c-4c8e-9a4e-6f2d51c9e7a1")


def _idempotency(
    request: Request, who: Principal, thread_id: str | None, body: RunCreate
) -> tuple[str, str] | None:
    """(run id, request digest) of a request with an ``Idempotency-Key`` header, else None.

    The run id is derived from (tenant, key), so a retry, or the same request sent twice at once to
    one server or to several, names one run; the digest tells a retry from a different request that
    reuses the key (409).
    """
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 0 < len(key) <= 200 or not key.isprintable():
        raise InvalidRequest("Idempotency-Key must be 1-200 printable characters")
    sent = {"thread_id": thread_id, **body.model_dump(mode="json", exclude_none=True)}
    digest = hashlib.sha256(json.dumps(sent, sort_keys=True, default=str).encode()).hexdigest()
    return uuid.uuid5(IDEMPOTENCY_NS, f"{who.tenant}\x1f{key}").hex, digest


IDEMPOTENT_CLAIM_WAIT_S = 5.0
"""How long a request that lost the thread to a twin with the same Idempotency-Key waits for the twin's
run row (written just after its claim) before answering 409."""


def _replayed(svc: Services, who: Principal, idem: tuple[str, str]) -> tuple[RunRow, RunChannel] | None:
    """The run an earlier request with this idempotency key created (None if none); 409 if that
    request was a different one."""
    existing = svc.store.get_run(idem[0], who.tenant)
    if existing is None:
        return None
    if existing.idempotency != idem[1]:
        raise Conflict(
            "Idempotency-Key was already used for a different request; use a new key for a new run"
        )
    return existing, svc.channel_or_none(existing) or _ended_channel(existing)


def _create(
    svc: Services, who: Principal, thread_id: str | None, body: RunCreate, request: Request
) -> tuple[RunRow, RunChannel]:
    """Validate, record and enqueue the run (or find the one its idempotency key names). Blocking."""
    idem = _idempotency(request, who, thread_id, body)
    if idem is not None and (done := _replayed(svc, who, idem)) is not None:
        return done
    try:
        return _create_new(svc, who, thread_id, body, idem)
    except Conflict:
        # The same key sent at the same moment (to this server's thread pool or another server): the
        # request that claimed the thread writes the run's row right after, and that run is this one.
        if idem is not None:
            deadline = time.monotonic() + IDEMPOTENT_CLAIM_WAIT_S
            while True:
                if (done := _replayed(svc, who, idem)) is not None:
                    return done
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        raise


def _create_new(svc: Services, who: Principal, thread_id: str | None, body: RunCreate,
                idem: tuple[str, str] | None) -> tuple[RunRow, RunChannel]:
    if thread_id is None:  # stateless: validate against a thread that exists only once the run is valid
        tid = uuid.uuid5(IDEMPOTENCY_NS, f"thread\x1f{idem[0]}").hex if idem else str(uuid.uuid4())
        thread = ThreadRow(thread_id=tid, tenant=who.tenant, metadata={"stateless": True})
        wf, row = svc.prepare_run(who, thread, body)
        svc.create_thread(who, thread.thread_id, thread.metadata, if_exists="do_nothing" if idem else None)
    else:
        thread = svc.get_thread(thread_id, who.tenant)
        if thread is None:
            if body.if_not_exists != "create":
                raise NotFound.of("thread", thread_id)
            thread = svc.create_thread(who, thread_id, if_exists="do_nothing")
        wf, row = svc.prepare_run(who, thread, body)
    if idem is not None:
        row = row.model_copy(update={"run_id": idem[0], "idempotency": idem[1]})
    return row, svc.start_run(wf, row)


def _location(row: RunRow) -> dict[str, str]:
    """Where the run can be read back (langgraph-sdk takes the run id from it on ``wait``)."""
    return {"Content-Location": f"/threads/{public_id(row.thread_id)}/runs/{row.run_id}"}


async def _final(svc: Services, row: RunRow, channel: RunChannel | None) -> Any:
    """The run's result once it has ended, read in the thread pool (waiting on the channel is async)."""
    if channel is not None:
        await channel.wait_closed()
    return await run_in_threadpool(_final_values, svc, row)


def _final_values(svc: Services, row: RunRow) -> Any:
    """The ended run's result as ``wait``/``join`` return it: the thread's values (with ``__interrupt__``)."""
    fresh = svc.store.get_run(row.run_id, row.tenant) or row
    if fresh.status == "error":
        return {"__error__": {"error": (fresh.error or "error").split(":")[0], "message": fresh.error}}
    thread = svc.store.get_thread(row.thread_id, row.tenant)
    graph = svc.thread_graph(thread) if thread else None
    if graph is None:
        return {}
    snap = graph.get_state({"configurable": {"thread_id": row.thread_id}})
    values = jsonable(snap.values)
    interrupts = [jsonable(i) for i in getattr(snap, "interrupts", ())]
    if interrupts and isinstance(values, dict):
        values["__interrupt__"] = interrupts
    return values


def _sse(
    request: Request,
    svc: Services,
    row: RunRow,
    channel: RunChannel,
    *,
    cancel_on_disconnect: bool,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """The run's events as SSE; a client that leaves cancels the run unless it asked to continue."""

    async def body() -> AsyncIterator[bytes]:
        # The cancel writes to Redis: detached to a thread, the generator's cleanup never blocks the loop.
        on_disconnect = (lambda: detach(svc.cancel, row.run_id)) if cancel_on_disconnect else None
        async for event, data in follow_until_disconnect(request, channel, on_disconnect=on_disconnect):
            yield sse_frame(event, data)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-store", **(headers or {})}
    )


# ---------------------------------------------------------------- threaded and stateless creation
@router.post("/threads/{thread_id}/runs")
def create_run(
    thread_id: str, body: RunCreate, request: Request, response: Response, who: Principal = Depends(principal)
) -> dict[str, Any]:
    row, _ = _create(services(request), who, thread_id, body, request)
    response.headers.update(_location(row))
    return run_json(row)


@router.post("/runs")
def create_stateless_run(
    body: RunCreate, request: Request, response: Response, who: Principal = Depends(principal)
) -> dict[str, Any]:
    row, _ = _create(services(request), who, None, body, request)
    response.headers.update(_location(row))
    return run_json(row)


async def _wait(request: Request, svc: Services, row: RunRow, channel: RunChannel | None,
                body: RunCreate) -> Response:
    """The ``wait`` answer. The run goes on when the client leaves (``on_disconnect`` "continue", the
    default for ``wait``: its result stays readable by ``join``), unless the request asked for
    "cancel": then the run is cancelled at once, as a stream's is, and frees the engine."""
    if channel is not None and body.on_disconnect == "cancel":
        ended = asyncio.ensure_future(channel.wait_closed())
        left = asyncio.ensure_future(until_disconnect(request))
        try:
            done, _ = await asyncio.wait({ended, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not ended.done():
                ended.cancel()
        if ended not in done:
            detach(svc.cancel, row.run_id)  # Redis: off the loop
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    return JSONResponse(jsonable(await _final(svc, row, channel)), headers=_location(row))


@router.post("/threads/{thread_id}/runs/wait")
async def wait_run(
    thread_id: str, body: RunCreate, request: Request, who: Principal = Depends(principal)
) -> Any:
    svc = services(request)
    row, channel = await run_in_threadpool(_create, svc, who, thread_id, body, request)
    return await _wait(request, svc, row, channel, body)


@router.post("/runs/wait")
async def wait_stateless_run(body: RunCreate, request: Request, who: Principal = Depends(principal)) -> Any:
    svc = services(request)
    row, channel = await run_in_threadpool(_create, svc, who, None, body, request)
    return await _wait(request, svc, row, channel, body)


def _stream_new(
    request: Request, who: Principal, thread_id: str | None, body: RunCreate
) -> StreamingResponse:
    """Create a run (on a thread, or stateless) and answer with its SSE stream. Blocking until created."""
    svc = services(request)
    row, channel = _create(svc, who, thread_id, body, request)
    return _sse(
        request,
        svc,
        row,
        channel,
        cancel_on_disconnect=body.on_disconnect != "continue",
        headers=_location(row),
    )


@router.post("/threads/{thread_id}/runs/stream")
def stream_run(
    thread_id: str, body: RunCreate, request: Request, who: Principal = Depends(principal)
) -> StreamingResponse:
    return _stream_new(request, who, thread_id, body)


@router.post("/runs/stream")
def stream_stateless_run(
    body: RunCreate, request: Request, who: Principal = Depends(principal)
) -> StreamingResponse:
    return _stream_new(request, who, None, body)


# ---------------------------------------------------------------- existing runs
def _ended_channel(row: RunRow) -> RunChannel:
    """A closed channel holding only the run's metadata: what is left to stream of a run that ended
    in an earlier process (or long enough ago that this server forgot its events)."""
    channel = RunChannel()
    channel.publish("metadata", {"run_id": row.run_id, "thread_id": public_id(row.thread_id)})
    channel.close()
    return channel


def _existing(svc: Services, who: Principal, thread_id: str, run_id: str) -> tuple[RunRow, RunChannel | None]:
    """The caller's run and this server's channel of it (None if its events expired). Blocking."""
    row = svc.run_or_404(thread_id, run_id, who)
    return row, svc.channel_or_none(row)


@router.get("/threads/{thread_id}/runs")
def list_runs(
    thread_id: str,
    request: Request,
    limit: int = 10,
    offset: int = 0,
    status: str | None = None,
    who: Principal = Depends(principal),
) -> list[dict[str, Any]]:
    svc = services(request)
    thread = svc.thread_or_404(thread_id, who)
    if limit < 0 or offset < 0:
        raise InvalidRequest("limit and offset must be >= 0")
    return [
        run_json(r)
        for r in svc.store.list_runs(
            thread.thread_id, who.tenant, limit=min(limit, 1000), offset=offset, status=status
        )
    ]


@router.get("/threads/{thread_id}/runs/{run_id}")
def get_run(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    return run_json(services(request).run_or_404(thread_id, run_id, who))


@router.get("/threads/{thread_id}/runs/{run_id}/join")
async def join_run(thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)) -> Any:
    svc = services(request)
    row, channel = await run_in_threadpool(_existing, svc, who, thread_id, run_id)
    return JSONResponse(jsonable(await _final(svc, row, channel)))


@router.get("/threads/{thread_id}/runs/{run_id}/stream")
def join_stream(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> StreamingResponse:
    svc = services(request)
    row, channel = _existing(svc, who, thread_id, run_id)
    return _sse(request, svc, row, channel or _ended_channel(row), cancel_on_disconnect=False)


@router.post("/threads/{thread_id}/runs/{run_id}/cancel")
async def cancel_run(
    thread_id: str,
    run_id: str,
    request: Request,
    wait: bool = False,
    action: str = "interrupt",
    who: Principal = Depends(principal),
) -> Any:
    svc = services(request)

    def ask() -> tuple[RunRow, RunChannel | None]:
        row = svc.run_or_404(thread_id, run_id, who)
        if action not in ("interrupt", "rollback"):
            raise InvalidRequest("action must be interrupt or rollback")
        if row.status not in ("pending", "running"):
            raise Conflict(f"run {run_id!r} is {row.status}; nothing to cancel")
        svc.cancel(run_id)
        return row, svc.channel_or_none(row)

    row, channel = await run_in_threadpool(ask)
    if wait and channel is not None:
        await channel.wait_closed()
        fresh = await run_in_threadpool(svc.store.get_run, run_id, who.tenant)
        return JSONResponse(run_json(fresh or row))
    return Response(status_code=202)


@router.delete("/threads/{thread_id}/runs/{run_id}", status_code=204)
def delete_run(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> Response:
    """Delete a finished run: marked deleted and its records kept for audit (retention), or erased
    now when ``audit_retention_days`` is 0 (:func:`elesium.api.retention.delete_run`)."""
    from elesium.api import retention

    svc = services(request)
    row = svc.run_or_404(thread_id, run_id, who)
    if row.status in ("pending", "running"):
        raise Conflict(f"run {run_id!r} is {row.status}; cancel it first")
    retention.delete_run(svc, row, who)
    return Response(status_code=204)
