"""What RedisSaver and AsyncRedisSaver share: every operation, written once, without I/O.

Each operation is a generator that *yields* the Redis requests it needs (a script call, a command,
a scan, a transaction) and receives their replies, then returns its result (``list`` also yields
:class:`Emit` items as it goes). The sync saver drives these generators with blocking calls, the
async one with awaits; the key layout, (de)serialisation, paging, filtering and retention logic
exist only here, so the two cannot drift apart.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    PendingWrite,
    SerializerProtocol,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)

from elesium.state import _keys as K
from elesium.state.audit_chain import ChainCursor, ChainHooks, digest_parts
from elesium.state.audit_records import blob_fields_of, checkpoint_digest


@dataclass(frozen=True)
class ScriptCall:
    """Run the Lua script ``name`` of :data:`_keys.SCRIPTS`."""

    name: str
    keys: list[str]
    args: list[Any]


@dataclass(frozen=True)
class Command:
    """One plain command, e.g. ``("ZRANGE", key, 0, -1)``."""

    args: tuple[Any, ...]


@dataclass(frozen=True)
class Scan:
    """All keys matching ``pattern`` (SCAN, on every primary of a cluster)."""

    pattern: str


@dataclass(frozen=True)
class Transaction:
    """Commands run in one MULTI/EXEC (all keys must share a slot)."""

    commands: list[tuple[Any, ...]]


@dataclass(frozen=True)
class Emit:
    """A result item of ``list``, handed to the caller before the next page is fetched."""

    item: CheckpointTuple


@dataclass(frozen=True)
class ChainedCall:
    """Run the Lua script ``name`` with ``records`` ((kind, ref, digest) each) chained by ``cursor`` in
    the same call (the ``<name>_chained`` script; :meth:`ChainCursor.run_chained`)."""

    name: str
    keys: list[str]
    args: list[Any]
    cursor: ChainCursor
    records: list[tuple[str, str, str]]


Request = ScriptCall | Command | Scan | Transaction | ChainedCall
Op = Generator[Request | Emit, Any, Any]


def _pairs(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _bytes(value: Any) -> bytes:
    """What Redis stores for an argument (the client encodes str as UTF-8, numbers as their text)."""
    return value if isinstance(value, bytes) else str(value).encode()


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class RedisSaverBase(BaseCheckpointSaver[str]):
    """Configuration and operations common to both savers (not for direct use).

    Args:
        prefix: root of every key; give each application sharing a database its own.
        ttl_s: if set, every key of a thread expires ``ttl_s`` seconds after its last write.
            The thread's indexes are refreshed on each checkpoint, so an active thread never
            loses its head; checkpoint hashes expire ``ttl_s`` after they were written.
        keep_last: if set, each (thread, namespace) keeps only its newest ``keep_last``
            checkpoints; older ones, their writes and blobs nothing else references are deleted
            in the same script that writes the new checkpoint.
        serde: LangGraph serializer (JsonPlusSerializer by default).
    """

    def __init__(
        self,
        *,
        prefix: str = K.DEFAULT_PREFIX,
        ttl_s: int | None = None,
        keep_last: int | None = None,
        serde: SerializerProtocol | None = None,
    ) -> None:
        super().__init__(serde=serde)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be a positive number of seconds or None, got {ttl_s}.")
        if keep_last is not None and keep_last <= 0:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}.")
        self.prefix = prefix
        self.ttl_s = int(ttl_s or 0)
        self.keep_last = int(keep_last or 0)
        self.chains = ChainHooks()  # by thread id: the cursor of the run writing there (audit chain)

    def _where(self, thread_id: str | None = None) -> str:
        return f"the checkpoint keys {K.ThreadKeys.of(self.prefix, thread_id or '*').prefix}*"

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Zero-padded counter plus a random fraction, as InMemorySaver does.

        Blobs are keyed by (channel, version) per thread, and a fork (an update from an older
        checkpoint) restarts a channel's counter from an older value. The random part keeps two
        branches' versions distinct, so one branch never overwrites the other's blob.
        """
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"

    # ------------------------------------------------------------ decoding
    def _to_tuple(self, thread_id: str, ns: str, entry: Sequence[Any]) -> CheckpointTuple:
        cid = _text(entry[0])
        fields = _pairs(entry[1])
        checkpoint: Checkpoint = self.serde.loads_typed(K.unpack_typed(fields[b"checkpoint"]))
        metadata: CheckpointMetadata = self.serde.loads_typed(K.unpack_typed(fields[b"metadata"]))
        values: dict[str, Any] = {}
        for field, raw in _pairs(entry[3]).items():
            typed = K.unpack_typed(raw)
            if typed[0] != "empty":
                values[field.split(b"\x00", 1)[0].decode()] = self.serde.loads_typed(typed)
        decoded = []
        for field, raw in _pairs(entry[2]).items():
            task_id, idx = K.parse_write_field(field)
            path, channel, typed = K.unpack_write(raw)
            decoded.append((writes_sort_key(path, task_id, idx), (task_id, channel, typed)))
        decoded.sort(key=lambda pair: pair[0])
        pending: list[PendingWrite] = [
            (task_id, channel, self.serde.loads_typed(typed)) for _, (task_id, channel, typed) in decoded
        ]
        parent = _text(fields.get(b"parent", b""))

        def conf(checkpoint_id: str) -> RunnableConfig:
            configurable = {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}
            return {"configurable": configurable}

        return CheckpointTuple(
            config=conf(cid),
            checkpoint={**checkpoint, "channel_values": values},
            metadata=metadata,
            parent_config=conf(parent) if parent else None,
            pending_writes=pending,
        )

    # ------------------------------------------------------------ operations
    def _read(self, thread_id: str, ns: str, mode: str, ref: str, count: int = 1) -> ScriptCall:
        keys, nse = K.ThreadKeys.of(self.prefix, thread_id), K.encode_ns(ns)
        return ScriptCall("read", [keys.idx(nse), keys.blobs(nse)], [keys.prefix, nse, mode, ref, count])

    def _op_get_tuple(self, config: RunnableConfig) -> Op:
        conf = config["configurable"]
        thread_id, ns = str(conf["thread_id"]), conf.get("checkpoint_ns", "")
        _, _, entries = yield self._read(thread_id, ns, "id", get_checkpoint_id(config) or "")
        return self._to_tuple(thread_id, ns, entries[0]) if entries else None

    def _op_list(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> Op:
        if limit is not None and limit <= 0:
            return
        if config is None:
            keys = yield Scan(K.nss_pattern(self.prefix))
            threads = sorted({K.thread_from_nss_key(self.prefix, key) for key in keys})
        else:
            threads = [str(config["configurable"]["thread_id"])]
        wanted_ns = config["configurable"].get("checkpoint_ns") if config else None
        only_id = get_checkpoint_id(config) if config else None
        before_id = get_checkpoint_id(before) if before else None
        remaining = limit
        page = 100 if filter or limit is None else min(limit, 100)
        for thread_id in threads:
            if wanted_ns is not None:
                namespaces = [wanted_ns]
            else:
                raw = yield Command(("ZRANGE", K.ThreadKeys.of(self.prefix, thread_id).nss, 0, -1))
                namespaces = sorted(K.decode_ns(ns) for ns in raw)
            for ns in namespaces:
                cursor = before_id or ""
                while True:
                    if only_id:
                        if before_id and only_id >= before_id:
                            break
                        scanned, last, entries = yield self._read(thread_id, ns, "id", only_id)
                    else:
                        scanned, last, entries = yield self._read(thread_id, ns, "page", cursor, page)
                    for entry in entries:
                        tup = self._to_tuple(thread_id, ns, entry)
                        if filter and not all(tup.metadata.get(k) == v for k, v in filter.items()):
                            continue
                        yield Emit(tup)
                        if remaining is not None:
                            remaining -= 1
                            if remaining <= 0:
                                return
                    if only_id or scanned < page:
                        break
                    cursor = _text(last)

    def _op_put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> Op:
        conf = config["configurable"]
        thread_id, ns = str(conf["thread_id"]), conf.get("checkpoint_ns", "")
        keys, nse, cid = K.ThreadKeys.of(self.prefix, thread_id), K.encode_ns(ns), checkpoint["id"]
        stored = checkpoint.copy()
        values: dict[str, Any] = stored.pop("channel_values")  # type: ignore[misc]
        meta = get_checkpoint_metadata(config, metadata)
        fields: list[Any] = [
            "checkpoint",
            K.pack_typed(self.serde.dumps_typed(stored)),
            "metadata",
            K.pack_typed(self.serde.dumps_typed(meta)),
            "parent",
            conf.get("checkpoint_id") or "",
        ]
        if isinstance(meta.get("run_id"), str):
            fields += ["run_id", meta["run_id"]]
        for channel, version in checkpoint["channel_versions"].items():
            fields += [f"b:{channel}", str(version)]
        blobs: list[Any] = []
        for channel, version in new_versions.items():
            if channel in values:
                blobs += [
                    K.blob_field(channel, str(version)),
                    K.pack_typed(self.serde.dumps_typed(values[channel])),
                ]
        script_keys = [keys.nss, keys.idx(nse), keys.checkpoint(nse, cid), keys.blobs(nse)]
        args = [nse, cid, self.ttl_s, self.keep_last, keys.prefix, len(fields), *fields, *blobs]
        cursor = self.chains.get(thread_id)
        if cursor is not None and meta.get("run_id") == cursor.run_id:
            fresh = {K.blob_field(channel, str(version)) for channel, version in new_versions.items()}
            digest = yield from self._checkpoint_digest(cursor, keys.blobs(nse), nse, fields, blobs, fresh)
            yield ChainedCall("put", script_keys, args, cursor, [("checkpoint", f"cp:{nse}:{cid}", digest)])
        else:
            yield ScriptCall("put", script_keys, args)
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid}}

    @staticmethod
    def _checkpoint_digest(cursor: ChainCursor, blobs_key: str, nse: str, fields: list[Any],
                           blobs: list[Any], fresh: set[bytes]) -> Generator[Request, Any, str]:
        """The digest ``verify_run`` will compute of this checkpoint once stored: its hash fields and
        every blob it references, from this write's new blobs or the cursor's copy of the channel's
        current one (fetched once when an earlier run wrote it). ``fresh``: the blob fields of the
        versions this checkpoint creates; one not written has no value (a trigger channel) and no
        blob anywhere, since versions are unique."""
        stored = {_bytes(fields[i]): _bytes(fields[i + 1]) for i in range(0, len(fields), 2)}
        names = blob_fields_of(stored)
        written = {_bytes(blobs[i]): _bytes(blobs[i + 1]) for i in range(0, len(blobs), 2)}
        got: dict[bytes, bytes | None] = {}
        missing = []
        for name in names:
            channel = name.partition(b"\x00")[0].decode()
            held = cursor.blobs.get((nse, channel))
            if name in written or name in fresh:
                got[name] = written.get(name)
            elif held is not None and held[0] == name:
                got[name] = held[1]
            else:
                missing.append(name)
        if missing:
            got.update(zip(missing, (yield Command(("HMGET", blobs_key, *missing)))))
        for name in names:  # a channel without a value (a trigger) has no blob: remembered as None
            cursor.blobs[(nse, name.partition(b"\x00")[0].decode())] = (name, got[name])
        return checkpoint_digest(stored, names, [got[name] for name in names])

    def _op_put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str
    ) -> Op:
        if not writes:
            return None
        conf = config["configurable"]
        keys = K.ThreadKeys.of(self.prefix, str(conf["thread_id"]))
        key = keys.writes(K.encode_ns(conf.get("checkpoint_ns", "")), conf["checkpoint_id"])
        args: list[Any] = [self.ttl_s]
        for i, (channel, value) in enumerate(writes):
            idx = WRITES_IDX_MAP.get(channel, i)
            packed = K.pack_write(task_path, channel, self.serde.dumps_typed(value))
            args += ["n" if idx >= 0 else "s", K.write_field(task_id, idx), packed]
        stored = yield ScriptCall("put_writes", [key], args)
        cursor = self.chains.get(str(conf["thread_id"]))
        if cursor is not None and isinstance(stored, list):
            # Chained with the next checkpoint (same script), or by the run's next append or seal.
            # A write already there kept its earlier value, not this one: the seal's read-back has it.
            ref = f"w:{K.encode_ns(conf.get('checkpoint_ns', ''))}:{conf['checkpoint_id']}:{task_id}:"
            cursor.defer([("writes", f"{ref}{K.parse_write_field(args[i + 1])[1]}",
                           digest_parts([args[i + 1], args[i + 2]]))
                          for n, i in enumerate(range(1, len(args), 3)) if int(stored[n])])
        return None

    def _op_prune(self, thread_ids: Sequence[str], keep: int) -> Op:
        for thread_id in thread_ids:
            keys = K.ThreadKeys.of(self.prefix, str(thread_id))
            yield ScriptCall("prune", [keys.nss], [keys.prefix, keep])
        return None

    def _op_copy_thread(self, source: str, target: str) -> Op:
        src, dst = K.ThreadKeys.of(self.prefix, source), K.ThreadKeys.of(self.prefix, target)
        dumped = yield ScriptCall("dump", [src.nss], [src.prefix])
        commands: list[tuple[Any, ...]] = []
        for nse_raw, blob_flat, cps in dumped:
            nse = _text(nse_raw)
            commands.append(("ZADD", dst.nss, 0, nse))
            if blob_flat:
                commands.append(("HSET", dst.blobs(nse), *blob_flat))
            for cid_raw, cp_flat, w_flat in cps:
                cid = _text(cid_raw)
                commands.append(("ZADD", dst.idx(nse), 0, cid))
                commands.append(("HSET", dst.checkpoint(nse, cid), *cp_flat))
                if w_flat:
                    commands.append(("HSET", dst.writes(nse, cid), *w_flat))
        if self.ttl_s:
            touched = {cmd[1] for cmd in commands}
            commands += [("EXPIRE", key, self.ttl_s) for key in sorted(touched)]
        if commands:
            yield Transaction(commands)
        return None

    def _op_delete_for_runs(self, run_ids: Sequence[str]) -> Op:
        # Blobs are left alone: checkpoints of other runs may share them. prune() or
        # delete_thread() reclaims what becomes unreferenced.
        if not run_ids:
            return None
        keys = yield Scan(K.nss_pattern(self.prefix))
        for thread_id in sorted({K.thread_from_nss_key(self.prefix, key) for key in keys}):
            tk = K.ThreadKeys.of(self.prefix, thread_id)
            yield ScriptCall("delete_runs", [tk.nss], [tk.prefix, *run_ids])
        return None


def prune_keep(strategy: str) -> int:
    """The number of checkpoints per namespace a ``prune`` strategy keeps (0 = none)."""
    if strategy == "keep_latest":
        return 1
    if strategy == "delete":
        return 0
    raise ValueError(f"Unknown prune strategy {strategy!r}; use 'keep_latest' or 'delete'.")
