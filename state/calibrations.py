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
    <prefix>:nodes:<workflow>              set of the workflow's calibrated node names

Folding a run is one script per node: the run joins the ``runs`` set and its counters are added
only if it was not there yet, so a retried fold (a worker restart, ``tune --from-log`` racing a
finishing run) never counts a run twice. The state layer stores plain dicts; what they mean is
:mod:`elesium.inference.tuning.node_calibration`'s business.
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

# KEYS: runs set, stats hash. ARGV: run id, then field/increment pairs. Returns 1 when folded.
_FOLD = r"""
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: seq, current. ARGV: version-key prefix, document. Returns the new version number.
_PUBLISH = r"""
local n = redis.call('INCR', KEYS[1])
if not redis.call('SET', ARGV[1] .. n, ARGV[2], 'NX') then return redis.error_reply('version exists') end
redis.call('SET', KEYS[2], n)
return n
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
    def fold(self, workflow: str, node: str, run_id: str, counters: Mapping[str, float]) -> bool:
        """Add one run's counters to the node's, once per run; True when they were added now."""
        base = self._node(workflow, node)
        args: list[Any] = [run_id]
        for k, v in counters.items():
            args += [k, repr(float(v))]
        with self._guard(base):
            self.client.sadd(self._nodes_key(workflow), node)
            return bool(self._fold(keys=[f"{base}:runs", f"{base}:stats"], args=args))

    def counters(self, workflow: str, node: str) -> dict[str, float]:
        base = self._node(workflow, node)
        with self._guard(base):
            raw = self.client.hgetall(f"{base}:stats")
        return {k.decode(): float(v) for k, v in raw.items()}

    def folded_runs(self, workflow: str, node: str) -> int:
        base = self._node(workflow, node)
        with self._guard(base):
            return int(self.client.scard(f"{base}:runs"))

    def reset_counters(self, workflow: str, node: str) -> None:
        """Forget the node's counters and folded runs (a rebuild folds the log again); versions stay."""
        base = self._node(workflow, node)
        with self._guard(base):
            self.client.delete(f"{base}:stats", f"{base}:runs")

    def nodes(self, workflow: str) -> list[str]:
        with self._guard(self._nodes_key(workflow)):
            return sorted(m.decode() for m in self.client.smembers(self._nodes_key(workflow)))

    # -- versions -------------------------------------------------------------------------------
    def publish(self, workflow: str, node: str, document: Mapping[str, Any]) -> str:
        """Store a new immutable version and point ``current`` at it; returns its label (``v<n>``)."""
        base = self._node(workflow, node)
        doc = {**document, "workflow": workflow, "node": node,
               "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        with self._guard(base):
            self.client.sadd(self._nodes_key(workflow), node)
            n = int(self._publish(keys=[f"{base}:seq", f"{base}:current"],
                                  args=[f"{base}:v", json.dumps(doc, sort_keys=True)]))
        return f"v{n}"

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
