"""Elesium's own routes: the acceptance log of a run, audit replays, and who the caller is."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from elesium.api.auth import Principal, principal
from elesium.api.errors import InvalidRequest
from elesium.api.routers.common import services
from elesium.api.schemas import ReplayRequest
from elesium.graphs import replay as rp
from elesium.graphs.audit_chain import verify_run

router = APIRouter(tags=["elesium"])


@router.get("/elesium/whoami")
def whoami(request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    """The caller's tenant and key id (what approvals and replays are recorded under)."""
    return {"tenant": who.tenant, "key_id": who.key_id, "identity": who.identity}


@router.get("/threads/{thread_id}/runs/{run_id}/acceptance")
def acceptance(
    thread_id: str,
    run_id: str,
    request: Request,
    limit: int = 100,
    cursor: str | None = None,
    who: Principal = Depends(principal),
) -> dict[str, Any]:
    """The run's raw acceptance log, ``limit`` entries after ``cursor`` (a stream id), and its summary."""
    svc = services(request)
    svc.run_or_404(thread_id, run_id, who)
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be in [1, 1000]")
    if cursor is not None and not _is_stream_id(cursor):
        raise InvalidRequest("cursor must be a stream id such as 1700000000000-0")
    log = svc.acceptance
    entries = log.read(run_id, start=f"({cursor}" if cursor else "-", count=limit)
    summary = log.summary(run_id)
    nodes = sorted({c["node"] for c in svc.store.calls(run_id)} | {e.node_id for e in entries})
    return {
        "run_id": run_id,
        "thread_id": thread_id,
        "entries": [e.model_dump(mode="json") for e in entries],
        "next_cursor": entries[-1].entry_id if len(entries) == limit else None,
        "summary": summary.model_dump(mode="json"),
        "per_node": {n: log.summary(run_id, n).model_dump(mode="json") for n in nodes},
        "calls": [
            {k: c[k] for k in ("node", "call", "seed", "mode", "finish_reason", "steps", "accepted")}
            | {"tokens": len(c["token_ids"])}
            for c in svc.store.calls(run_id)
        ],
    }


def _is_stream_id(text: str) -> bool:
    """``<ms>`` or ``<ms>-<seq>``: checked here so a malformed cursor is a 422, not a Redis error."""
    ms, _, seq = text.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())


@router.post("/threads/{thread_id}/runs/{run_id}/replay")
async def replay(
    thread_id: str, run_id: str, body: ReplayRequest, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    """Re-execute (or re-run on recorded outputs) the run and its thread's earlier operations.

    The report (verdict, first divergence, who, when, fingerprints) is stored beside the run. A run
    that cannot be replayed answers 409 (``ReplayRefused``, mapped in :mod:`elesium.api.errors`).
    """
    svc = services(request)
    await run_in_threadpool(svc.run_or_404, thread_id, run_id, who)

    def work() -> rp.ReplayReport:
        return rp.replay_stored_run(
            store=svc.store,
            registry=svc.registry,
            engine=svc.engine,
            saver=svc.saver,
            run_id=run_id,
            mode=body.mode,
            by=who.identity,
            tenant=who.tenant,
            fingerprint=svc.fingerprint,
            runs_registry=svc.runs_registry,
            calibrations=svc.calibrator.store if svc.calibrator is not None else None,
        )

    report = await svc.worker.run(work)
    return {**report.model_dump(mode="json"), "thread_id": thread_id}  # the id the caller knows


@router.get("/threads/{thread_id}/runs/{run_id}/replays")
def list_replays(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> list[dict[str, Any]]:
    svc = services(request)
    svc.run_or_404(thread_id, run_id, who)
    return [{**r, "thread_id": thread_id} if "thread_id" in r else r for r in svc.store.replays(run_id)]


@router.get("/threads/{thread_id}/runs/{run_id}/audit")
def audit(
    thread_id: str, run_id: str, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    """Verify the run's hash chain: every record re-read and re-hashed, the links, the seal and its
    signature (``ok``, ``first_bad``: the first entry, record or seal that does not verify)."""
    svc = services(request)
    svc.run_or_404(thread_id, run_id, who)
    verdict = verify_run(svc.store.client, run_id, store=svc.store, cp_prefix=svc.saver.prefix,
                         acceptance=svc.acceptance)
    return {**verdict.model_dump(mode="json"), "thread_id": thread_id}  # the id the caller knows
