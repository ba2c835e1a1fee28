"""Threads, protocol runs, LLM-call records and replays of the API, in Redis.

The LangGraph protocol needs more per run than :class:`~elesium.state.runs.RunRecord` holds (the
thread, the assistant, the protocol status with ``interrupted``, the request as sent, the approver of
a resume, the checkpoints the run wrote) and it needs threads, which the run registry does not know.
This store keeps them beside the registry, one hash per object, indexed by tenant so that a tenant
never lists another's objects. Every object carries its tenant; a read with the wrong tenant answers
None, which the API turns into 404, so ids leak nothing across tenants.

Keys (``P = <prefix>:``, ``{T}`` the thread's hash tag, the checkpointer's)::

    P {T}:thread            hash   thread fields (see ThreadRow)
    P {T}:runs              zset   run ids of the thread, score = creation ms (protocol order)
    P {T}:ops               list   the thread's operations in order (runs, state updates): replay input
    P {T}:run:<rid>         hash   run fields (see RunRow)
    P {T}:calls:<rid>       list   the run's LLM calls (JSON), in call order
    P {T}:replays:<rid>     list   replays of the run (JSON), oldest first
    P run-thread:<rid>      string the run's thread (so a run is found by its id alone)
    P tenant-threads:<t>    zset   thread ids of tenant t, score = creation ms (live threads only)
    P retained-threads      zset   deleted threads kept for audit, score = when their retention ends
    P retained-runs         zset   deleted runs kept for audit (their thread live), score = likewise
    P audit-events:<t>      stream tenant t's audit events (deletions, purges, legal holds): append-only

Deleting a thread through the API marks it deleted (status ``deleted``, ``deleted_ms``,
``purge_after_ms``): it leaves its tenant's index and every read of it answers 404, but its records
stay for audit until purged (:meth:`ThreadStore.claim_purge`, then :meth:`ThreadStore.delete_thread`).
A legal hold (``legal_hold``) refuses the purge; a thread being purged (status ``purging``) refuses a
new hold, so the two cannot interleave.

Deleting one run works the same way (:meth:`ThreadStore.mark_run_deleted`): the run row gets
``deleted_ms`` / ``deleted_by`` / ``purge_after_ms`` (its status, how it ended, is kept), normal reads
(:meth:`ThreadStore.get_run`, :meth:`ThreadStore.list_runs`) skip it, and it stays in its thread's run
index, so a purge of the thread erases it with the others; an expired one is purged alone
(:meth:`ThreadStore.retained_runs_due`, then :meth:`ThreadStore.delete_run`) unless its thread is held.

Thread ids are per tenant. A thread is stored under the id its client chose unless another tenant
already holds that id; then it is stored under ``<id>\x1f<tenant>`` (see :func:`scoped_id`), so
creating a thread with another tenant's id answers exactly as for an unused id and reveals nothing.
That stored id (``ThreadRow.thread_id``, ``RunRow.thread_id``) is what every key, the checkpointer and
the queue use; :func:`public_id` is what the API shows.

Everything of a thread and its runs shares the thread's slot, so on a Redis Cluster a write that
touches several of those keys is still one script or one MULTI/EXEC: a failure leaves nothing
half-written. The two indexes live in other slots and are written first (a crash between leaves an
index entry pointing at nothing, which reads skip), never after.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, Field

from elesium.state.audit_chain import ChainHooks, digest_json
from elesium.state.connection import connect, default_url, describe
from elesium.state.errors import translate_errors

DEFAULT_PREFIX = "elesium:api"


def now_ms() -> int:
    return int(time.time() * 1000)


SCOPE_SEP = "\x1f"
"""Separates a thread id from its tenant in a tenant-scoped stored id (refused in client ids)."""


def scoped_id(thread_id: str, tenant: str) -> str:
    """Where ``tenant`` stores its thread ``thread_id`` when another tenant took the plain id first."""
    return f"{thread_id}{SCOPE_SEP}{tenant}"


def public_id(stored_id: str) -> str:
    """The thread id the API shows for a stored thread id (the same id unless it is tenant-scoped)."""
    return stored_id.partition(SCOPE_SEP)[0]


class ThreadRow(BaseModel):
    """A thread: a conversation whose checkpoints live under ``thread_id`` in the checkpointer."""

    thread_id: str
    tenant: str
    created_ms: int = Field(default_factory=now_ms)
    updated_ms: int = Field(default_factory=now_ms)
    metadata: dict[str, Any] = Field(default_factory=dict)
    status: str = "idle"  # idle | busy | interrupted | error | deleted | purging
    graph_id: str | None = None
    deleted_ms: int | None = None  # set when deleted: kept for audit, invisible to normal reads
    deleted_by: str | None = None
    purge_after_ms: int | None = None  # when its retention ends (a legal hold keeps it past that)
    legal_hold: dict[str, Any] | None = None  # {"by", "at_ms", "reason"} while held

    @property
    def deleted(self) -> bool:
        return self.deleted_ms is not None or self.status in ("deleted", "purging")


class RunRow(BaseModel):
    """A protocol run: one invocation of a workflow on a thread (a resume is a new run)."""

    run_id: str
    thread_id: str
    tenant: str
    assistant_id: str
    workflow: str
    workflow_version: str
    status: str = "pending"  # pending | running | success | error | interrupted | timeout
    created_ms: int = Field(default_factory=now_ms)
    updated_ms: int = Field(default_factory=now_ms)
    metadata: dict[str, Any] = Field(default_factory=dict)
    request: dict[str, Any] = Field(default_factory=dict)  # input / command / checkpoint_id as sent
    seed: int = 0
    approver: str | None = None  # "tenant/key-id" of whoever resumed an interrupt with this run
    server: str = ""  # the server that created it, then the queue worker executing it
    fingerprint: dict[str, str] = Field(default_factory=dict)
    checkpoints: list[str] = Field(default_factory=list)  # checkpoint ids this run wrote, in order
    error: str | None = None
    idempotency: str | None = None  # "<digest of the request>" when created with an Idempotency-Key
    deleted_ms: int | None = None  # set when deleted: kept for audit, invisible to normal reads
    deleted_by: str | None = None
    purge_after_ms: int | None = None  # when its retention ends (its thread's legal hold keeps it past)

    @property
    def deleted(self) -> bool:
        return self.deleted_ms is not None


_JSON_FIELDS = {"metadata", "request", "fingerprint", "checkpoints", "legal_hold"}


def _to_hash(row: BaseModel) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in row.model_dump(mode="json").items():
        out[k] = json.dumps(v) if (k in _JSON_FIELDS or v is None) else str(v)
    return out


def _from_hash(cls: type[BaseModel], raw: dict[bytes, bytes]) -> Any:
    data: dict[str, Any] = {}
    for k, v in raw.items():
        key, text = k.decode(), v.decode()
        data[key] = json.loads(text) if (key in _JSON_FIELDS or text == "null") else text
    return cls.model_validate(data)


# KEYS: thread hash. ARGV: new status, now ms, allowed statuses... Returns the previous status or nil.
_CLAIM_THREAD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local cur = redis.call('HGET', KEYS[1], 'status') or 'idle'
for i = 3, #ARGV do
  if ARGV[i] == cur then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_ms', ARGV[2])
    return cur
  end
end
return false
"""


# KEYS: a hash. ARGV: field, value, ... Creates the hash only if it does not exist; returns 1 if created.
_CREATE_IF_ABSENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS: a hash. ARGV: field, value, ... Updates the hash only if it exists (a deleted object stays deleted).
_UPDATE_IF_PRESENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

# KEYS: thread hash. ARGV: now ms, purge-after ms, by. Marks it deleted unless it is busy or gone:
# 1 done, 0 missing, -1 busy, -2 already deleted.
_MARK_DELETED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local cur = redis.call('HGET', KEYS[1], 'status') or 'idle'
if cur == 'busy' then return -1 end
if cur == 'deleted' or cur == 'purging' then return -2 end
redis.call('HSET', KEYS[1], 'status', 'deleted', 'deleted_ms', ARGV[1], 'purge_after_ms', ARGV[2],
           'deleted_by', ARGV[3], 'updated_ms', ARGV[1])
return 1
"""

# KEYS: run hash. ARGV: now ms, purge-after ms, by. Marks a finished run deleted: 1 done, 0 missing,
# -1 pending or running, -2 already deleted.
_MARK_RUN_DELETED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local cur = redis.call('HGET', KEYS[1], 'status') or 'pending'
if cur == 'pending' or cur == 'running' then return -1 end
local gone = redis.call('HGET', KEYS[1], 'deleted_ms')
if gone and gone ~= 'null' then return -2 end
redis.call('HSET', KEYS[1], 'deleted_ms', ARGV[1], 'purge_after_ms', ARGV[2], 'deleted_by', ARGV[3],
           'updated_ms', ARGV[1])
return 1
"""

# KEYS: thread hash. ARGV: now ms. Claims the thread for a purge: 1 claimed (or already purging: a
# purge that died half-way is taken up again), 0 missing, -1 busy, -2 on legal hold.
_CLAIM_PURGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local hold = redis.call('HGET', KEYS[1], 'legal_hold')
if hold and hold ~= 'null' then return -2 end
local cur = redis.call('HGET', KEYS[1], 'status') or 'idle'
if cur == 'busy' then return -1 end
redis.call('HSET', KEYS[1], 'status', 'purging', 'updated_ms', ARGV[1])
return 1
"""

# KEYS: thread hash. ARGV: hold JSON (or 'null' to release), now ms. 1 done, 0 missing, -1 purging.
_SET_HOLD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] ~= 'null' and redis.call('HGET', KEYS[1], 'status') == 'purging' then return -1 end
redis.call('HSET', KEYS[1], 'legal_hold', ARGV[1], 'updated_ms', ARGV[2])
return 1
"""

# KEYS: run hash, thread-runs zset, ops list, thread hash. ARGV: run id, created ms, op, now, fields...
_CREATE_RUN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[4], 'updated_ms', ARGV[4])
return 1
"""


class ThreadStore:
    """CRUD for threads, protocol runs, LLM calls and replays (see the module docstring)."""

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, target: str = "the configured server"
    ) -> None:
        self.client = client
        self._p = prefix + ":"
        self._target = target
        self._threads: dict[str, str] = {}
        self.chains = ChainHooks()  # by run id: the run's audit cursor (add_call chains the call)

    @classmethod
    def from_url(cls, url: str | None = None, **options: Any) -> ThreadStore:
        url = url or default_url()
        return cls(connect(url), target=describe(url), **options)

    def _t(self, thread_id: str, kind: str, ident: str | None = None) -> str:
        tail = "" if ident is None else ":" + quote(ident, safe="")
        return f"{self._p}{{{quote(thread_id, safe='') or '%'}}}:{kind}{tail}"

    def _k(self, kind: str, ident: str) -> str:
        return f"{self._p}{kind}:{quote(ident, safe='')}"

    def thread_key(self, thread_id: str) -> str:
        return self._t(thread_id, "thread")

    def thread_of(self, run_id: str) -> str | None:
        """The thread of a run (None if there is no such run); a run never changes thread, so cached."""
        tid = self._threads.get(run_id)
        if tid is None:
            with self._guard():
                raw = self.client.get(self._k("run-thread", run_id))
            if raw is None:
                return None
            tid = raw.decode()
            if len(self._threads) > 100_000:
                self._threads.clear()
            self._threads[run_id] = tid
        return tid

    def _r(self, run_id: str, kind: str = "run") -> str | None:
        tid = self.thread_of(run_id)
        return None if tid is None else self._t(tid, kind, run_id)

    def _guard(self) -> Any:
        return translate_errors(f"the API keys {self._p}*", self._target)

    # ---------------------------------------------------------------- threads
    def create_thread(self, row: ThreadRow) -> ThreadRow | None:
        """Store a new thread of ``row.tenant``; None when that tenant already has a thread with this id.

        Another tenant's thread with the same id does not count (ids are per tenant): the new thread is
        then stored under :func:`scoped_id`, and the row returned carries that stored id.
        """
        scoped = row.model_copy(update={"thread_id": scoped_id(row.thread_id, row.tenant)})
        with self._guard():
            if self.client.exists(self.thread_key(scoped.thread_id)):
                return None  # the tenant's own thread, stored scoped earlier
            if self._create(row):
                return row
            owner = self.client.hget(self.thread_key(row.thread_id), "tenant")
            if owner is None or owner.decode() == row.tenant:
                return None  # the tenant's own thread (or one deleted this instant: a retry creates it)
            return scoped if self._create(scoped) else None

    def _create(self, row: ThreadRow) -> bool:
        """Index then create the thread hash if absent (the index entry is withdrawn if it was not)."""
        index = self._k("tenant-threads", row.tenant)
        added = self.client.zadd(index, {row.thread_id: row.created_ms}, nx=True)
        fields = [x for kv in _to_hash(row).items() for x in kv]
        if int(self.client.eval(_CREATE_IF_ABSENT, 1, self.thread_key(row.thread_id), *fields)):
            return True
        if added:
            self.client.zrem(index, row.thread_id)
        return False

    def get_thread(self, thread_id: str, tenant: str) -> ThreadRow | None:
        """The tenant's thread ``thread_id`` (stored plain or tenant-scoped); None for another's."""
        with self._guard():
            for stored in (thread_id, scoped_id(thread_id, tenant)):
                raw = self.client.hgetall(self.thread_key(stored))
                if raw:
                    row = _from_hash(ThreadRow, raw)
                    if row.tenant == tenant:
                        return row
        return None

    def update_thread(self, thread_id: str, **fields: Any) -> None:
        row = {k: (json.dumps(v) if k in _JSON_FIELDS or v is None else str(v)) for k, v in fields.items()}
        row["updated_ms"] = str(now_ms())
        args = [x for kv in row.items() for x in kv]
        with self._guard():
            self.client.eval(_UPDATE_IF_PRESENT, 1, self.thread_key(thread_id), *args)

    def list_threads(self, tenant: str, *, limit: int = 10, offset: int = 0) -> list[ThreadRow]:
        """The tenant's live threads, newest first (deleted ones, kept for audit, are not listed)."""
        with self._guard():
            ids = self.client.zrevrange(self._k("tenant-threads", tenant), 0, -1)
            pipe = self.client.pipeline(transaction=False)
            for tid in ids:
                pipe.hgetall(self.thread_key(tid.decode()))
            rows = [_from_hash(ThreadRow, r) for r in pipe.execute() if r]
        rows = [r for r in rows if r.tenant == tenant and not r.deleted]
        return rows[offset : offset + limit] if limit > 0 else []

    # ---------------------------------------------------------------- retention
    def mark_deleted(self, thread_id: str, tenant: str, *, by: str, purge_after_ms: int) -> int:
        """Mark the thread deleted, kept for audit until ``purge_after_ms``: 1 done, 0 missing, -1 busy,
        -2 already deleted. The retained index is written first (a crash leaves an entry the sweep
        skips, as the thread is not deleted), the tenant's index is left after."""
        retained = self._k("retained-threads", "all")
        with self._guard():
            added = self.client.zadd(retained, {thread_id: purge_after_ms}, nx=True)
            done = int(self.client.eval(_MARK_DELETED, 1, self.thread_key(thread_id), str(now_ms()),
                                        str(purge_after_ms), by))
            if done == 1:
                self.client.zadd(retained, {thread_id: purge_after_ms})
                self.client.zrem(self._k("tenant-threads", tenant), thread_id)
            elif added:
                self.client.zrem(retained, thread_id)
        return done

    def claim_purge(self, thread_id: str) -> int:
        """Claim the thread for a purge (status ``purging``): 1 claimed, 0 missing, -1 busy, -2 held.
        Indexed as due first, so a purge that dies half-way is finished by the next sweep."""
        with self._guard():
            added = self.client.zadd(self._k("retained-threads", "all"), {thread_id: now_ms()}, nx=True)
            done = int(self.client.eval(_CLAIM_PURGE, 1, self.thread_key(thread_id), str(now_ms())))
            if done != 1 and added:
                self.client.zrem(self._k("retained-threads", "all"), thread_id)
        return done

    def set_legal_hold(self, thread_id: str, hold: dict[str, Any] | None) -> int:
        """Put (``hold``) or release (None) a legal hold: 1 done, 0 missing, -1 being purged."""
        with self._guard():
            return int(self.client.eval(_SET_HOLD, 1, self.thread_key(thread_id), json.dumps(hold),
                                        str(now_ms())))

    def retained_due(self, until_ms: int, limit: int = 100) -> list[str]:
        """Stored ids of retained threads whose retention ended by ``until_ms`` (held ones included:
        the caller checks), oldest first."""
        with self._guard():
            ids = self.client.zrangebyscore(self._k("retained-threads", "all"), "-inf", until_ms,
                                            start=0, num=limit)
        return [i.decode() for i in ids]

    def forget_retained(self, thread_id: str) -> None:
        with self._guard():
            self.client.zrem(self._k("retained-threads", "all"), thread_id)

    def thread_any(self, thread_id: str) -> ThreadRow | None:
        """The thread stored under ``thread_id`` whatever its tenant (the retention sweep's read)."""
        with self._guard():
            raw = self.client.hgetall(self.thread_key(thread_id))
        return _from_hash(ThreadRow, raw) if raw else None

    def mark_run_deleted(self, run_id: str, *, by: str, purge_after_ms: int) -> int:
        """Mark a finished run deleted, kept for audit until ``purge_after_ms``: 1 done, 0 missing,
        -1 pending or running, -2 already deleted. Indexed as retained first (a crash leaves an entry
        the sweep skips, as the run is not deleted)."""
        key = self._r(run_id)
        if key is None:
            return 0
        retained = self._k("retained-runs", "all")
        with self._guard():
            added = self.client.zadd(retained, {run_id: purge_after_ms}, nx=True)
            done = int(self.client.eval(_MARK_RUN_DELETED, 1, key, str(now_ms()), str(purge_after_ms), by))
            if done == 1:
                self.client.zadd(retained, {run_id: purge_after_ms})
            elif added:
                self.client.zrem(retained, run_id)
        return done

    def retained_runs_due(self, until_ms: int, limit: int = 100) -> list[str]:
        """Ids of deleted runs whose retention ended by ``until_ms`` (held threads' included: the
        caller checks), oldest first."""
        with self._guard():
            ids = self.client.zrangebyscore(self._k("retained-runs", "all"), "-inf", until_ms,
                                            start=0, num=limit)
        return [i.decode() for i in ids]

    def forget_retained_run(self, run_id: str) -> None:
        with self._guard():
            self.client.zrem(self._k("retained-runs", "all"), run_id)

    def run_ids(self, thread_id: str) -> list[str]:
        with self._guard():
            return [r.decode() for r in self.client.zrange(self._t(thread_id, "runs"), 0, -1)]

    # ---------------------------------------------------------------- audit events
    def add_audit_event(self, tenant: str, event: dict[str, Any]) -> str:
        """Append an event (who, what, when) to the tenant's audit stream; never trimmed or deleted."""
        with self._guard():
            entry = self.client.xadd(self._k("audit-events", tenant), {"event": json.dumps(event)})
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    def audit_events(
        self, tenant: str, *, after: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """The tenant's audit events, oldest first, ``limit`` after the stream id ``after``."""
        with self._guard():
            rows = self.client.xrange(self._k("audit-events", tenant), min=f"({after}" if after else "-",
                                      count=limit)
        return [{"event_id": eid.decode(), **json.loads(fields[b"event"])} for eid, fields in rows]

    def delete_thread(self, thread_id: str, tenant: str) -> list[str]:
        """Delete the thread and its runs' rows; returns the run ids (their other data is the caller's)."""
        with self._guard():
            run_ids = [r.decode() for r in self.client.zrange(self._t(thread_id, "runs"), 0, -1)]
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.thread_key(thread_id), self._t(thread_id, "runs"), self._t(thread_id, "ops"))
            for rid in run_ids:
                pipe.delete(*(self._t(thread_id, kind, rid) for kind in ("run", "calls", "replays")))
            pipe.execute()
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(self._k("tenant-threads", tenant), thread_id)
            pipe.zrem(self._k("retained-threads", "all"), thread_id)
            if run_ids:
                pipe.zrem(self._k("retained-runs", "all"), *run_ids)  # runs deleted before the thread
            for rid in run_ids:
                pipe.delete(self._k("run-thread", rid))
            pipe.execute()
        for rid in run_ids:
            self._threads.pop(rid, None)
        return run_ids

    def claim_thread(self, thread_id: str, allowed: tuple[str, ...], status: str = "busy") -> str | None:
        """Set the thread's status to ``status`` only if it is one of ``allowed`` (atomically, so two
        servers given the same resume at once cannot both start it); returns the previous status, or
        None when the thread is missing or in another status."""
        with self._guard():
            prev = self.client.eval(_CLAIM_THREAD, 1, self.thread_key(thread_id), status, str(now_ms()),
                                    *allowed)
        return prev.decode() if isinstance(prev, bytes) else prev

    # ---------------------------------------------------------------- runs
    def create_run(self, row: RunRow) -> RunRow | None:
        """Store a new run, index it under its thread and append it to the thread's operations, in one
        script; None when a run with this id exists (an idempotent retry: nothing is written)."""
        fields = [x for kv in _to_hash(row).items() for x in kv]
        op = json.dumps({"kind": "run", "run_id": row.run_id})
        tid = row.thread_id
        keys = [self._t(tid, "run", row.run_id), self._t(tid, "runs"), self._t(tid, "ops"),
                self.thread_key(tid)]
        with self._guard():
            if not self.client.set(self._k("run-thread", row.run_id), tid, nx=True):
                if self.thread_of(row.run_id) != tid:
                    return None  # the id names a run of another thread
            created = self.client.eval(_CREATE_RUN, 4, *keys, row.run_id, str(row.created_ms), op,
                                       str(now_ms()), *fields)
        return row if int(created) else None

    def get_run(self, run_id: str, tenant: str, thread_id: str | None = None, *,
                include_deleted: bool = False) -> RunRow | None:
        """The tenant's run (on ``thread_id`` when given); a deleted one (kept for audit) is None
        unless ``include_deleted`` (an auditor's view)."""
        row = self.get_run_any(run_id)
        if row is None or row.tenant != tenant or (thread_id is not None and row.thread_id != thread_id):
            return None
        if row.deleted and not include_deleted:
            return None
        return row

    def get_run_any(self, run_id: str) -> RunRow | None:
        """The run whatever its tenant: for operators with direct access (the CLI), never for API callers."""
        key = self._r(run_id)
        if key is None:
            return None
        with self._guard():
            raw = self.client.hgetall(key)
        return _from_hash(RunRow, raw) if raw else None

    def update_run(self, run_id: str, **fields: Any) -> None:
        key = self._r(run_id)
        if key is None:
            return
        row = {k: (json.dumps(v) if k in _JSON_FIELDS or v is None else str(v)) for k, v in fields.items()}
        row["updated_ms"] = str(now_ms())
        with self._guard():
            self.client.eval(_UPDATE_IF_PRESENT, 1, key, *[x for kv in row.items() for x in kv])

    def list_runs(
        self, thread_id: str, tenant: str, *, limit: int = 10, offset: int = 0, status: str | None = None,
        include_deleted: bool = False,
    ) -> list[RunRow]:
        """The thread's runs, newest first; deleted ones (kept for audit) only with ``include_deleted``."""
        with self._guard():
            ids = self.client.zrevrange(self._t(thread_id, "runs"), 0, -1)
            pipe = self.client.pipeline(transaction=False)
            for rid in ids:
                pipe.hgetall(self._t(thread_id, "run", rid.decode()))
            rows = [_from_hash(RunRow, r) for r in pipe.execute() if r]
        rows = [r for r in rows if r.tenant == tenant and (status is None or r.status == status)
                and (include_deleted or not r.deleted)]
        return rows[offset : offset + limit] if limit > 0 else []

    def delete_run(self, run_id: str, thread_id: str) -> None:
        """Drop a finished run's row, calls and replays (its checkpoints belong to the thread; its
        acceptance log and audit chain are the caller's: ``api/retention.purge_run``). The row goes
        last-but-the-indexes, so a purge that dies half-way is found again by the retention sweep."""
        with self._guard():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(*(self._t(thread_id, kind, run_id) for kind in ("run", "calls", "replays")))
            pipe.zrem(self._t(thread_id, "runs"), run_id)
            pipe.execute()
            self.client.delete(self._k("run-thread", run_id))
            self.client.zrem(self._k("retained-runs", "all"), run_id)
        self._threads.pop(run_id, None)

    # ---------------------------------------------------------------- thread operations
    def add_op(self, thread_id: str, op: dict[str, Any]) -> None:
        """Append a non-run operation (a state update) to the thread's replayable history."""
        with self._guard():
            self.client.rpush(self._t(thread_id, "ops"), json.dumps(op))

    def ops(self, thread_id: str) -> list[dict[str, Any]]:
        with self._guard():
            return [json.loads(x) for x in self.client.lrange(self._t(thread_id, "ops"), 0, -1)]

    # ---------------------------------------------------------------- LLM calls and replays
    def _list_key(self, run_id: str, kind: str) -> str:
        key = self._r(run_id, kind)
        if key is None:
            raise KeyError(f"no run {run_id!r}")
        return key

    def set_calls(self, run_id: str, calls: list[dict[str, Any]]) -> None:
        """Replace the run's recorded LLM calls (once the run has ended: deduplicated after a resume)."""
        key = self._list_key(run_id, "calls")
        with self._guard():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)
            if calls:
                pipe.rpush(key, *[json.dumps(c) for c in calls])
            pipe.execute()

    def add_call(self, run_id: str, call: dict[str, Any]) -> None:
        """Append one finished LLM call (as it finishes, so a worker's death loses none), chained
        right after when the run's audit cursor is attached (``chains``, by run id)."""
        raw = json.dumps(call)
        with self._guard():
            self.client.rpush(self._list_key(run_id, "calls"), raw)
        cursor = self.chains.get(run_id)
        if cursor is not None:
            value = json.loads(raw)  # what a reader decodes, so the digest is the verifier's
            cursor.append([("call", f"call:{value.get('node')}#{value.get('call')}", digest_json(value))])

    def calls(self, run_id: str) -> list[dict[str, Any]]:
        key = self._r(run_id, "calls")
        if key is None:
            return []
        with self._guard():
            return [json.loads(x) for x in self.client.lrange(key, 0, -1)]

    def add_replay(self, run_id: str, replay: dict[str, Any]) -> None:
        with self._guard():
            self.client.rpush(self._list_key(run_id, "replays"), json.dumps(replay))

    def replays(self, run_id: str) -> list[dict[str, Any]]:
        key = self._r(run_id, "replays")
        if key is None:
            return []
        with self._guard():
            return [json.loads(x) for x in self.client.lrange(key, 0, -1)]
