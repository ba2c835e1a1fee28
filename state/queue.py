"""The durable run queue: background runs on a Redis Streams consumer group, leased and fenced.

Why Streams and not arq/taskiq: a stream entry stays in the group's pending list (PEL) until a
worker ``XACK`` s it, so a worker that dies mid-run cannot lose the run; ``XAUTOCLAIM`` hands idle
pending entries to a live worker; and everything is plain Redis >= 6.2 / Valkey / Cluster, which the
state layer already speaks. arq and taskiq re-deliver on a timeout too, but neither fences the
stale executor: a worker that was only paused (GC, swap, a network partition) wakes up and keeps
writing. Elesium's guarantee ("never two executors of one run") needs the fencing token checked
inside the same Lua script as each checkpoint write, which needs the lease keys in the thread's
cluster slot; that is a key-layout decision a generic task library does not let us make.

Keys. The queue's own keys share the hash tag ``{<queue name>}`` (one slot); each run's keys share
the tag of its LangGraph *thread*, the same tag :mod:`elesium.state._keys` gives the thread's
checkpoints, so a fenced checkpoint write is one slot-local script::

    Q = <prefix>:{<queue>}:           R = <prefix>:{<thread>}:
    Q stream     stream  one entry per enqueued run: run_id, thread_id, payload (JSON), timeout_ms
    Q runs       hash    run_id -> thread_id (where the run's keys live)
    Q idem:<k>   string  run_id NL payload sha256, for 24 h: idempotent enqueue
    R fence      string  fencing token: INCR on every claim of any run of the thread
    R lease      string  "<worker>:<token>" with a PX TTL, renewed by heartbeats
    R job:<run>  hash    status, attempts, worker, token, error, timestamps
    R cancel:<run> string  set by cancel(); seen by the owning worker's heartbeat

Lifecycle of a run: queued (in the stream, no job hash yet) -> running (claimed: a fresh token) ->
succeeded | failed | cancelled | interrupted (finished by the token holder, then XACK + XDEL). A worker
that dies
leaves the entry pending; once its lease has expired and the entry has been idle for
``reclaim_idle_ms``, another worker's ``XAUTOCLAIM`` takes it, claims a higher token and resumes the
run from its last checkpoint. The old worker, if it was only paused, fails its next fenced write
(:class:`LeaseLostError`) and stops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from elesium.state.connection import connect, default_url, describe
from elesium.state.errors import LeaseLostError, RunNotFoundError, StateError, translate_errors

DEFAULT_PREFIX = "elesium:q"
DEFAULT_QUEUE = "default"
GROUP = "workers"
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "interrupted"})
"""Statuses after which the queue is done with a run (``interrupted``: waiting for a human; a resume
is a new enqueue)."""
IDEMPOTENCY_TTL_S = 24 * 3600
_EMPTY_TAG = "%"  # as in elesium.state._keys: quote() never yields a lone '%'


class LeaseReleasedError(LeaseLostError):
    """This worker handed the run back (graceful shutdown past its deadline); stop without a status."""


class RunCancelledError(StateError):
    """Someone cancelled the run; the executor stops between steps and the run ends ``cancelled``."""


class RunTimeoutError(StateError):
    """The run exceeded its per-run time limit; it ends ``failed``."""


class IdempotencyConflictError(StateError, ValueError):
    """An idempotency key was reused with a different payload."""


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _now_ms() -> int:
    return int(time.time() * 1000)


def payload_hash(payload: Any) -> str:
    """sha256 of the canonical JSON of ``payload``: what makes two enqueues "the same request"."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def thread_tag(thread_id: str) -> str:
    """The hash tag body of ``thread_id``, identical to the checkpointer's (same slot)."""
    return quote(str(thread_id), safe="") or _EMPTY_TAG


# ---------------------------------------------------------------- Lua
# KEYS: stream. ARGV: group. Creates the stream (MKSTREAM) and the group reading it from the first
# entry unless the group is there already; 1 when created now, 0 when it existed. Looking and creating
# in one script is what makes it race-free without recognising the server's BUSYGROUP error by its text.
_CREATE_GROUP = r"""
if redis.call('EXISTS', KEYS[1]) == 1 then
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    for i = 1, #group, 2 do
      if group[i] == 'name' and group[i + 1] == ARGV[1] then return 0 end
    end
  end
end
redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
return 1
"""

# KEYS: idem key, runs hash, stream. ARGV: run id, thread id, payload, payload hash, timeout ms,
# now ms, idempotency ttl s. Returns {1, entry id} (enqueued), {0, "run\nhash"} (same key seen),
# {-1, thread} (run id already queued under another key).
_ENQUEUE = r"""
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
local thread = redis.call('HGET', KEYS[2], ARGV[1])
if thread then return {-1, thread} end
redis.call('SET', KEYS[1], ARGV[1] .. '\n' .. ARGV[4], 'EX', ARGV[7])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local id = redis.call('XADD', KEYS[3], '*', 'run_id', ARGV[1], 'thread_id', ARGV[2], 'payload', ARGV[3],
                      'timeout_ms', ARGV[5], 'enqueued_ms', ARGV[6])
return {1, id}
"""

# KEYS: lease, fence, job, cancel. ARGV: worker, ttl ms, now ms, max attempts, run id, thread id,
# timeout ms. Returns {'done', status} | {'busy', holder} | {'claimed', token, attempt, started_ms}.
_CLAIM = r"""
local st = redis.call('HGET', KEYS[3], 'status')
if st == 'succeeded' or st == 'failed' or st == 'cancelled' or st == 'interrupted' then
  return {'done', st}
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HSET', KEYS[3], 'run_id', ARGV[5], 'thread_id', ARGV[6], 'status', 'cancelled',
             'error', 'cancelled', 'updated_ms', ARGV[3])
  return {'done', 'cancelled'}
end
local holder = redis.call('GET', KEYS[1])
if holder then return {'busy', holder} end
local attempts = tonumber(redis.call('HGET', KEYS[3], 'attempts') or '0')
if attempts >= tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[3], 'run_id', ARGV[5], 'thread_id', ARGV[6], 'status', 'failed',
             'updated_ms', ARGV[3],
             'error', 'gave up after ' .. attempts .. ' attempts (each worker died or lost its lease)')
  return {'done', 'failed'}
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
local started = redis.call('HGET', KEYS[3], 'started_ms')
if not started then
  started = ARGV[3]
  redis.call('HSET', KEYS[3], 'run_id', ARGV[5], 'thread_id', ARGV[6], 'started_ms', started,
             'timeout_ms', ARGV[7])
end
redis.call('HSET', KEYS[3], 'status', 'running', 'worker', ARGV[1], 'token', token,
           'attempts', attempts + 1, 'updated_ms', ARGV[3])
return {'claimed', token, attempts + 1, started}
"""

# KEYS: lease, fence, cancel. ARGV: "<worker>:<token>", token, ttl ms.
# Returns {held (0/1), cancelled (0/1)}. Re-takes an expired lease while the token is still current.
_RENEW = r"""
local held = 0
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3]); held = 1
elseif not cur and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3]); held = 1
end
return {held, redis.call('EXISTS', KEYS[3])}
"""

# KEYS: fence, lease, job. ARGV: token, "<worker>:<token>", status, error, now ms.
_FINISH = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[3], 'status', ARGV[3], 'error', ARGV[4], 'updated_ms', ARGV[5],
           'finished_ms', ARGV[5])
if redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
return 1
"""

# KEYS: lease. ARGV: "<worker>:<token>".
_RELEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]); return 1 end
return 0
"""

# KEYS: job, cancel. ARGV: now ms, run id, thread id. Returns the status after the call.
_CANCEL = r"""
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'succeeded' or st == 'failed' or st == 'cancelled' or st == 'interrupted' then return st end
redis.call('SET', KEYS[2], ARGV[1])
if not st then
  redis.call('HSET', KEYS[1], 'run_id', ARGV[2], 'thread_id', ARGV[3], 'status', 'cancelled',
             'error', 'cancelled before it started', 'updated_ms', ARGV[1])
  return 'cancelled'
end
return 'cancelling'
"""


# ---------------------------------------------------------------- value types
@dataclass(frozen=True)
class EnqueueResult:
    """What ``enqueue`` did: ``created`` is False when the idempotency key was already used."""

    run_id: str
    thread_id: str
    created: bool


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to this worker (new, or reclaimed from a dead one)."""

    entry_id: str
    run_id: str
    thread_id: str
    payload: dict[str, Any]
    timeout_ms: int


@dataclass(frozen=True)
class JobState:
    """A run as the queue sees it. ``status``: queued, running, succeeded, failed or cancelled."""

    run_id: str
    thread_id: str
    status: str
    attempts: int = 0
    worker: str = ""
    token: int = 0
    error: str = ""
    cancel_requested: bool = False

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True)
class RunKeys:
    """A run's keys, all under its thread's hash tag."""

    root: str
    run_enc: str

    @classmethod
    def of(cls, prefix: str, thread_id: str, run_id: str) -> RunKeys:
        return cls(f"{prefix}:{{{thread_tag(thread_id)}}}:", quote(run_id, safe=""))

    @property
    def lease(self) -> str:
        return self.root + "lease"

    @property
    def fence(self) -> str:
        return self.root + "fence"

    @property
    def job(self) -> str:
        return f"{self.root}job:{self.run_enc}"

    @property
    def cancel(self) -> str:
        return f"{self.root}cancel:{self.run_enc}"


# ---------------------------------------------------------------- lease
@dataclass(eq=False)
class Lease:
    """This worker's claim on one run, valid while its fencing token is the thread's newest.

    The executor calls :meth:`check` between steps (and may from the engine's ``on_step``); it only
    reads flags the worker's heartbeat thread sets, so it costs nothing. The hard guarantee is not
    ``check`` but the fenced writes: :meth:`saver` and :meth:`acceptance_log` refuse, inside the
    write's own Lua script, any write once a newer token exists.
    """

    queue: RunQueue
    run_id: str
    thread_id: str
    token: int
    attempt: int
    worker_id: str
    entry_id: str
    payload: dict[str, Any]
    started_ms: int
    timeout_ms: int
    keys: RunKeys
    _abort_reason: str | None = field(default=None, init=False)
    _abort_kind: type[StateError] | None = field(default=None, init=False)
    _callbacks: list[Callable[[], None]] = field(default_factory=list, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    @property
    def holder(self) -> str:
        return f"{self.worker_id}:{self.token}"

    @property
    def deadline_ms(self) -> int | None:
        return self.started_ms + self.timeout_ms if self.timeout_ms > 0 else None

    def check(self) -> None:
        """Raise if the run must stop: lease lost or handed back, cancelled, or timed out."""
        kind = self._abort_kind
        if kind is not None:
            raise kind(self._abort_reason or "stop")

    @property
    def aborted(self) -> bool:
        return self._abort_kind is not None

    def abort(self, kind: type[StateError], reason: str) -> None:
        """Mark the run as stopping (first reason wins) and run the registered callbacks once."""
        with self._lock:
            if self._abort_kind is not None:
                return
            self._abort_kind, self._abort_reason = kind, reason
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            # Broad on purpose, and it cannot change what is recorded: the abort (its kind and reason)
            # is set above, before any callback runs, and the run's executor raises it at its next
            # ``check()``; a callback only hurries that (e.g. closing a stream). Letting one callback's
            # failure escape would skip the others and end the heartbeat thread, which renews every
            # other run's lease.
            except Exception as exc:  # noqa: BLE001
                logging.getLogger("elesium.worker").warning("abort callback failed: %s", exc)

    def on_abort(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from the heartbeat thread) when the run must stop, e.g. a stream's
        ``close``. Returns a function that unregisters it."""
        with self._lock:
            if self._abort_kind is None:
                self._callbacks.append(callback)
                return lambda: self._remove(callback)
        callback()
        return lambda: None

    def _remove(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def verify(self) -> None:
        """Ask Redis whether this token is still the newest (one round trip); raise if not."""
        self.check()
        if not self.queue.token_current(self):
            raise LeaseLostError(f"run {self.run_id!r}: a newer claim than token {self.token} exists")

    def saver(self, **options: Any) -> Any:
        """A checkpointer whose every write is refused once this lease is superseded."""
        from elesium.state.fenced import FencedSaver

        return FencedSaver(self.queue.client, fence_key=self.keys.fence, token=self.token,
                           target=self.queue.target, **options)

    def acceptance_log(self, **options: Any) -> Any:
        """An acceptance log whose appends carry this attempt and are fenced like the saver's."""
        from elesium.state.fenced import FencedAcceptanceLog

        return FencedAcceptanceLog(self.queue.client, fence_key=self.keys.fence, token=self.token,
                                   fence_tag=thread_tag(self.thread_id), target=self.queue.target, **options)


# ---------------------------------------------------------------- queue
class RunQueue:
    """Enqueue, claim, heartbeat, finish and cancel background runs.

    Args:
        client: a synchronous ``redis.Redis`` / ``RedisCluster`` (bytes replies).
        prefix: key root of the queue and of the runs' lease keys.
        name: the queue (one stream, one consumer group).
        lease_ttl_ms: how long a claim lives without a heartbeat; a dead worker's runs resume
            after about this long.
        reclaim_idle_ms: how long an entry must sit idle in a pending list before another worker may
            ``XAUTOCLAIM`` it (default: the lease TTL; live owners reset it on every heartbeat).
        max_attempts: claims per run before it is failed (a run that kills every worker it meets).
    """

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, name: str = DEFAULT_QUEUE,
        lease_ttl_ms: int = 15_000, reclaim_idle_ms: int | None = None, max_attempts: int = 5,
        target: str = "the configured server",
    ) -> None:
        if lease_ttl_ms < 100:
            raise ValueError(f"lease_ttl_ms must be >= 100, got {lease_ttl_ms}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.client = client
        self.prefix = prefix
        self.name = name
        self.lease_ttl_ms = int(lease_ttl_ms)
        self.reclaim_idle_ms = int(reclaim_idle_ms if reclaim_idle_ms is not None else lease_ttl_ms)
        self.max_attempts = int(max_attempts)
        self.target = target
        self._root = f"{prefix}:{{{quote(name, safe='') or _EMPTY_TAG}}}:"
        self._create_group = client.register_script(_CREATE_GROUP)
        self._enqueue = client.register_script(_ENQUEUE)
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._finish = client.register_script(_FINISH)
        self._release = client.register_script(_RELEASE)
        self._cancel = client.register_script(_CANCEL)
        self._group_ready = False

    @classmethod
    def from_url(cls, url: str | None = None, **options: Any) -> RunQueue:
        """Connect to ``url`` (default ``REDIS_URL``, else the embedded server)."""
        url = url or default_url()
        return cls(connect(url), target=describe(url), **options)

    # ------------------------------------------------------------ keys
    @property
    def stream_key(self) -> str:
        return self._root + "stream"

    @property
    def runs_key(self) -> str:
        return self._root + "runs"

    def _idem_key(self, key: str) -> str:
        return f"{self._root}idem:{quote(key, safe='')}"

    def run_keys(self, thread_id: str, run_id: str) -> RunKeys:
        return RunKeys.of(self.prefix, thread_id, run_id)

    def _guard(self, what: str = "") -> Any:
        return translate_errors(what or f"the run queue keys {self._root}*", self.target)

    def ensure_group(self) -> bool:
        """Create the stream and its consumer group (from the first entry) if they do not exist; True
        when this call created the group.

        One script checks and creates, so concurrent workers starting on an empty queue cannot both
        create it, and no server error is told apart by its message (which servers may word
        differently); any error the script meets is raised.
        """
        if self._group_ready:
            return False
        with self._guard():
            created = bool(int(self._create_group(keys=[self.stream_key], args=[GROUP])))
        self._group_ready = True
        return created

    # ------------------------------------------------------------ producer side
    def enqueue(
        self, run_id: str, payload: dict[str, Any], *, thread_id: str | None = None,
        idempotency_key: str | None = None, timeout_s: float | None = None,
    ) -> EnqueueResult:
        """Queue a run, once: the same idempotency key (default: the run id) never queues twice.

        Everything happens in one Lua script on the queue's slot, so two concurrent requests with
        one key cannot both enqueue, and a failure leaves nothing half-written.

        Raises:
            IdempotencyConflictError: the key was used for a different payload, or the run id is
                already queued under another key.
            ValueError: an empty run id or a negative timeout.
        """
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        thread_id = thread_id or run_id
        key = idempotency_key or run_id
        digest = payload_hash(payload)
        body = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
        self.ensure_group()
        args = [run_id, thread_id, body, digest, int((timeout_s or 0) * 1000), _now_ms(), IDEMPOTENCY_TTL_S]
        with self._guard():
            code, value = self._enqueue(keys=[self._idem_key(key), self.runs_key, self.stream_key], args=args)
        value = _text(value)
        if int(code) == 1:
            return EnqueueResult(run_id, thread_id, True)
        if int(code) == -1:
            raise IdempotencyConflictError(
                f"run {run_id!r} is already queued (under another idempotency key); use a fresh run id."
            )
        prev_run, _, prev_digest = value.partition("\n")
        if prev_digest != digest:
            raise IdempotencyConflictError(
                f"idempotency key {key!r} was already used for run {prev_run!r} with a different payload; "
                "use a new key for a new request."
            )
        return EnqueueResult(prev_run, self.thread_of(prev_run) or thread_id, False)

    def thread_of(self, run_id: str) -> str | None:
        """The thread a queued run lives on, or None if the queue never saw it."""
        with self._guard():
            raw = self.client.hget(self.runs_key, run_id)
        return _text(raw) if raw is not None else None

    def status(self, run_id: str) -> JobState | None:
        """The run's queue state, or None if it was never enqueued."""
        thread = self.thread_of(run_id)
        if thread is None:
            return None
        keys = self.run_keys(thread, run_id)
        with self._guard():
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(keys.job)
            pipe.exists(keys.cancel)
            raw, cancelled = pipe.execute()
        job = {_text(k): _text(v) for k, v in raw.items()}
        return JobState(
            run_id=run_id, thread_id=thread, status=job.get("status", "queued"),
            attempts=int(job.get("attempts", 0)), worker=job.get("worker", ""),
            token=int(job.get("token", 0)),
            error=job.get("error", ""), cancel_requested=bool(cancelled),
        )

    def cancel(self, run_id: str) -> str:
        """Ask for the run to stop, wherever its worker runs; returns the status after the call
        ("cancelled" at once if it had not started, "cancelling" while its worker notices, or the
        final status if it had already ended).

        Raises:
            RunNotFoundError: the queue never saw this run.
        """
        thread = self.thread_of(run_id)
        if thread is None:
            raise RunNotFoundError(f"No queued run {run_id!r}; check the id.")
        keys = self.run_keys(thread, run_id)
        with self._guard():
            return _text(self._cancel(keys=[keys.job, keys.cancel], args=[_now_ms(), run_id, thread]))

    def wait(self, run_id: str, timeout_s: float = 60.0, poll_s: float = 0.05) -> JobState:
        """Block until the run ends (polling); raises TimeoutError with its last state if it does not."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.status(run_id)
            if state is None:
                raise RunNotFoundError(f"No queued run {run_id!r}; check the id.")
            if state.finished:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id!r} still {state.status} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def pending_count(self) -> int:
        """Entries delivered to some worker and not yet acknowledged."""
        self.ensure_group()
        with self._guard():
            return int(self.client.xpending(self.stream_key, GROUP)["pending"])

    # ------------------------------------------------------------ worker side
    def _deliveries(self, rows: Any) -> list[Delivery]:
        out: list[Delivery] = []
        for entry_id, fields in rows or []:
            if not fields:
                continue  # deleted while pending (XAUTOCLAIM drops those from the PEL)
            f = {_text(k): _text(v) for k, v in fields.items()}
            out.append(Delivery(_text(entry_id), f["run_id"], f["thread_id"], json.loads(f["payload"]),
                                int(f.get("timeout_ms", "0"))))
        return out

    def read_new(self, consumer: str, count: int, block_ms: int = 1000) -> list[Delivery]:
        """Entries no worker has seen yet (XREADGROUP ``>``), waiting up to ``block_ms``."""
        self.ensure_group()
        with self._guard():
            reply = self.client.xreadgroup(GROUP, consumer, {self.stream_key: ">"}, count=count,
                                           block=block_ms)
        rows: list[Any] = []
        if isinstance(reply, dict):  # RESP3
            for value in reply.values():
                rows += value[0] if value and isinstance(value[0], list) else value
        else:
            for _stream, entries in reply or []:
                rows += entries
        return self._deliveries(rows)

    def reclaim(self, consumer: str, count: int) -> list[Delivery]:
        """Take over entries idle for ``reclaim_idle_ms`` (their worker died or stopped heartbeating)."""
        self.ensure_group()
        with self._guard():
            reply = self.client.xautoclaim(self.stream_key, GROUP, consumer, self.reclaim_idle_ms,
                                           start_id="0-0", count=count)
        return self._deliveries(reply[1] if len(reply) > 1 else [])

    def prune_consumers(self, idle_ms: int) -> list[str]:
        """Remove the group's consumers idle for ``idle_ms`` with nothing pending: workers that exited
        (each process registers its own name, so they would accumulate forever). A consumer with
        pending entries is never removed (``DELCONSUMER`` would drop them): ``XAUTOCLAIM`` moves those
        to live workers first, after which a later prune removes the empty consumer."""
        self.ensure_group()
        removed: list[str] = []
        with self._guard():
            for info in self.client.xinfo_consumers(self.stream_key, GROUP):
                name = _text(info.get("name", b""))
                if int(info.get("pending", 0)) == 0 and int(info.get("idle", 0)) >= idle_ms:
                    self.client.xgroup_delconsumer(self.stream_key, GROUP, name)
                    removed.append(name)
        return removed

    def claim(self, delivery: Delivery, worker_id: str) -> Lease | str:
        """Try to start ``delivery``: a :class:`Lease` with a fresh fencing token, or why not:
        "done:<status>" (already finished, or just cancelled/failed: acknowledge it) or "busy"
        (another live worker holds the thread)."""
        keys = self.run_keys(delivery.thread_id, delivery.run_id)
        args = [worker_id, self.lease_ttl_ms, _now_ms(), self.max_attempts, delivery.run_id,
                delivery.thread_id,
                delivery.timeout_ms]
        with self._guard():
            reply = self._claim(keys=[keys.lease, keys.fence, keys.job, keys.cancel], args=args)
        outcome = _text(reply[0])
        if outcome == "done":
            return f"done:{_text(reply[1])}"
        if outcome == "busy":
            return "busy"
        return Lease(queue=self, run_id=delivery.run_id, thread_id=delivery.thread_id, token=int(reply[1]),
                     attempt=int(reply[2]), worker_id=worker_id, entry_id=delivery.entry_id,
                     payload=delivery.payload, started_ms=int(_text(reply[3])),
                     timeout_ms=delivery.timeout_ms,
                     keys=keys)

    def renew(self, lease: Lease) -> tuple[bool, bool]:
        """Extend the lease; returns (still held, cancel requested)."""
        with self._guard():
            held, cancelled = self._renew(keys=[lease.keys.lease, lease.keys.fence, lease.keys.cancel],
                                          args=[lease.holder, lease.token, self.lease_ttl_ms])
        return bool(int(held)), bool(int(cancelled))

    def touch(self, lease: Lease, consumer: str) -> None:
        """Reset the entry's idle time so no one reclaims a run whose owner is alive."""
        with self._guard():
            self.client.xclaim(self.stream_key, GROUP, consumer, 0, [lease.entry_id], justid=True)

    def token_current(self, lease: Lease) -> bool:
        with self._guard():
            return _text(self.client.get(lease.keys.fence) or b"") == str(lease.token)

    def finish(self, lease: Lease, status: str, error: str = "") -> bool:
        """Record the outcome (only if ``lease`` is still current) and acknowledge the entry.

        Returns False, acknowledging nothing, when a newer claim exists: that worker owns the run.
        """
        if status not in TERMINAL:
            raise ValueError(f"status must be one of {sorted(TERMINAL)}, got {status!r}")
        with self._guard():
            done = self._finish(keys=[lease.keys.fence, lease.keys.lease, lease.keys.job],
                                args=[lease.token, lease.holder, status, error[:2000], _now_ms()])
        if not int(done):
            return False
        self.ack(lease.entry_id)
        return True

    def ack(self, entry_id: str) -> None:
        """XACK and XDEL: the entry is done for good (finished, or found finished on a reclaim)."""
        with self._guard():
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.stream_key, GROUP, entry_id)
            pipe.xdel(self.stream_key, entry_id)
            pipe.execute()

    def release(self, lease: Lease) -> bool:
        """Give the lease up without an outcome (shutdown hand-back, Redis trouble).

        The entry stays pending but is marked idle for a whole reclaim period, so the next
        ``XAUTOCLAIM`` of any worker (within half a lease TTL) takes it, instead of waiting for the
        entry to age.
        """
        with self._guard():
            released = bool(int(self._release(keys=[lease.keys.lease], args=[lease.holder])))
            if released:
                self.client.xclaim(self.stream_key, GROUP, lease.worker_id, 0, [lease.entry_id],
                                   idle=self.reclaim_idle_ms + 1, justid=True)
            return released


def new_worker_id() -> str:
    """host-pid-random: unique per process, readable in ``XINFO CONSUMERS``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
