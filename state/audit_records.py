"""A run's stored records as the audit chain sees them: where each is (its ref) and its digest.

Digests are taken from the bytes Redis holds, not from values decoded and encoded again: a
checkpoint's fields are serde bytes (msgpack) that no code rewrites once written, so hashing them is
deterministic without a canonical re-encoding, and an edit that decodes and re-encodes a value is
caught even when it keeps the value. Stream entries (flat text fields) are digested as sorted-key
JSON of their decoded fields. This module knows the checkpointer's and the acceptance stream's key
layouts (:mod:`elesium.state._keys`, :mod:`elesium.state.acceptance_log`), which is why it is here
and not in the graphs layer that decides which records belong to a run.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from elesium.state import _keys as K
from elesium.state.audit_chain import digest_json, digest_parts


@dataclass(frozen=True)
class StoredCheckpoint:
    """One stored checkpoint: its digest (hash fields plus every channel blob it references) and the
    digest of each of its pending writes, by field label ``<task_id>:<idx>``."""

    ns: str  # encoded namespace
    cid: str
    run_id: str | None
    parent: str
    digest: str
    writes: dict[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"cp:{self.ns}:{self.cid}"

    def write_ref(self, label: str) -> str:
        return f"w:{self.ns}:{self.cid}:{label}"


def _text(raw: bytes | None) -> str:
    return raw.decode() if raw else ""


def read_checkpoints(client: Any, cp_prefix: str, thread_id: str, *,
                     skip: Collection[str] = ()) -> list[StoredCheckpoint]:
    """Every checkpoint of the thread (all namespaces, oldest first) except the ids in ``skip``.

    Three pipelined round trips: the ids, the checkpoint and writes hashes, the referenced blobs."""
    keys = K.ThreadKeys.of(cp_prefix, thread_id)
    namespaces = [ns.decode() for ns in client.zrange(keys.nss, 0, -1)]
    pipe = client.pipeline(transaction=False)
    for ns in namespaces:
        pipe.zrange(keys.idx(ns), 0, -1)
    ids = [(ns, cid.decode()) for ns, cids in zip(namespaces, pipe.execute()) for cid in cids
           if cid.decode() not in skip]
    pipe = client.pipeline(transaction=False)
    for ns, cid in ids:
        pipe.hgetall(keys.checkpoint(ns, cid))
        pipe.hgetall(keys.writes(ns, cid))
    replies = pipe.execute()
    hashes, writes = replies[0::2], replies[1::2]
    pipe = client.pipeline(transaction=False)
    wanted: list[list[bytes]] = []
    for (ns, _), fields in zip(ids, hashes):
        blob_fields = blob_fields_of(fields)
        wanted.append(blob_fields)
        if blob_fields:
            pipe.hmget(keys.blobs(ns), blob_fields)
    blob_replies = iter(pipe.execute())
    out = []
    for (ns, cid), fields, pending, blob_fields in zip(ids, hashes, writes, wanted):
        blobs = next(blob_replies) if blob_fields else []
        digest = checkpoint_digest(fields, blob_fields, blobs)
        out.append(StoredCheckpoint(ns, cid, _text(fields.get(b"run_id")) or None,
                                    _text(fields.get(b"parent")), digest, write_digests(pending)))
    return out


def blob_fields_of(fields: dict[bytes, bytes]) -> list[bytes]:
    """The ``b:N`` fields a checkpoint hash references (``<channel>\\0<version>``), sorted."""
    return sorted(k[2:] + b"\x00" + v for k, v in fields.items() if k.startswith(b"b:"))


def checkpoint_digest(fields: dict[bytes, bytes], blob_fields: list[bytes], blobs: list[bytes | None]) -> str:
    """A checkpoint's digest: its hash fields (sorted) and each referenced blob ("" if the hash is gone)."""
    if not fields:
        return ""
    parts: list[bytes] = []
    for k in sorted(fields):
        parts += [k, fields[k]]
    for name, blob in zip(blob_fields, blobs):
        parts += [b"blob:" + name, b"\x00missing" if blob is None else b"\x01" + blob]
    return digest_parts(parts)


def write_digests(pending: dict[bytes, bytes]) -> dict[str, str]:
    """The digest of each pending write of a writes hash, by label ``<task_id>:<idx>``."""
    labels = {}
    for raw_field, value in pending.items():
        task, idx = K.parse_write_field(raw_field)
        labels[f"{task}:{idx}"] = digest_parts([raw_field, value])
    return labels


def stream_digest(fields: dict[bytes, bytes]) -> str:
    """A stream entry's digest: sorted-key JSON of its decoded fields."""
    return digest_json({k.decode(): v.decode() for k, v in fields.items()})


def read_stream(client: Any, key: str, after: str | None = None) -> list[tuple[str, str]]:
    """(stream id, digest) of every entry of a stream after ``after`` (None: from the start)."""
    out: list[tuple[str, str]] = []
    start = f"({after}" if after else "-"
    while True:
        rows = client.xrange(key, min=start, max="+", count=1000)
        for entry_id, fields in rows:
            eid = entry_id.decode()
            out.append((eid, stream_digest(fields)))
        if len(rows) < 1000:
            return out
        start = f"({out[-1][0]}"
