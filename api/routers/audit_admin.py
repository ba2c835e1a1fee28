"""Audit administration: retention of deleted threads, purges, legal holds, the audit event stream.

All of it needs the auditor role (or admin), declared in :data:`elesium.api.auth.ROUTE_ROLES`. The
routes reach deleted threads (kept for audit) as well as live ones; another tenant's are 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from elesium.api import retention
from elesium.api.auth import Principal, principal
from elesium.api.errors import InvalidRequest
from elesium.api.routers.common import services

router = APIRouter(tags=["audit"])


class LegalHold(BaseModel):
    reason: str | None = Field(default=None, max_length=500)


@router.get("/threads/{thread_id}/retention")
def get_retention(thread_id: str, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    """Whether the thread is deleted, when its records will be purged, and its legal hold."""
    return retention.retention_json(services(request).thread_or_404(thread_id, who))


@router.post("/threads/{thread_id}/purge")
def purge_thread(thread_id: str, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    """Erase the thread (deleted or not) and every record of its runs now; 409 under a legal hold or
    while a run is in progress. Recorded in the audit event stream."""
    svc = services(request)
    row = svc.thread_or_404(thread_id, who)
    runs = retention.purge(svc, row, who.identity, reason="purged on request")
    return {"thread_id": thread_id, "purged": True, "runs": runs}


@router.put("/threads/{thread_id}/legal-hold")
def put_legal_hold(
    thread_id: str, request: Request, body: LegalHold | None = None, who: Principal = Depends(principal)
) -> dict[str, Any]:
    """Hold the thread's records: no purge, by request or by retention, until the hold is released."""
    svc = services(request)
    row = svc.thread_or_404(thread_id, who)
    retention.set_hold(svc, row, who, body.reason if body else None)
    return retention.retention_json(svc.thread_or_404(thread_id, who))


@router.delete("/threads/{thread_id}/legal-hold")
def delete_legal_hold(
    thread_id: str, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    """Release the hold: a deleted thread whose retention has ended is purged by the next sweep."""
    svc = services(request)
    row = svc.thread_or_404(thread_id, who)
    retention.release_hold(svc, row, who)
    return retention.retention_json(svc.thread_or_404(thread_id, who))


@router.get("/elesium/audit/events")
def audit_events(
    request: Request, limit: int = 100, cursor: str | None = None, who: Principal = Depends(principal)
) -> dict[str, Any]:
    """The caller's tenant's audit events (deletions, purges, legal holds), oldest first, ``limit``
    after ``cursor`` (an ``event_id``)."""
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be in [1, 1000]")
    if cursor is not None and not _is_stream_id(cursor):
        raise InvalidRequest("cursor must be an event_id such as 1700000000000-0")
    events = services(request).store.audit_events(who.tenant, after=cursor, limit=limit)
    return {"events": events, "next_cursor": events[-1]["event_id"] if len(events) == limit else None}


@router.post("/elesium/audit/purge-expired")
def purge_expired(request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    """Run the retention sweep now (the server also runs it every ``audit_sweep_interval_s``). Purges
    expired threads of every tenant (each recorded in its tenant's stream, by ``system/retention``);
    answers with the caller's tenant's purged ids only."""
    purged = retention.purge_expired(services(request))
    return {"purged": [tid for tenant, tid in purged if tenant == who.tenant]}


def _is_stream_id(text: str) -> bool:
    ms, _, seq = text.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())
