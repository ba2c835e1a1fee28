"""Fenced writes: a checkpointer and an acceptance log that refuse writes from a superseded worker.

A lease with a TTL alone cannot stop two executors: a worker that was paused past its TTL (a long GC,
a swapped-out process, a partition) does not know it lost the run and resumes writing. So every
write carries the worker's fencing token and the *same Lua script* that writes checks it against the
thread's fence counter (``INCR``-ed by each claim, see :mod:`elesium.state.queue`). The check and
the write are one atomic step on one cluster slot (the fence key carries the thread's hash tag), so
there is no window between "still mine?" and "write".

:class:`FencedSaver` wraps :class:`~elesium.state.checkpointer.RedisSaver`: its ``put`` and
``put_writes`` scripts are the saver's own, with the check prepended. :class:`FencedAcceptanceLog`
does the same for acceptance-log appends and tags each entry with ``attempt`` (the token), and its
:meth:`~FencedAcceptanceLog.begin_call` deletes the entries an earlier, crashed attempt left for the
LLM call about to be re-run, so the log holds exactly one copy of every call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis.exceptions

from elesium.state import _keys as K
from elesium.state._saver_base import ChainedCall, Request, ScriptCall
from elesium.state.acceptance_log import APPEND_SCRIPT, AcceptanceEntry, AcceptanceLog
from elesium.state.checkpointer import RedisSaver
from elesium.state.errors import LeaseLostError, translate_errors

FENCED = "ELESIUM_FENCED"

# Pops the fence key (last KEY) and token (last ARGV) so the wrapped script sees its usual arguments.
_FENCE_CHECK = r"""
local __fence_key = table.remove(KEYS)
local __token = table.remove(ARGV)
if redis.call('GET', __fence_key) ~= __token then
  return redis.error_reply('""" + FENCED + r""" token ' .. __token .. ' superseded by ' ..
                           tostring(redis.call('GET', __fence_key)))
end
"""

_FENCED_SCRIPTS = ("put", "put_writes", "put_chained")

# KEYS: stream (, fence). ARGV: attempt, node id, call index (, token). Deletes that call's entries of
# other attempts.
_BEGIN_CALL = r"""
local n = 0
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
  local f, node, call, att = e[2], nil, '', ''
  for i = 1, #f, 2 do
    if f[i] == 'node_id' then node = f[i + 1]
    elseif f[i] == 'call_index' then call = f[i + 1]
    elseif f[i] == 'attempt' then att = f[i + 1] end
  end
  if node == ARGV[2] and call == ARGV[3] and att ~= ARGV[1] then
    redis.call('XDEL', KEYS[1], e[1]); n = n + 1
  end
end
return n
"""


def _is_fenced(exc: BaseException) -> bool:
    return isinstance(exc, redis.exceptions.ResponseError) and FENCED in str(exc)


class FencedSaver(RedisSaver):
    """A :class:`RedisSaver` whose checkpoint writes succeed only while ``token`` is current.

    Reads are unfenced (a superseded worker may read; it just cannot write).

    Args:
        client: the Redis client (the queue's).
        fence_key: the thread's fence counter (``RunKeys.fence``); must share the thread's hash tag.
        token: the fencing token of this worker's claim.

    Raises (from ``put`` / ``put_writes``):
        LeaseLostError: a newer claim exists; nothing was written.
    """

    def __init__(self, client: Any, *, fence_key: str, token: int, **options: Any) -> None:
        super().__init__(client, **options)
        self.fence_key = fence_key
        self.token = str(token)
        self._fenced = {name: client.register_script(_FENCE_CHECK + K.SCRIPTS[name])
                        for name in _FENCED_SCRIPTS}

    def _script(self, name: str) -> Any:
        """The fenced script ``name`` as a callable of the writer's own keys and args."""
        def call(*, keys: list[Any], args: list[Any]) -> Any:
            try:
                return self._fenced[name](keys=[*keys, self.fence_key], args=[*args, self.token])
            except redis.exceptions.ResponseError as exc:
                if _is_fenced(exc):
                    raise LeaseLostError(f"checkpoint write refused: {exc}") from None
                raise
        return call

    def _execute(self, req: Request) -> Any:
        if isinstance(req, ScriptCall) and req.name in self._fenced:
            return self._script(req.name)(keys=req.keys, args=req.args)
        if isinstance(req, ChainedCall):  # the fence checked first, then the chain's head, then the write
            return req.cursor.run_chained(self._script(req.name), self._script(f"{req.name}_chained"),
                                          req.keys, req.args, req.records)
        return super()._execute(req)


class FencedAcceptanceLog(AcceptanceLog):
    """An :class:`AcceptanceLog` whose appends are fenced and tagged ``attempt=<token>``.

    When the run's stream and the fence share a slot (thread id == run id, the default for queued
    runs) the check is inside the append's script; otherwise it is a GET immediately before the
    write (a narrow window, closed anyway by the fenced checkpoint write that follows, since a
    superseded attempt's entries are deleted by the next attempt's :meth:`begin_call`).
    """

    def __init__(self, client: Any, *, fence_key: str, token: int, fence_tag: str, **options: Any) -> None:
        super().__init__(client, **options)
        self.fence_key = fence_key
        self.token = str(token)
        self._fence_tag = fence_tag
        self._scripts_for = {
            True: {"append": client.register_script(_FENCE_CHECK + APPEND_SCRIPT),
                   "begin": client.register_script(_FENCE_CHECK + _BEGIN_CALL)},
            False: {"append": client.register_script(APPEND_SCRIPT),
                    "begin": client.register_script(_BEGIN_CALL)},
        }

    def _same_slot(self, run_id: str) -> bool:
        return self.key(run_id).endswith("{" + self._fence_tag + "}")

    def _fenced(self, run_id: str, name: str, args: list[Any], extra_keys: Sequence[str] = ()) -> Any:
        keys = [self.key(run_id), *extra_keys]
        with translate_errors(f"the acceptance stream {self.key(run_id)}", self._target):
            try:
                if self._same_slot(run_id):
                    script = self._scripts_for[True][name]
                    return script(keys=[*keys, self.fence_key], args=[*args, self.token])
                current = self.client.get(self.fence_key)
                if (current.decode() if isinstance(current, bytes) else current) != self.token:
                    raise LeaseLostError(f"acceptance write refused: token {self.token} superseded "
                                         f"by {current}")
                return self._scripts_for[False][name](keys=keys, args=args)
            except redis.exceptions.ResponseError as exc:
                if _is_fenced(exc):
                    raise LeaseLostError(f"acceptance write refused: {exc}") from None
                raise

    def _fields(self, entry: AcceptanceEntry) -> list[str]:
        fields = entry.to_fields()
        fields["attempt"] = self.token
        return [x for kv in fields.items() for x in kv]

    def begin_call(self, run_id: str, node_id: str, call_index: int | None) -> int:
        """Before (re-)running an LLM call: delete what other attempts wrote for it; returns how many."""
        call = "" if call_index is None else str(call_index)
        return int(self._fenced(run_id, "begin", [self.token, node_id, call]))

    def append(self, entry: AcceptanceEntry) -> str:
        return self.append_many([entry])[0]

    def _append_run(self, run_id: str, entries: Sequence[AcceptanceEntry],
                    once: tuple[str, str] | None = None) -> list[Any]:
        """One run's entries in one fenced script: all or nothing, and only while the lease holds."""
        extra = [once[0]] if once else []
        return list(self._fenced(run_id, "append", self._script_args(entries, once), extra))


def entry_attempts(log: AcceptanceLog, run_id: str) -> list[tuple[str, int]]:
    """(entry id, attempt) of every entry of the run, oldest first (0 for unfenced entries)."""
    with translate_errors(f"the acceptance stream {log.key(run_id)}", "the configured server"):
        rows = log.client.xrange(log.key(run_id))
    out: list[tuple[str, int]] = []
    for entry_id, fields in rows:
        raw = fields.get(b"attempt", b"0")
        out.append((entry_id.decode() if isinstance(entry_id, bytes) else entry_id, int(raw)))
    return out


def dumps_fields(entry: AcceptanceEntry) -> str:
    """The entry as canonical JSON without its wall-clock parts (stream id, step time): two runs'
    logs are equal when these strings are."""
    data = json.loads(json.dumps(entry.to_fields()))
    record = json.loads(data.pop("record"))
    record.pop("elapsed_s", None)
    data["record"] = record
    return json.dumps(data, sort_keys=True)
