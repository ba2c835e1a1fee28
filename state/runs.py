"""The run registry: what ran, from which input and seeds, for whom, and how it ended.

A run is the unit the API exposes and audit replays, so its metadata must be queryable by tenant
and by status and must never disagree with those indexes. Each run is a hash; two sorted sets per
registry index it (by tenant, by status; score = creation time in ms, so listings come newest
first). Create and every status change are one Lua script each, updating the hash and moving the
run between status indexes atomically.

All registry keys share the ``{registry}`` hash tag: a script may only touch one cluster slot, and
run metadata is a few small writes per run, so one slot is not a hot spot.

Lifecycle: pending -> running | cancelled | failed; running -> succeeded | failed | cancelled |
interrupted; interrupted (waiting for a human at a LangGraph ``interrupt``) -> running | cancelled |
failed. succeeded, failed and cancelled are final.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from enum import Enum
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from elesium.state.connection import connect, default_url, describe
from elesium.state.errors import (
    InvalidTransitionError,
    RunExistsError,
    RunNotFoundError,
    translate_errors,
)

DEFAULT_PREFIX = "elesium:runs"


class RunStatus(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


ALLOWED_FROM: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.PENDING: frozenset(),
    RunStatus.RUNNING: frozenset({RunStatus.PENDING, RunStatus.INTERRUPTED}),
    RunStatus.SUCCEEDED: frozenset({RunStatus.RUNNING}),
    RunStatus.FAILED: frozenset({RunStatus.PENDING, RunStatus.RUNNING, RunStatus.INTERRUPTED}),
    RunStatus.CANCELLED: frozenset({RunStatus.PENDING, RunStatus.RUNNING, RunStatus.INTERRUPTED}),
    RunStatus.INTERRUPTED: frozenset({RunStatus.RUNNING}),
}


def _now() -> datetime:
    return datetime.now(timezone.utc)


def hash_input(payload: Any) -> str:
    """sha256 of the canonical JSON of ``payload`` (sorted keys, no spaces): the run's input hash."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


_JSON_FIELDS = ("input", "engine", "calibrations")
"""RunRecord fields stored as JSON strings in the run hash (``seeds`` predates them)."""


class RunRecord(BaseModel):
    """Metadata of one run.

    Attributes:
        seeds: named RNG seeds (e.g. {"sampling": 1234}) a replay needs to reproduce the run.
        input_hash: :func:`hash_input` of the workflow input, to detect replays on other inputs.
        error: why the run failed, if it did.
        thread_id: the LangGraph thread holding the run's checkpoints ("" on records written before
            workflows stored it; such runs used the run id).
        input: the validated workflow input itself, so the run can be re-executed later (None on old
            records).
        engine: the engine fingerprint the run decoded with (model/heads sha256, profile, dtype,
            device, mode, attention path); re-execution must match it to reproduce tokens.
        calibrations: calibration version per LLM node that decoded with a tree: ``v<n>`` (see
            :mod:`elesium.state.calibrations`) or ``global`` (the engine's policy).
    """

    model_config = ConfigDict(frozen=True)

    run_id: str = Field(min_length=1)
    workflow: str
    workflow_version: str
    input_hash: str
    seeds: dict[str, int] = Field(default_factory=dict)
    status: RunStatus = RunStatus.PENDING
    tenant: str = "default"
    created_at: datetime = Field(default_factory=_now)
    updated_at: datetime = Field(default_factory=_now)
    error: str | None = None
    thread_id: str = ""
    input: dict[str, Any] | None = None
    engine: dict[str, str] = Field(default_factory=dict)
    calibrations: dict[str, str] = Field(default_factory=dict)

    def to_hash(self) -> dict[str, str]:
        data = self.model_dump(mode="json")
        data["seeds"] = json.dumps(self.seeds, sort_keys=True)
        data["error"] = self.error or ""
        for key in _JSON_FIELDS:
            data[key] = json.dumps(getattr(self, key), sort_keys=True, ensure_ascii=False)
        data["created_ms"] = str(int(self.created_at.timestamp() * 1000))
        return {k: str(v) for k, v in data.items()}

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> RunRecord:
        data = {k.decode(): v.decode() for k, v in raw.items()}
        data.pop("created_ms", None)
        data["seeds"] = json.loads(data.get("seeds") or "{}")
        data["error"] = data.get("error") or None
        for key in _JSON_FIELDS:  # absent on records written before these fields existed
            if key in data:
                data[key] = json.loads(data[key])
        return cls.model_validate(data)


_CREATE = r"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3, #ARGV))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return 1
"""

# KEYS: run hash. ARGV: run id, new status, updated_at, status-index prefix, error, allowed from...
_UPDATE = r"""
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return {'missing'} end
local ok = false
for i = 6, #ARGV do if ARGV[i] == cur then ok = true end end
if not ok then return {'invalid', cur} end
local score = redis.call('HGET', KEYS[1], 'created_ms')
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'updated_at', ARGV[3])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
redis.call('ZREM', ARGV[4] .. cur, ARGV[1])
redis.call('ZADD', ARGV[4] .. ARGV[2], score, ARGV[1])
return {'ok', redis.call('HGETALL', KEYS[1])}
"""

# KEYS: an index. ARGV: run-hash prefix, offset, count. Returns the runs' hashes, newest first.
_FETCH = r"""
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', KEYS[1], ARGV[2], ARGV[2] + ARGV[3] - 1)) do
  local h = redis.call('HGETALL', ARGV[1] .. id)
  if #h > 0 then out[#out + 1] = h end
end
return out
"""


# KEYS: run hash. ARGV: node, calibration label. One node's entry of the ``calibrations`` JSON field,
# set unless present (a run pins a node's version at its first call).
_SET_CALIBRATION = r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local raw = redis.call('HGET', KEYS[1], 'calibrations')
local cal = (raw and raw ~= '{}') and cjson.decode(raw) or {}
if cal[ARGV[1]] == nil then
  cal[ARGV[1]] = ARGV[2]
  redis.call('HSET', KEYS[1], 'calibrations', cjson.encode(cal))
end
return 1
"""


class RunRegistry:
    """Create, update and query :class:`RunRecord` s.

    Args:
        client: a synchronous ``redis.Redis`` / ``RedisCluster`` (bytes replies).
        prefix: key root; one per application sharing a database.
    """

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, target: str = "the configured server"
    ) -> None:
        self.client = client
        self._root = f"{prefix}:{{registry}}:"
        self._target = target
        self._create = client.register_script(_CREATE)
        self._update = client.register_script(_UPDATE)
        self._fetch = client.register_script(_FETCH)
        self._set_calibration = client.register_script(_SET_CALIBRATION)

    @classmethod
    def from_url(cls, url: str | None = None, **options: Any) -> RunRegistry:
        """Connect to ``url`` (default ``REDIS_URL``, else the embedded server)."""
        url = url or default_url()
        return cls(connect(url), target=describe(url), **options)

    def _run_key(self, run_id: str) -> str:
        return f"{self._root}run:{quote(run_id, safe='')}"

    def _tenant_key(self, tenant: str) -> str:
        return f"{self._root}tenant:{quote(tenant, safe='')}"

    def _status_prefix(self) -> str:
        return f"{self._root}status:"

    def _guard(self) -> Any:
        return translate_errors(f"the run registry keys {self._root}*", self._target)

    def create(self, record: RunRecord) -> RunRecord:
        """Register a new run.

        Raises:
            RunExistsError: the run id is taken.
        """
        fields = record.to_hash()
        args: list[str] = [quote(record.run_id, safe=""), fields["created_ms"]]
        for k, v in fields.items():
            args += [k, v]
        keys = [
            self._run_key(record.run_id),
            self._tenant_key(record.tenant),
            self._status_prefix() + record.status.value,
        ]
        with self._guard():
            created = self._create(keys=keys, args=args)
        if not created:
            raise RunExistsError(
                f"Run {record.run_id!r} is already registered; use a fresh run id (uuid4) or "
                "update_status() to change the existing run."
            )
        return record

    def get(self, run_id: str) -> RunRecord | None:
        with self._guard():
            raw = self.client.hgetall(self._run_key(run_id))
        return RunRecord.from_hash(raw) if raw else None

    def update_status(self, run_id: str, status: RunStatus | str, *, error: str | None = None) -> RunRecord:
        """Move a run to ``status`` (and record ``error``), atomically with the status index.

        Raises:
            RunNotFoundError: no such run.
            InvalidTransitionError: the lifecycle forbids the move (see the module docstring).
        """
        status = RunStatus(status)
        allowed = sorted(s.value for s in ALLOWED_FROM[status])
        args = [
            quote(run_id, safe=""),
            status.value,
            _now().isoformat(),
            self._status_prefix(),
            error or "",
            *allowed,
        ]
        with self._guard():
            reply = self._update(keys=[self._run_key(run_id)], args=args)
        outcome = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if outcome == "missing":
            raise RunNotFoundError(f"No run {run_id!r} in the registry; create() it first, or check the id.")
        if outcome == "invalid":
            current = reply[1].decode()
            raise InvalidTransitionError(
                f"Run {run_id!r} is {current}; it cannot become {status.value} (allowed from: "
                f"{', '.join(allowed) or 'nothing'}). Create a new run to retry."
            )
        flat = reply[1]
        return RunRecord.from_hash({flat[i]: flat[i + 1] for i in range(0, len(flat), 2)})

    def set_calibration(self, run_id: str, node: str, label: str) -> None:
        """Record that ``node`` decodes with calibration ``label`` in this run (first write wins)."""
        with self._guard():
            found = self._set_calibration(keys=[self._run_key(run_id)], args=[node, label])
        if not found:
            raise RunNotFoundError(f"No run {run_id!r} in the registry; create() it first, or check the id.")

    def _list(self, index: str, limit: int, offset: int) -> list[RunRecord]:
        with self._guard():
            rows = self._fetch(keys=[index], args=[f"{self._root}run:", offset, limit])
        return [RunRecord.from_hash({h[i]: h[i + 1] for i in range(0, len(h), 2)}) for h in rows]

    def list_by_tenant(self, tenant: str, *, limit: int = 100, offset: int = 0) -> list[RunRecord]:
        """The tenant's runs, newest first."""
        return self._list(self._tenant_key(tenant), limit, offset) if limit > 0 else []

    def list_by_status(
        self, status: RunStatus | str, *, limit: int = 100, offset: int = 0
    ) -> list[RunRecord]:
        """Runs currently in ``status``, newest first."""
        return self._list(self._status_prefix() + RunStatus(status).value, limit, offset) if limit > 0 else []
