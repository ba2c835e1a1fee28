"""Threads, protocol runs, LLM-call records and replays of the API, in Redis.

The LangGraph protocol needs more per run than :class:`~elesium.state.runs.RunRecord` holds (the
thread, the assistant, the protocol status with ``interrupted``, the request as sent, the approver of
a resume, the checkpoints the run wrote) and it needs threads, which the run registry does not know.
This store keeps them beside the registry, one hash per object, indexed by tenant so that a tenant
never lists another's objects. Every object carries its tenant; a read with the wrong tenant answers
None, which the API turns into 404, so ids leak nothing across tenants.

Keys (``P = <prefix>:``)::

    P thread:<tid>          hash   thread fields (see ThreadRow)
    P tenant-threads:<t>    zset   thread ids of tenant t, score = creation ms
    P run:<rid>             hash   run fields (see RunRow)
    P thread-runs:<tid>     zset   run ids of a thread, score = creation ms (protocol order)
    P ops:<tid>             list   the thread's operations in order (runs, state updates): replay input
    P calls:<rid>           list   the run's LLM calls (JSON), in call order
    P replays:<rid>         list   replays of the run (JSON), oldest first

Writes that touch several keys go through one MULTI/EXEC so that a failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, Field

from elesium.state.connection import connect, default_url, describe
from elesium.state.errors import translate_errors

DEFAULT_PREFIX = "elesium:api"


def now_ms() -> int:
    return int(time.time() * 1000)


class ThreadRow(BaseModel):
    """A thread: a conversation whose checkpoints live under ``thread_id`` in the checkpointer."""

    thread_id: str
    tenant: str
    created_ms: int = Field(default_factory=now_ms)
    updated_ms: int = Field(default_factory=now_ms)
    metadata: dict[str, Any] = Field(default_factory=dict)
    status: str = "idle"  # idle | busy | interrupted | error
    graph_id: str | None = None


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


_JSON_FIELDS = {"metadata", "request", "fingerprint", "checkpoints"}


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

    @classmethod
    def from_url(cls, url: str | None = None, **options: Any) -> ThreadStore:
        url = url or default_url()
        return cls(connect(url), target=describe(url), **options)

    def _k(self, kind: str, ident: str) -> str:
        return f"{self._p}{kind}:{quote(ident, safe='')}"

    def _guard(self) -> Any:
        return translate_errors(f"the API keys {self._p}*", self._target)

    # ---------------------------------------------------------------- threads
    def create_thread(self, row: ThreadRow) -> ThreadRow | None:
        """Store a new thread; None when the id is taken (by anyone: ids are global)."""
        key = self._k("thread", row.thread_id)
        with self._guard():
            if not self.client.hsetnx(key, "thread_id", row.thread_id):
                return None
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(key, mapping=_to_hash(row))
            pipe.zadd(self._k("tenant-threads", row.tenant), {row.thread_id: row.created_ms})
            pipe.execute()
        return row

    def get_thread(self, thread_id: str, tenant: str) -> ThreadRow | None:
        with self._guard():
            raw = self.client.hgetall(self._k("thread", thread_id))
        if not raw:
            return None
        row = _from_hash(ThreadRow, raw)
        return row if row.tenant == tenant else None

    def update_thread(self, thread_id: str, **fields: Any) -> None:
        row = {k: (json.dumps(v) if k in _JSON_FIELDS or v is None else str(v)) for k, v in fields.items()}
        row["updated_ms"] = str(now_ms())
        with self._guard():
            if self.client.exists(self._k("thread", thread_id)):
                self.client.hset(self._k("thread", thread_id), mapping=row)

    def list_threads(self, tenant: str, *, limit: int = 10, offset: int = 0) -> list[ThreadRow]:
        """The tenant's threads, newest first."""
        with self._guard():
            ids = self.client.zrevrange(self._k("tenant-threads", tenant), 0, -1)
            pipe = self.client.pipeline(transaction=False)
            for tid in ids:
                pipe.hgetall(self._k("thread", tid.decode()))
            rows = [_from_hash(ThreadRow, r) for r in pipe.execute() if r]
        rows = [r for r in rows if r.tenant == tenant]
        return rows[offset : offset + limit] if limit > 0 else []

    def delete_thread(self, thread_id: str, tenant: str) -> list[str]:
        """Delete the thread and its runs' rows; returns the run ids (their other data is the caller's)."""
        with self._guard():
            run_ids = [r.decode() for r in self.client.zrange(self._k("thread-runs", thread_id), 0, -1)]
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(
                self._k("thread", thread_id), self._k("thread-runs", thread_id), self._k("ops", thread_id)
            )
            pipe.zrem(self._k("tenant-threads", tenant), thread_id)
            for rid in run_ids:
                pipe.delete(self._k("run", rid), self._k("calls", rid), self._k("replays", rid))
            pipe.execute()
        return run_ids

    def claim_thread(self, thread_id: str, allowed: tuple[str, ...], status: str = "busy") -> str | None:
        """Set the thread's status to ``status`` only if it is one of ``allowed`` (atomically, so two
        servers given the same resume at once cannot both start it); returns the previous status, or
        None when the thread is missing or in another status."""
        with self._guard():
            prev = self.client.eval(_CLAIM_THREAD, 1, self._k("thread", thread_id), status, str(now_ms()),
                                    *allowed)
        return prev.decode() if isinstance(prev, bytes) else prev

    # ---------------------------------------------------------------- runs
    def create_run(self, row: RunRow) -> RunRow | None:
        """Store a new run, index it under its thread and append it to the thread's operations, in one
        script; None when a run with this id exists (an idempotent retry: nothing is written)."""
        fields = [x for kv in _to_hash(row).items() for x in kv]
        op = json.dumps({"kind": "run", "run_id": row.run_id})
        keys = [self._k("run", row.run_id), self._k("thread-runs", row.thread_id),
                self._k("ops", row.thread_id), self._k("thread", row.thread_id)]
        with self._guard():
            created = self.client.eval(_CREATE_RUN, 4, *keys, row.run_id, str(row.created_ms), op,
                                       str(now_ms()), *fields)
        return row if int(created) else None

    def get_run(self, run_id: str, tenant: str, thread_id: str | None = None) -> RunRow | None:
        with self._guard():
            raw = self.client.hgetall(self._k("run", run_id))
        if not raw:
            return None
        row = _from_hash(RunRow, raw)
        if row.tenant != tenant or (thread_id is not None and row.thread_id != thread_id):
            return None
        return row

    def get_run_any(self, run_id: str) -> RunRow | None:
        """The run whatever its tenant: for operators with direct access (the CLI), never for API callers."""
        with self._guard():
            raw = self.client.hgetall(self._k("run", run_id))
        return _from_hash(RunRow, raw) if raw else None

    def update_run(self, run_id: str, **fields: Any) -> None:
        row = {k: (json.dumps(v) if k in _JSON_FIELDS or v is None else str(v)) for k, v in fields.items()}
        row["updated_ms"] = str(now_ms())
        with self._guard():
            if self.client.exists(self._k("run", run_id)):
                self.client.hset(self._k("run", run_id), mapping=row)

    def list_runs(
        self, thread_id: str, tenant: str, *, limit: int = 10, offset: int = 0, status: str | None = None
    ) -> list[RunRow]:
        """The thread's runs, newest first."""
        with self._guard():
            ids = self.client.zrevrange(self._k("thread-runs", thread_id), 0, -1)
            pipe = self.client.pipeline(transaction=False)
            for rid in ids:
                pipe.hgetall(self._k("run", rid.decode()))
            rows = [_from_hash(RunRow, r) for r in pipe.execute() if r]
        rows = [r for r in rows if r.tenant == tenant and (status is None or r.status == status)]
        return rows[offset : offset + limit] if limit > 0 else []

    def delete_run(self, run_id: str, thread_id: str) -> None:
        """Drop a finished run's row, calls and replays (its checkpoints belong to the thread)."""
        with self._guard():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self._k("run", run_id), self._k("calls", run_id), self._k("replays", run_id))
            pipe.zrem(self._k("thread-runs", thread_id), run_id)
            pipe.execute()

    # ---------------------------------------------------------------- thread operations
    def add_op(self, thread_id: str, op: dict[str, Any]) -> None:
        """Append a non-run operation (a state update) to the thread's replayable history."""
        with self._guard():
            self.client.rpush(self._k("ops", thread_id), json.dumps(op))

    def ops(self, thread_id: str) -> list[dict[str, Any]]:
        with self._guard():
            return [json.loads(x) for x in self.client.lrange(self._k("ops", thread_id), 0, -1)]

    # ---------------------------------------------------------------- LLM calls and replays
    def set_calls(self, run_id: str, calls: list[dict[str, Any]]) -> None:
        """Replace the run's recorded LLM calls (written once, when the run ends)."""
        with self._guard():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self._k("calls", run_id))
            if calls:
                pipe.rpush(self._k("calls", run_id), *[json.dumps(c) for c in calls])
            pipe.execute()

    def add_call(self, run_id: str, call: dict[str, Any]) -> None:
        """Append one finished LLM call (as it finishes, so a worker's death loses none)."""
        with self._guard():
            self.client.rpush(self._k("calls", run_id), json.dumps(call))

    def calls(self, run_id: str) -> list[dict[str, Any]]:
        with self._guard():
            return [json.loads(x) for x in self.client.lrange(self._k("calls", run_id), 0, -1)]

    def add_replay(self, run_id: str, replay: dict[str, Any]) -> None:
        with self._guard():
            self.client.rpush(self._k("replays", run_id), json.dumps(replay))

    def replays(self, run_id: str) -> list[dict[str, Any]]:
        with self._guard():
            return [json.loads(x) for x in self.client.lrange(self._k("replays", run_id), 0, -1)]
