"""Versioned per-(workflow, node) tree calibrations and the acceptance counters they come from.

A run's sampled tokens depend on the trees its calls built, so a calibration a run used must stay
readable, unchanged, for as long as the run may be re-executed. Versions are therefore immutable
(``SET NX``, never overwritten) and numbered per node; a ``current`` pointer names the one new runs
start from. Keys, one cluster slot per node (``{workflow:node}`` is the hash tag)::

    <prefix>:{<workflow>:<node>}:v<n>      JSON document of version n (immutable)
    <prefix>:{<workflow>:<node>}:current   n of the version new runs use (absent: global policy)
    <prefix>:{<workflow>:<node>}:seq       last version number handed out
    <prefix>:{<workflow>:<node>}:stats     hash of acceptance counters (HINCRBYFLOAT)
    <prefix>:{<workflow>:<node>}:runs      set of run ids already folded into the counters
    <prefix>:{<workflow>:<node>}:trial     n of the version on trial (absent: none)
    <prefix>:{<workflow>:<node>}:arm:<label>  counters of the runs that used <label> during the trial
    <prefix>:{<workflow>:<node>}:turns     alternation counter: which arm the next run takes
    <prefix>:{<workflow>:<node>}:decisions list of JSON trial verdicts, oldest first
    <prefix>:nodes:<workflow>              set of the workflow's calibrated node names

This module stores and reads; it decides nothing. Whether a version goes on trial, which arm a run
takes, and when a trial ends with which verdict is the calibrator's business (the graphs layer);
what the counters and documents mean is the tuning statistics'. What this module guarantees is
that each change is whole: a trial ends (pointer moved or not, arms cleared, verdict appended) in
one script, so a half-made decision is never visible and a decision taken twice (two workers
folding the run that completed the evidence) is stored once.

Folding a run is one script per node: the run joins the ``runs`` set and its counters are added
only if it was not there yet, so a retried fold (a worker restart, ``tune --from-log`` racing a
finishing run) never counts a run twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from elesium.state.connection import connect, default_url, describe
from elesium.state.errors import translate_errors

DEFAULT_PREFIX = "elesium:calib"
GLOBAL = "global"  # the label a run records for a node that used the engine's own policy

# KEYS: runs set, stats hash[, arm stats hash]. ARGV: run id, then field/increment pairs. Returns 1
# when folded. The arm hash (a trial's per-arm counters) gets the same increments.
_FOLD = r"""
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 2, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1])
  if KEYS[3] then redis.call('HINCRBYFLOAT', KEYS[3], ARGV[i], ARGV[i + 1]) end
end
return 1
"""

# KEYS: seq, pointer (current or trial). ARGV: version-key prefix, document. Returns the new number.
_PUBLISH = r"""
local n = redis.call('INCR', KEYS[1])
if not redis.call('SET', ARGV[1] .. n, ARGV[2], 'NX') then return redis.error_reply('version exists') end
redis.call('SET', KEYS[2], n)
return n
"""

# KEYS: trial, current, decisions, turns, the two arms' counters. ARGV: n, "current" | "keep" (whether
# current moves to n), record JSON. Returns 1 when ended now, 0 when n was no longer on trial (ended
# elsewhere first: nothing is written).
_END_TRIAL = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == 'current' then redis.call('SET', KEYS[2], ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[4], KEYS[5], KEYS[6])
redis.call('RPUSH', KEYS[3], ARGV[3])
return 1
"""


def _part(name: str) -> str:
    return quote(name, safe="-_.")


def parse_label(label: str) -> int:
    """``"v3"`` -> 3; ValueError on anything else (``"global"`` is not a version)."""
    if not (label.startswith("v") and label[1:].isdigit()):
        raise ValueError(f"not a calibration version label: {label!r} (expected v<n>)")
    return int(label[1:])


class CalibrationStore:
    """Counters, versions and the current pointer of per-node calibrations.

    Args:
        client: a synchronous ``redis.Redis`` / ``RedisCluster`` (bytes replies).
        prefix: key root; one per application sharing a database.
    """

    def __init__(self, client: Any, *, prefix: str = DEFAULT_PREFIX,
                 target: str = "the configured server") -> None:
        self.client = client
        self.prefix = prefix
        self._target = target
        self._fold = client.register_script(_FOLD)
        self._publish = client.register_script(_PUBLISH)
        self._end_trial = client.register_script(_END_TRIAL)

    @classmethod
    def from_url(cls, url: str | None = None, **options: Any) -> CalibrationStore:
        url = url or default_url()
        return cls(connect(url), target=describe(url), **options)

    def _node(self, workflow: str, node: str) -> str:
        return f"{self.prefix}:{{{_part(workflow)}:{_part(node)}}}"

    def _nodes_key(self, workflow: str) -> str:
        return f"{self.prefix}:nodes:{_part(workflow)}"

    def _guard(self, what: str) -> Any:
        return translate_errors(f"the calibration keys {what}", self._target)

    # -- counters -------------------------------------------------------------------------------
    def fold(self, workflow: str, node: str, run_id: str, counters: Mapping[str, float],
             arm: str | None = None) -> bool:
        """Add one run's counters to the node's, once per run; True when they were added now.

        ``arm``: the version label the run used, when a trial is running; its counters get the same
        increments, in the same script, so an arm never counts a run the node's total does not.
        """
        base = self._node(workflow, node)
        args: list[Any] = [run_id]
        for k, v in counters.items():
            args += [k, repr(float(v))]
        keys = [f"{base}:runs", f"{base}:stats"] + ([f"{base}:arm:{arm}"] if arm else [])
        with self._guard(base):
            self.client.sadd(self._nodes_key(workflow), node)
            return bool(self._fold(keys=keys, args=args))

    def counters(self, workflow: str, node: str, arm: str | None = None) -> dict[str, float]:
        """The node's counters, or one trial arm's (``arm``: a version label or ``global``)."""
        base = self._node(workflow, node)
        with self._guard(base):
            raw = self.client.hgetall(f"{base}:arm:{arm}" if arm else f"{base}:stats")
        return {k.decode(): float(v) for k, v in raw.items()}

    def folded_runs(self, workflow: str, node: str) -> int:
        base = self._node(workflow, node)
        with self._guard(base):
            return int(self.client.scard(f"{base}:runs"))

    def reset_counters(self, workflow: str, node: str) -> None:
        """Forget the node's counters and folded runs (a rebuild folds the log again); versions and
        verdicts stay, and a running trial starts its comparison afresh."""
        base = self._node(workflow, node)
        labels = {GLOBAL, self.current(workflow, node), self.trial(workflow, node) or GLOBAL}
        with self._guard(base):
            self.client.delete(f"{base}:stats", f"{base}:runs", f"{base}:turns",
                               *(f"{base}:arm:{label}" for label in labels))

    def nodes(self, workflow: str) -> list[str]:
        with self._guard(self._nodes_key(workflow)):
            return sorted(m.decode() for m in self.client.smembers(self._nodes_key(workflow)))

    # -- versions -------------------------------------------------------------------------------
    def publish(self, workflow: str, node: str, document: Mapping[str, Any], *, trial: bool = False) -> str:
        """Store a new immutable version and point ``current`` (or, with ``trial``, ``trial``) at it;
        returns its label (``v<n>``). Pointing ``trial`` replaces any trial still running and resets
        the alternation counter (:meth:`next_turn` starts again at 1)."""
        base = self._node(workflow, node)
        doc = {**document, "workflow": workflow, "node": node,
               "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        with self._guard(base):
            self.client.sadd(self._nodes_key(workflow), node)
            if trial:
                self.client.delete(f"{base}:turns")
            n = int(self._publish(keys=[f"{base}:seq", f"{base}:trial" if trial else f"{base}:current"],
                                  args=[f"{base}:v", json.dumps(doc, sort_keys=True)]))
        return f"v{n}"

    def trial(self, workflow: str, node: str) -> str | None:
        """The label of the version on trial, or None."""
        base = self._node(workflow, node)
        with self._guard(base):
            raw = self.client.get(f"{base}:trial")
        return None if raw is None else f"v{int(raw)}"

    def next_turn(self, workflow: str, node: str) -> int:
        """1, 2, 3, ... for successive runs choosing during a trial: one atomic counter, so runs on
        different workers still alternate (which number means which arm is the caller's rule)."""
        base = self._node(workflow, node)
        with self._guard(base):
            return int(self.client.incr(f"{base}:turns"))

    def end_trial(self, workflow: str, node: str, trial: str, incumbent: str, *, make_current: bool,
                  record: Mapping[str, Any]) -> bool:
        """End ``trial`` in one script: point ``current`` at it when ``make_current``, clear both arms'
        counters and the alternation, append ``record`` to the verdicts.

        False (and nothing written) when ``trial`` was not, or no longer, on trial: two callers that
        reached the same verdict from the same evidence store it once.
        """
        base = self._node(workflow, node)
        with self._guard(base):
            return bool(int(self._end_trial(
                keys=[f"{base}:trial", f"{base}:current", f"{base}:decisions", f"{base}:turns",
                      f"{base}:arm:{trial}", f"{base}:arm:{incumbent}"],
                args=[parse_label(trial), "current" if make_current else "keep",
                      json.dumps(dict(record), sort_keys=True)])))

    def decisions(self, workflow: str, node: str) -> list[dict[str, Any]]:
        """The records :meth:`end_trial` appended for the node, oldest first."""
        base = self._node(workflow, node)
        with self._guard(base):
            return [json.loads(raw) for raw in self.client.lrange(f"{base}:decisions", 0, -1)]

    def current(self, workflow: str, node: str) -> str:
        """The label new runs of this node use: ``v<n>``, or :data:`GLOBAL` when none is published."""
        base = self._node(workflow, node)
        with self._guard(base):
            raw = self.client.get(f"{base}:current")
        return f"v{int(raw)}" if raw is not None else GLOBAL

    def get(self, workflow: str, node: str, label: str) -> dict[str, Any] | None:
        """Version ``label``'s document (None when it does not exist)."""
        base = self._node(workflow, node)
        with self._guard(base):
            raw = self.client.get(f"{base}:v{parse_label(label)}")
        return None if raw is None else json.loads(raw)

    def versions(self, workflow: str, node: str) -> int:
        """How many versions the node has had (the last label is ``v<versions>``)."""
        base = self._node(workflow, node)
        with self._guard(base):
            raw = self.client.get(f"{base}:seq")
        return int(raw) if raw is not None else 0
