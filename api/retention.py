"""Retention of deleted threads' audit records, purges, legal holds and the audit event stream.

``DELETE /threads/{id}`` marks the thread deleted (404 for every normal read, its id not reusable) and
keeps its records (checkpoints, run rows, LLM calls, acceptance log, replay reports, audit chain) for
``ApiSettings.audit_retention_days``; 0 purges them at once, as deletion did before retention.
:func:`purge` erases them (an auditor's ``POST /threads/{id}/purge``, or :func:`purge_expired` once
the retention has ended); a legal hold refuses both. Every deletion, purge and hold change is appended
to the tenant's audit event stream (``ThreadStore.add_audit_event``): who, what, when.

``DELETE /threads/{tid}/runs/{rid}`` follows the same retention for one run (:func:`delete_run`): the
run is marked deleted (404 for normal reads, readable by an auditor like a deleted thread) and its
records (row, LLM calls, replay reports, acceptance log, audit chain) stay until the retention ends,
then the sweep purges the run alone (:func:`purge_expired_runs`, part of :func:`purge_expired`); a
purge of its thread, earlier, erases it with the thread's other runs. The thread's legal hold keeps
the run too. 0 erases the run's records at once (:func:`purge_run`). Deletion and purge are recorded
(``run.deleted``, ``run.purged``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from elesium.api.auth import Principal
from elesium.api.errors import Conflict, NotFound
from elesium.api.execution import Services
from elesium.state.threads import RunRow, ThreadRow, now_ms, public_id

log = logging.getLogger("elesium.api")
DAY_MS = 86_400_000
SYSTEM = "system/retention"
"""The actor recorded for purges the retention sweep makes."""


def record(svc: Services, tenant: str, event: str, thread_id: str, by: str, **details: Any) -> None:
    svc.store.add_audit_event(
        tenant, {"event": event, "thread_id": public_id(thread_id), "by": by, "at_ms": now_ms(), **details}
    )


def delete_thread(svc: Services, row: ThreadRow, who: Principal) -> None:
    """The API's deletion: mark deleted and keep the records, or purge at once when retention is 0."""
    days = svc.settings.audit_retention_days
    if days <= 0:
        purge(svc, row, who.identity, reason="deleted (audit retention 0: no records kept)")
        return
    purge_after = now_ms() + int(days * DAY_MS)
    done = svc.store.mark_deleted(row.thread_id, row.tenant, by=who.identity, purge_after_ms=purge_after)
    if done == 0 or done == -2:
        raise NotFound.of("thread", public_id(row.thread_id))
    if done == -1:
        raise Conflict(f"thread {public_id(row.thread_id)!r} has a run in progress; cancel it first")
    record(svc, row.tenant, "thread.deleted", row.thread_id, who.identity, purge_after_ms=purge_after,
           runs=svc.store.run_ids(row.thread_id))


def purge(svc: Services, row: ThreadRow, by: str, *, reason: str) -> list[str]:
    """Erase the thread and every record of its runs; 409 on a legal hold or a run in progress."""
    tid = row.thread_id
    claimed = svc.store.claim_purge(tid)
    if claimed == 0:
        raise NotFound.of("thread", public_id(tid))
    if claimed == -1:
        raise Conflict(f"thread {public_id(tid)!r} has a run in progress; cancel it first")
    if claimed == -2:
        hold = (svc.store.thread_any(tid) or row).legal_hold or {}
        raise Conflict(
            f"thread {public_id(tid)!r} is under legal hold (set by {hold.get('by', '?')}"
            f"{': ' + hold['reason'] if hold.get('reason') else ''}); release the hold before purging"
        )
    run_ids = svc.store.run_ids(tid)
    # The run records first, the thread (and so its index entries) last: a purge that dies half-way
    # leaves the thread ``purging`` and due in the retained index, and the next sweep finishes it.
    from elesium.graphs.audit import calls_key

    for rid in run_ids:
        svc.acceptance.delete(rid)
        svc.acceptance.client.delete(calls_key(svc.acceptance, rid))
    _delete_audit_chains(svc, tid)
    svc.saver.delete_thread(tid)
    svc.store.delete_thread(tid, row.tenant)
    record(svc, row.tenant, "thread.purged", tid, by, reason=reason, runs=run_ids)
    return run_ids


def delete_run(svc: Services, run: RunRow, who: Principal) -> None:
    """The API's deletion of one finished run: mark it deleted and keep its records, or purge them at
    once when retention is 0 (409 while its thread is under legal hold)."""
    days = svc.settings.audit_retention_days
    if days <= 0:
        purge_run(svc, run, who.identity, reason="deleted (audit retention 0: no records kept)")
        return
    purge_after = now_ms() + int(days * DAY_MS)
    done = svc.store.mark_run_deleted(run.run_id, by=who.identity, purge_after_ms=purge_after)
    if done == 0 or done == -2:
        raise NotFound.of("run", run.run_id)
    if done == -1:
        raise Conflict(f"run {run.run_id!r} is in progress; cancel it first")
    record(svc, run.tenant, "run.deleted", run.thread_id, who.identity, run_id=run.run_id,
           purge_after_ms=purge_after)


def purge_run(svc: Services, run: RunRow, by: str, *, reason: str) -> None:
    """Erase one run's records (acceptance log, call set, audit chain and seal, then its row, calls and
    replays); 409 while its thread is under legal hold or the run is in progress. Its checkpoints
    belong to the thread and stay (later runs build on them)."""
    thread = svc.store.thread_any(run.thread_id)
    if thread is not None and thread.legal_hold:
        hold = thread.legal_hold
        raise Conflict(
            f"thread {public_id(run.thread_id)!r} is under legal hold (set by {hold.get('by', '?')}"
            f"{': ' + hold['reason'] if hold.get('reason') else ''}); its runs are kept until it is released"
        )
    fresh = svc.store.get_run_any(run.run_id) or run
    if fresh.status in ("pending", "running"):
        raise Conflict(f"run {run.run_id!r} is {fresh.status}; cancel it first")
    from elesium.graphs.audit import calls_key

    rid = run.run_id
    svc.acceptance.delete(rid)
    svc.acceptance.client.delete(calls_key(svc.acceptance, rid))
    _delete_audit_chain(svc, run.thread_id, rid)
    svc.store.delete_run(rid, run.thread_id)  # the row (and its retained index entry) last
    record(svc, run.tenant, "run.purged", run.thread_id, by, run_id=rid, reason=reason)


def _delete_audit_chain(svc: Services, thread_id: str, run_id: str) -> None:
    from elesium.state.audit_chain import AuditChain

    target = getattr(svc.acceptance, "_target", "the configured server")
    AuditChain(svc.acceptance.client, target=target).delete(thread_id, run_id)


def _delete_audit_chains(svc: Services, thread_id: str) -> None:
    """The thread's runs' hash-chained audit records and seals (:mod:`elesium.state.audit_chain`)."""
    try:
        from elesium.state.audit_chain import AuditChain
    except ImportError:  # an install without the audit chain
        return
    target = getattr(svc.acceptance, "_target", "the configured server")
    AuditChain(svc.acceptance.client, target=target).delete_thread(thread_id)


def set_hold(svc: Services, row: ThreadRow, who: Principal, reason: str | None) -> dict[str, Any]:
    hold = {"by": who.identity, "at_ms": now_ms(), "reason": reason}
    done = svc.store.set_legal_hold(row.thread_id, hold)
    if done == 0:
        raise NotFound.of("thread", public_id(row.thread_id))
    if done == -1:
        raise Conflict(f"thread {public_id(row.thread_id)!r} is being purged; too late for a legal hold")
    record(svc, row.tenant, "legal_hold.set", row.thread_id, who.identity, reason=reason)
    return hold


def release_hold(svc: Services, row: ThreadRow, who: Principal) -> None:
    if svc.store.set_legal_hold(row.thread_id, None) == 0:
        raise NotFound.of("thread", public_id(row.thread_id))
    record(svc, row.tenant, "legal_hold.released", row.thread_id, who.identity)


def retention_json(row: ThreadRow) -> dict[str, Any]:
    from elesium.api.execution import iso

    return {
        "thread_id": public_id(row.thread_id),
        "status": row.status,
        "deleted": row.deleted,
        "deleted_at": iso(row.deleted_ms) if row.deleted_ms is not None else None,
        "deleted_by": row.deleted_by,
        "purge_after": iso(row.purge_after_ms) if row.purge_after_ms is not None else None,
        "legal_hold": row.legal_hold,
    }


def purge_expired(svc: Services, *, now: int | None = None, limit: int = 100) -> list[tuple[str, str]]:
    """Purge every deleted thread whose retention ended by ``now`` (ms) and is not on legal hold, and
    finish purges that died half-way; then every deleted run whose retention ended
    (:func:`purge_expired_runs`). Each purge is recorded (by ``system/retention``). Returns (tenant,
    public thread id) of each thread purged. Called by the server's sweep thread and by
    ``POST /elesium/audit/purge-expired``."""
    now = now_ms() if now is None else now
    purged: list[tuple[str, str]] = []
    for tid in svc.store.retained_due(now, limit=limit):
        row = svc.store.thread_any(tid)
        if row is None:
            svc.store.forget_retained(tid)
            continue
        if row.legal_hold or not row.deleted:
            continue  # held (kept past its retention), or a live thread (an index entry of a crash)
        if row.status != "purging" and (row.purge_after_ms or 0) > now:
            continue
        try:
            purge(svc, row, SYSTEM, reason="retention expired" if row.status != "purging"
                  else "retention: an interrupted purge finished")
        except Conflict:
            continue  # put on hold meanwhile
        purged.append((row.tenant, public_id(tid)))
    purge_expired_runs(svc, now=now, limit=limit)
    return purged


def purge_expired_runs(
    svc: Services, *, now: int | None = None, limit: int = 100
) -> list[tuple[str, str, str]]:
    """Purge every deleted run whose retention ended by ``now`` (ms) and whose thread is not on legal
    hold (recorded ``run.purged`` by ``system/retention``); (tenant, public thread id, run id) of each.
    A run whose thread was deleted too is left to the thread's purge (its hold and retention rule)."""
    now = now_ms() if now is None else now
    purged: list[tuple[str, str, str]] = []
    for rid in svc.store.retained_runs_due(now, limit=limit):
        run = svc.store.get_run_any(rid)
        if run is None:
            svc.store.forget_retained_run(rid)
            continue
        if not run.deleted or (run.purge_after_ms or 0) > now:
            continue  # an index entry of a crash (the run was never marked), or re-deleted later
        thread = svc.store.thread_any(run.thread_id)
        if thread is not None and (thread.legal_hold or thread.deleted):
            continue  # held (kept past its retention), or the thread's own purge will take it
        try:
            purge_run(svc, run, SYSTEM, reason="retention expired")
        except Conflict:
            continue  # put on hold meanwhile
        purged.append((run.tenant, public_id(run.thread_id), rid))
    return purged


class RetentionSweep:
    """A daemon thread running :func:`purge_expired` every ``interval_s`` (started by the app)."""

    def __init__(self, svc: Services, interval_s: float) -> None:
        self.svc, self.interval_s = svc, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elesium-retention", daemon=True)

    def start(self) -> RetentionSweep:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                purged = purge_expired(self.svc)
                if purged:
                    log.info("retention: purged %d expired thread(s)", len(purged))
            except Exception:  # noqa: BLE001 - a failed sweep (Redis down) is retried next interval
                log.warning("retention sweep failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
