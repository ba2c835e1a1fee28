"""Runs: background, wait and SSE stream; get, list, join, cancel, delete (threaded and stateless)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from elesium.api.auth import Principal, principal
from elesium.api.events import RunChannel
from elesium.api.execution import Services
from elesium.api.routers.common import follow_until_disconnect, run_json, services, sse_frame
from elesium.api.schemas import RunCreate
from elesium.graphs.replay import jsonable
from elesium.state.threads import RunRow, ThreadRow

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
        raise HTTPException(status_code=422, detail="Idempotency-Key must be 1-200 printable characters")
    sent = {"thread_id": thread_id, **body.model_dump(mode="json", exclude_none=True)}
    digest = hashlib.sha256(json.dumps(sent, sort_keys=True, default=str).encode()).hexdigest()
    return uuid.uuid5(IDEMPOTENCY_NS, f"{who.tenant}\x1f{key}").hex, digest


def _replayed(svc: Services, who: Principal, idem: tuple[str, str]) -> tuple[RunRow, RunChannel] | None:
    """The run an earlier request with this idempotency key created (None if none); 409 if that
    request was a different one."""
    existing = svc.store.get_run(idem[0], who.tenant)
    if existing is None:
        return None
    if existing.idempotency != idem[1]:
        raise HTTPException(
            status_code=409,
            detail="Idempotency-Key was already used for a different request; use a new key for a new run",
        )
    channel = svc.channel_or_none(existing)
    if channel is None:  # ended and forgotten here: its end is all there is left to stream
        channel = RunChannel()
        channel.publish("metadata", {"run_id": existing.run_id, "thread_id": existing.thread_id})
        channel.close()
    return existing, channel


def _create(
    svc: Services, who: Principal, thread_id: str | None, body: RunCreate, request: Request
) -> tuple[RunRow, RunChannel]:
    idem = _idempotency(request, who, thread_id, body)
    if idem is not None and (done := _replayed(svc, who, idem)) is not None:
        return done
    if thread_id is None:  # stateless: validate against a thread that exists only once the run is valid
        tid = uuid.uuid5(IDEMPOTENCY_NS, f"thread\x1f{idem[0]}").hex if idem else str(uuid.uuid4())
        thread = ThreadRow(thread_id=tid, tenant=who.tenant, metadata={"stateless": True})
        wf, row = svc.prepare_run(who, thread, body)
        svc.create_thread(who, thread.thread_id, thread.metadata, if_exists="do_nothing" if idem else None)
    else:
        thread = svc.get_thread(thread_id, who.tenant)
        if thread is None:
            if body.if_not_exists != "create":
                raise HTTPException(status_code=404, detail=f"thread {thread_id!r} not found")
            thread = svc.create_thread(who, thread_id, if_exists="do_nothing")
        wf, row = svc.prepare_run(who, thread, body)
    if idem is not None:
        row = row.model_copy(update={"run_id": idem[0], "idempotency": idem[1]})
    try:
        return row, svc.start_run(wf, row)
    except HTTPException as exc:
        # The same key sent to another server at the same moment: that server's run is this one.
        if exc.status_code == 409 and idem is not None and (done := _replayed(svc, who, idem)) is not None:
            return done
        raise


def _location(row: RunRow) -> dict[str, str]:
    return {"Content-Location": f"/threads/{row.thread_id}/runs/{row.run_id}"}


async def _final(svc: Services, row: RunRow, channel: RunChannel | None) -> Any:
    """The run's result as ``wait``/``join`` return it: the thread's values (with ``__interrupt__``)."""
    if channel is not None:
        await channel.wait_closed()
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
    async def body() -> AsyncIterator[bytes]:
        on_disconnect = (lambda: svc.cancel(row.run_id)) if cancel_on_disconnect else None
        async for event, data in follow_until_disconnect(request, channel, on_disconnect=on_disconnect):
            yield sse_frame(event, data)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-store", **(headers or {})}
    )


# ---------------------------------------------------------------- threaded and stateless creation
@router.post("/threads/{thread_id}/runs")
async def create_run(
    thread_id: str, body: RunCreate, request: Request, response: Response, who: Principal = Depends(principal)
) -> dict[str, Any]:
    row, _ = _create(services(request), who, thread_id, body, request)
    response.headers.update(_location(row))
    return run_json(row)


@router.post("/runs")
async def create_stateless_run(
    body: RunCreate, request: Request, response: Response, who: Principal = Depends(principal)
) -> dict[str, Any]:
    row, _ = _create(services(request), who, None, body, request)
    response.headers.update(_location(row))
    return run_json(row)


@router.post("/threads/{thread_id}/runs/wait")
async def wait_run(
    thread_id: str, body: RunCreate, request: Request, who: Principal = Depends(principal)
) -> Any:
    svc = services(request)
    row, channel = _create(svc, who, thread_id, body, request)
    return JSONResponse(jsonable(await _final(svc, row, channel)), headers=_location(row))


@router.post("/runs/wait")
async def wait_stateless_run(body: RunCreate, request: Request, who: Principal = Depends(principal)) -> Any:
    svc = services(request)
    row, channel = _create(svc, who, None, body, request)
    return JSONResponse(jsonable(await _final(svc, row, channel)), headers=_location(row))


def _stream_new(
    request: Request, who: Principal, thread_id: str | None, body: RunCreate
) -> StreamingResponse:
    """Create a run (on a thread, or stateless) and answer with its SSE stream."""
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
async def stream_run(
    thread_id: str, body: RunCreate, request: Request, who: Principal = Depends(principal)
) -> StreamingResponse:
    return _stream_new(request, who, thread_id, body)


@router.post("/runs/stream")
async def stream_stateless_run(
    body: RunCreate, request: Request, who: Principal = Depends(principal)
) -> StreamingResponse:
    return _stream_new(request, who, None, body)


# ---------------------------------------------------------------- existing runs
def _run_or_404(svc: Services, who: Principal, thread_id: str, run_id: str) -> RunRow:
    svc.thread_or_404(thread_id, who)
    row = svc.store.get_run(run_id, who.tenant, thread_id)
    if row is None:
        raise HTTPException(status_code=404, detail=f"run {run_id!r} not found")
    return row


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
    svc.thread_or_404(thread_id, who)
    if limit < 0 or offset < 0:
        raise HTTPException(status_code=422, detail="limit and offset must be >= 0")
    return [
        run_json(r)
        for r in svc.store.list_runs(
            thread_id, who.tenant, limit=min(limit, 1000), offset=offset, status=status
        )
    ]


@router.get("/threads/{thread_id}/runs/{run_id}")
def get_run(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    return run_json(_run_or_404(services(request), who, thread_id, run_id))


@router.get("/threads/{thread_id}/runs/{run_id}/join")
async def join_run(thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)) -> Any:
    svc = services(request)
    row = _run_or_404(svc, who, thread_id, run_id)
    return JSONResponse(jsonable(await _final(svc, row, svc.channel_or_none(row))))


@router.get("/threads/{thread_id}/runs/{run_id}/stream")
async def join_stream(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> StreamingResponse:
    svc = services(request)
    row = _run_or_404(svc, who, thread_id, run_id)
    channel = svc.channel_or_none(row)
    if channel is None:  # finished in an earlier process: nothing left to stream but its end
        channel = RunChannel()
        channel.publish("metadata", {"run_id": run_id, "thread_id": thread_id})
        channel.close()
    return _sse(request, svc, row, channel, cancel_on_disconnect=False)


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
    row = _run_or_404(svc, who, thread_id, run_id)
    if action not in ("interrupt", "rollback"):
        raise HTTPException(status_code=422, detail="action must be interrupt or rollback")
    if row.status not in ("pending", "running"):
        raise HTTPException(status_code=409, detail=f"run {run_id!r} is {row.status}; nothing to cancel")
    svc.cancel(run_id)
    channel = svc.channel_or_none(row)
    if wait and channel is not None:
        await channel.wait_closed()
        return JSONResponse(run_json(svc.store.get_run(run_id, who.tenant) or row))
    return Response(status_code=202)


@router.delete("/threads/{thread_id}/runs/{run_id}", status_code=204)
def delete_run(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> Response:
    svc = services(request)
    row = _run_or_404(svc, who, thread_id, run_id)
    if row.status in ("pending", "running"):
        raise HTTPException(status_code=409, detail=f"run {run_id!r} is {row.status}; cancel it first")
    svc.store.delete_run(run_id, thread_id)
    return Response(status_code=204)
