"""Which records a run wrote, chaining them as the run goes, and verifying the chain afterwards.

The storage (entries, compare-and-append, seals, signers) is :mod:`elesium.state.audit_chain`; this
module decides what belongs to a run and reads it the same way for both directions, so whatever
the appender chained the verifier re-reads by the same ``ref`` and digests the same way:

- ``run`` / ``approval``: the run row's request, seed, workflow and engine; the approver and the
  resume value (kept apart so an edited approver is named as such). A run without a ``ThreadStore``
  row (``WorkflowRunner``: ``elesium run`` without ``--server``, background runs) has its run
  registry record (``state/runs.RunRecord``) instead: its identity (workflow and version, input and
  its hash, seeds, tenant, thread, engine, creation time), not what changes as it runs (status,
  calibration pins); its resume values are pending writes, chained as such;
- ``checkpoint``: every checkpoint whose metadata names the run (stored bytes + referenced blobs);
- ``writes``: every pending write on those checkpoints and on the checkpoint the run started from,
  each write once, by whichever run wrote it first (a resume adds writes to the previous run's last
  checkpoint: the resuming run chains those);
- ``call``: each LLM call record (``token_ids`` with the prompt's digest), by (node, call index);
- ``acceptance``: each entry of the run's acceptance stream, by stream id;
- ``replay``: each stored replay report (chained after the seal; the seal is then renewed).

:class:`RunAudit` appends after each super-step (``graphs/execution.drive`` calls it) and seals when
the run ends; :func:`verify_run` recomputes every digest and link, checks the seal and its signature,
and also fails records that exist but were never chained (an entry appended later).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from elesium.config import Settings
from elesium.state import _keys as K
from elesium.state.acceptance_log import AcceptanceLog
from elesium.state.audit_chain import DEFAULT_PREFIX as CHAIN_PREFIX
from elesium.state.audit_chain import (
    GENESIS,
    AuditChain,
    ChainCursor,
    ChainEntry,
    ChainHooks,
    Head,
    Seal,
    Signer,
    digest_json,
    signer_for,
)
from elesium.state.audit_records import (
    StoredCheckpoint,
    blob_fields_of,
    checkpoint_digest,
    read_checkpoints,
    read_stream,
    stream_digest,
    write_digests,
)

TERMINAL = ("success", "error", "interrupted", "timeout")
REGISTRY_TERMINAL = ("succeeded", "failed", "cancelled", "interrupted")  # state/runs.RunStatus values
REGISTRY_FIELDS = {"run_id", "workflow", "workflow_version", "input_hash", "seeds", "tenant", "thread_id",
                   "input", "engine", "created_at"}
"""What of a run registry record is chained: fixed when the run is created."""
_STREAM_PAGE = 1000
SEAL_STATUS = {"success": "succeeded", "error": "failed", "interrupted": "interrupted"}


class Record(NamedTuple):
    kind: str
    ref: str
    digest: str


class RunSources:
    """Where one run's records are read (module docstring), for the appender and the verifier alike.

    Args:
        client: the Redis client holding the run.
        store: the API's ``ThreadStore`` (run row, calls, replays); None for runs without one.
        cp_prefix: the checkpointer's key root.
        acceptance: the acceptance log whose stream holds the run's entries.
        registry: the ``RunRegistry`` whose record is the run's identity when ``store`` has no row
            (``WorkflowRunner`` runs; their LLM calls are in the acceptance stream).
    """

    def __init__(self, client: Any, *, thread_id: str, run_id: str, store: Any = None,
                 cp_prefix: str = K.DEFAULT_PREFIX, acceptance: AcceptanceLog | None = None,
                 registry: Any = None) -> None:
        self.client, self.thread_id, self.run_id, self.store = client, thread_id, run_id, store
        self.cp_prefix = cp_prefix
        self.registry = registry
        self.acceptance_log = acceptance
        self.stream_key = (acceptance or AcceptanceLog(client)).key(run_id)
        self._list_keys: dict[str, str] = {}

    def list_key(self, kind: str) -> str | None:
        """The key of the run's ``calls`` / ``replays`` list in the ``ThreadStore`` (resolved once, as
        the store resolves it), or None: no store, no row yet, or a store that does not say."""
        key = self._list_keys.get(kind)
        if key is None and self.store is not None and callable(getattr(self.store, "_r", None)):
            key = self.store._r(self.run_id, kind)
            if isinstance(key, str):
                self._list_keys[kind] = key
            else:
                key = None
        return key

    def row(self) -> list[Record]:
        row = self.store.get_run_any(self.run_id) if self.store is not None else None
        if row is None:
            return self.registry_row()
        fields = ("run_id", "thread_id", "tenant", "assistant_id", "workflow", "workflow_version", "request",
                  "seed", "fingerprint", "created_ms")
        run = {k: getattr(row, k) for k in fields}
        out = [Record("run", "run", digest_json(run))]
        command = row.request.get("command") or {}
        if row.approver is not None or "resume" in command:
            approval = {"approver": row.approver, "resume": command.get("resume")}
            out.append(Record("approval", "approval", digest_json(approval)))
        return out

    def registry_row(self) -> list[Record]:
        """The run registry record's identity, as the ``run`` record (none without a registry)."""
        record = self.registry.get(self.run_id) if self.registry is not None else None
        if record is None:
            return []
        return [Record("run", "run", digest_json(record.model_dump(mode="json", include=REGISTRY_FIELDS)))]

    def calls(self) -> list[Record]:
        if self.store is None:
            return []
        return [Record("call", f"call:{c.get('node')}#{c.get('call')}", digest_json(c))
                for c in self.store.calls(self.run_id)]

    def replays(self) -> list[Record]:
        if self.store is None:
            return []
        return [Record("replay", f"replay:{r.get('replay_id')}", digest_json(r))
                for r in self.store.replays(self.run_id)]

    def acceptance(self, after: str | None = None) -> list[Record]:
        rows = read_stream(self.client, self.stream_key, after)
        return [Record("acceptance", f"acc:{eid}", d) for eid, d in rows]

    def checkpoints(self, skip: set[str] | frozenset[str] = frozenset()) -> list[StoredCheckpoint]:
        return read_checkpoints(self.client, self.cp_prefix, self.thread_id, skip=skip)


def foreign_refs(chain: AuditChain, thread_id: str, run_id: str) -> tuple[set[str], set[str]]:
    """(refs, entry hashes) of the thread's other runs' chains: writes they chained are theirs."""
    refs: set[str] = set()
    hashes: set[str] = set()
    for other in chain.runs(thread_id):
        if other != run_id:
            for e in chain.entries(thread_id, other):
                refs.add(e.ref)
                hashes.add(e.hash)
    return refs, hashes


class RunAudit:
    """Chains one run's records as it runs and seals it at the end.

    Where the writers allow it (``begin(config, checkpointer=...)``: a :class:`RedisSaver`, the
    ``ThreadStore`` and the acceptance log of the run), the run's :class:`ChainCursor` is attached to
    them and each record is chained by the call that writes it: checkpoints and pending writes in
    the checkpointer's own script, LLM calls and acceptance entries right after their append. Then
    ``sync`` after a super-step has nothing to read (issue 43's cost goal: the chain's work per
    super-step is digesting the bytes being written). Otherwise (an async saver, a writer without
    hooks) ``sync`` reads what is new and chains it: incremental, it remembers what it chained and
    read, and reads the checkpoint ids of every namespace, the calls and replays lists, the
    acceptance stream after the last chained id and the size of each writes hash already read in
    one pipelined round trip; then the hashes of checkpoints not read yet and the writes hashes that
    grew (one more); then the blobs the new checkpoints reference (one more); then one
    compare-and-append script. The seal always does that read once, so whatever a writer did not
    chain is chained before the head is signed. A retried attempt of the run starts from the stored
    chain; compare-and-append turns a concurrent writer into :class:`StaleHeadError`."""

    def __init__(self, chain: AuditChain, sources: RunSources, *, signer: Signer | None = None) -> None:
        self.chain, self.src = chain, sources
        self.signer = signer
        t, r = sources.thread_id, sources.run_id
        head = chain.head(t, r)
        genesis = chain.genesis(t, r) if head is None else GENESIS
        entries = chain.entries(t, r) if head is not None else []
        acc = [e.ref for e in entries if e.kind == "acceptance"]
        self._acc_after: str | None = acc[-1][4:] if acc else None
        self._foreign, _ = foreign_refs(chain, t, r)
        self.cursor = ChainCursor(chain, t, r, head, genesis=genesis,
                                  chained={e.ref: e.digest for e in entries}, foreign=self._foreign)
        self.genesis = genesis
        self._skip: set[str] = set()
        self._touched: set[str] = set()
        self._keys = K.ThreadKeys.of(sources.cp_prefix, t)
        self._namespaces: list[str] = [K.encode_ns("")]  # the root namespace: read in the first trip
        self._read: dict[tuple[str, str], int] = {}  # checkpoints read (own or touched) -> writes read
        self._lists: dict[bytes, Record] = {}  # call / replay JSON -> its record (digested once)
        self._attached: list[tuple[ChainHooks, str]] = []
        self._in_writers = False
        self.sync_seconds: list[float] = []  # per sync, for the cost benchmark

    @property
    def head(self) -> Head | None:
        return self.cursor.head

    @head.setter
    def head(self, value: Head | None) -> None:
        self.cursor.head = value

    @property
    def chained(self) -> dict[str, str]:
        return self.cursor.chained

    def begin(self, config: Mapping[str, Any], *, checkpointer: Any = None) -> None:
        """Note the checkpoint the run starts from (a fork's, else the thread's newest): its new
        pending writes are this run's. Chain the run's identity, and attach the cursor to the
        writers that chain as they write (``checkpointer``: the graph's saver)."""
        start = (config.get("configurable") or {}).get("checkpoint_id")
        if not start:
            keys = K.ThreadKeys.of(self.src.cp_prefix, self.src.thread_id)
            newest = self.src.client.zrange(keys.idx(K.encode_ns("")), -1, -1)
            start = newest[0].decode() if newest else None
        if start:
            self._touched.add(str(start))
        if "run" not in self.chained:
            self.cursor.append(self.src.row())
        saver_ok = bool(getattr(checkpointer, "chains_in_writer", False))
        writers = [(checkpointer, self.src.thread_id)] if saver_ok else []
        writers += [(w, self.src.run_id) for w in (self.src.store, self.src.acceptance_log) if w is not None]
        for writer, key in writers:
            hooks = getattr(writer, "chains", None)
            if isinstance(hooks, ChainHooks):
                hooks.attach(key, self.cursor)
                self._attached.append((hooks, key))
        self._in_writers = (saver_ok and self.src.acceptance_log is not None
                            and len(self._attached) == 1 + (self.src.store is not None) + 1)

    def close(self) -> None:
        """Detach the cursor from the writers (the run's attempt is over, sealed or not)."""
        for hooks, key in self._attached:
            hooks.detach(key, self.cursor)
        self._attached = []
        self._in_writers = False

    def _list_records(self, kind: str, raws: list[bytes]) -> list[Record]:
        out = []
        for raw in raws:
            rec = self._lists.get(raw)
            if rec is None:
                value = json.loads(raw)
                ref = (f"call:{value.get('node')}#{value.get('call')}" if kind == "call"
                       else f"replay:{value.get('replay_id')}")
                rec = self._lists[raw] = Record(kind, ref, digest_json(value))
            out.append(rec)
        return out

    def pending(self) -> list[Record]:
        """The run's records not chained yet, in chain order (row, checkpoints and writes, calls,
        acceptance entries, replay reports)."""
        src, keys, run_id, out = self.src, self._keys, self.src.run_id, []
        seen = set(self.chained)

        def add(rec: Record) -> None:
            if rec.ref not in seen:
                seen.add(rec.ref)
                out.append(rec)

        if "run" not in self.chained:
            for rec in src.row():
                add(rec)
        # trip 1: namespaces and their ids, sizes of the writes hashes read, calls, replays, acceptance
        known = list(self._read)
        lists = [k for k in ("calls", "replays") if src.list_key(k) is not None]
        pipe = src.client.pipeline(transaction=False)
        pipe.zrange(keys.nss, 0, -1)
        for ns in self._namespaces:
            pipe.zrange(keys.idx(ns), 0, -1)
        for ns, cid in known:
            pipe.hlen(keys.writes(ns, cid))
        for k in lists:
            pipe.lrange(src.list_key(k), 0, -1)
        pipe.xrange(src.stream_key, min=f"({self._acc_after}" if self._acc_after else "-", max="+",
                    count=_STREAM_PAGE)
        replies = iter(pipe.execute())
        namespaces = [ns.decode() for ns in next(replies)]
        id_lists = {ns: next(replies) for ns in self._namespaces}
        sizes = {key: next(replies) for key in known}
        list_rows = {k: next(replies) for k in lists}
        acc_rows = next(replies)
        missing = [ns for ns in namespaces if ns not in id_lists]
        if missing:  # a namespace first seen now (a subgraph's): one more trip for its ids
            pipe = src.client.pipeline(transaction=False)
            for ns in missing:
                pipe.zrange(keys.idx(ns), 0, -1)
            id_lists.update(zip(missing, pipe.execute()))
        self._namespaces = namespaces
        ids = [(ns, cid.decode()) for ns in namespaces for cid in id_lists[ns]]
        # trip 2: the hashes of checkpoints not read yet, and the writes hashes that grew
        new = [(ns, cid) for ns, cid in ids if (ns, cid) not in self._read and cid not in self._skip]
        grown = [key for key in ids if key in self._read and sizes.get(key) != self._read[key]]
        pipe = src.client.pipeline(transaction=False)
        for ns, cid in new:
            pipe.hgetall(keys.checkpoint(ns, cid))
        for ns, cid in [*new, *grown]:
            pipe.hgetall(keys.writes(ns, cid))
        replies = iter(pipe.execute() if new or grown else [])
        fields = {key: next(replies) for key in new}
        writes = {key: next(replies) for key in [*new, *grown]}
        # which new checkpoints are this run's (or the one it started from), as read_checkpoints + pending did
        own: dict[tuple[str, str], list[bytes]] = {}
        for key in new:
            f = fields[key]
            if f.get(b"run_id", b"").decode() == run_id:
                self._touched.add(f.get(b"parent", b"").decode())
                own[key] = blob_fields_of(f)
            elif key[1] not in self._touched:
                self._skip.add(key[1])
        # trip 3: the blobs the run's new checkpoints reference
        wanted = [key for key, names in own.items() if names]
        pipe = src.client.pipeline(transaction=False)
        for ns, cid in wanted:
            pipe.hmget(keys.blobs(ns), own[(ns, cid)])
        blobs = dict(zip(wanted, pipe.execute() if wanted else []))
        for key in ids:
            if key not in writes or key[1] in self._skip:
                continue
            ns, cid = key
            if key in own:
                digest = checkpoint_digest(fields[key], own[key], blobs.get(key, []))
                add(Record("checkpoint", f"cp:{ns}:{cid}", digest))
            labels = write_digests(writes[key])
            self._read[key] = len(writes[key])
            for label in sorted(labels):
                ref = f"w:{ns}:{cid}:{label}"
                if ref not in self._foreign:
                    add(Record("writes", ref, labels[label]))
        listed = set(ids)
        for key in known:  # deleted since (retention): nothing more to read there
            if key not in listed:
                del self._read[key]
        calls = self._list_records("call", list_rows["calls"]) if "calls" in list_rows else src.calls()
        for rec in calls:
            add(rec)
        acc = [(e.decode(), stream_digest(f)) for e, f in acc_rows]
        if len(acc_rows) == _STREAM_PAGE:
            acc += read_stream(src.client, src.stream_key, acc[-1][0])
        for eid, digest in acc:
            add(Record("acceptance", f"acc:{eid}", digest))
            self._acc_after = eid
        replays = (self._list_records("replay", list_rows["replays"]) if "replays" in list_rows
                   else src.replays())
        for rec in replays:
            add(rec)
        return out

    def sync(self) -> int:
        """Chain whatever the run wrote since the last sync and no writer chained; the number of
        entries appended (none to read when the writers chain: see the class docstring)."""
        t0 = time.perf_counter()
        n = 0 if self._in_writers else self._catch_up()
        self.sync_seconds.append(time.perf_counter() - t0)
        return n

    def _catch_up(self) -> int:
        read, after = dict(self._read), self._acc_after  # what was read is kept only once chained
        try:
            n = self.cursor.append(self.pending())
        except BaseException:
            self._read, self._acc_after = read, after
            raise
        return n

    def seal(self, status: str) -> Seal:
        """Chain the last records (reading back what the run stored, once) and sign the head
        (``status``: the run's outcome or a seal status)."""
        self.close()
        self._catch_up()
        signer = self.signer or signer_for()
        return self.chain.seal(self.src.thread_id, self.src.run_id, SEAL_STATUS.get(status, status), signer)


def open_run_audit(client: Any, *, thread_id: str, run_id: str, store: Any = None,
                   cp_prefix: str = K.DEFAULT_PREFIX, acceptance: AcceptanceLog | None = None,
                   settings: Settings | None = None, registry: Any = None,
                   chain_prefix: str = CHAIN_PREFIX) -> RunAudit | None:
    """The run's appender, or None when ``ELESIUM_AUDIT_CHAIN=off``.

    ``registry``: the run registry, for runs without a ``ThreadStore`` row (:class:`RunSources`);
    ``chain_prefix``: the chain's key root (``WorkflowRunner``: ``<its prefix>:audit``, which for the
    default ``elesium`` is the API's)."""
    settings = settings or Settings.from_env()
    if settings.audit_chain == "off":
        return None
    sources = RunSources(client, thread_id=thread_id, run_id=run_id, store=store, cp_prefix=cp_prefix,
                         acceptance=acceptance, registry=registry)
    return RunAudit(AuditChain(client, prefix=chain_prefix), sources, signer=signer_for(settings))


# ---------------------------------------------------------------- verification
class Finding(BaseModel):
    """The first entry (or record, or the seal) that does not verify."""

    model_config = ConfigDict(frozen=True)

    seq: int | None
    kind: str
    ref: str
    reason: str


class AuditVerdict(BaseModel):
    """What verifying a run's chain found; ``ok`` only if every check passed."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    thread_id: str
    ok: bool
    entries_checked: int
    records_checked: int
    sealed: bool
    signed: bool
    signature_ok: bool | None  # None: nothing to check (unsigned or unsealed)
    key_id: str = ""
    first_bad: Finding | None = None
    findings: int = 0
    notes: list[str] = []


def _link_findings(entries: list[ChainEntry], genesis_ok: set[str]) -> list[Finding]:
    out: list[Finding] = []
    for i, e in enumerate(entries):
        if e.seq != i:
            out.append(Finding(seq=i, kind="chain", ref=e.ref,
                               reason=f"entry seq {i} is missing (the next stored entry is seq {e.seq})"))
            return out  # every later link is off by the gap: one finding says it
        if not e.intact:
            out.append(Finding(seq=i, kind=e.kind, ref=e.ref,
                               reason="the entry's hash does not match its fields"))
        prev_ok = e.prev in genesis_ok if i == 0 else e.prev == entries[i - 1].hash
        if not prev_ok:
            what = "an earlier run's head" if i == 0 else "the previous entry's hash"
            out.append(Finding(seq=i, kind=e.kind, ref=e.ref, reason=f"prev is not {what}"))
    return out


def verify_run(client: Any, run_id: str, *, store: Any = None, signer: Signer | None = None,
               cp_prefix: str = K.DEFAULT_PREFIX, acceptance: AcceptanceLog | None = None,
               chain: AuditChain | None = None, registry: Any = None) -> AuditVerdict:
    """Re-read every record of the run, recompute digests and links, check the seal and signature.

    ``registry``: the run registry, for a run without a ``ThreadStore`` row (a ``WorkflowRunner``
    run, whose ``chain`` is then ``AuditChain(client, prefix="<runner prefix>:audit")``).

    Raises:
        KeyError: no such run (neither a run row, a registry record nor a seal names it).
    """
    chain = chain or AuditChain(client)
    row = store.get_run_any(run_id) if store is not None else None
    record = registry.get(run_id) if row is None and registry is not None else None
    seal = chain.get_seal(run_id)
    thread_id = (row.thread_id if row is not None else (record.thread_id or run_id) if record is not None
                 else seal.thread_id if seal is not None else None)
    if thread_id is None:
        raise KeyError(f"no run {run_id!r}")
    signer = signer or signer_for()
    entries = chain.entries(thread_id, run_id)
    foreign, other_hashes = foreign_refs(chain, thread_id, run_id)
    findings = _link_findings(entries, {GENESIS} | other_hashes)
    src = RunSources(client, thread_id=thread_id, run_id=run_id, store=store, cp_prefix=cp_prefix,
                     acceptance=acceptance, registry=registry)
    cps = src.checkpoints()
    at = {(cp.ns, cp.cid): cp for cp in cps}
    required: list[Record] = [*src.row()]  # what must be in the chain (writes: in some run's chain)
    for cp in cps:
        if cp.run_id == run_id:
            required.append(Record("checkpoint", cp.ref, cp.digest))
            required += [Record("writes", cp.write_ref(k), d) for k, d in sorted(cp.writes.items())]
    required += [*src.calls(), *src.acceptance(), *src.replays()]
    by_ref: dict[str, list[str]] = {}
    for rec in required:
        by_ref.setdefault(rec.ref, []).append(rec.digest)
    for e in entries:  # writes this run added to the checkpoint it started from (another run's)
        if e.kind == "writes" and e.ref not in by_ref:
            _, ns, cid, label = e.ref.split(":", 3)
            owner = at.get((ns, cid))
            if owner is not None and label in owner.writes:
                by_ref[e.ref] = [owner.writes[label]]
    for e in entries:
        got = by_ref.get(e.ref)
        if not got:
            findings.append(Finding(seq=e.seq, kind=e.kind, ref=e.ref,
                                    reason="the chained record is missing"))
        elif any(d != e.digest for d in got):
            findings.append(Finding(seq=e.seq, kind=e.kind, ref=e.ref,
                                    reason="the record's content differs from its chained digest"))
    chained = {e.ref for e in entries}
    for ref in dict.fromkeys(r.ref for r in required if r.ref not in chained):
        kind = next(r.kind for r in required if r.ref == ref)
        if kind == "writes" and ref in foreign:
            continue
        findings.append(Finding(seq=None, kind=kind, ref=ref,
                                reason="the record is not in the chain (written after the chain was)"))
    notes: list[str] = []
    sealed, signed, signature_ok = seal is not None, False, None
    seal_findings: list[Finding] = []
    if seal is None:
        ended = (row is not None and row.status in TERMINAL) or (
            record is not None and str(getattr(record.status, "value", record.status)) in REGISTRY_TERMINAL)
        if ended:
            seal_findings.append(Finding(seq=None, kind="seal", ref=run_id,
                                         reason="the run ended but its chain was never sealed"))
        else:
            notes.append("the chain is not sealed (the run has not ended)")
    else:
        signed = seal.alg != "none"
        if not signed:
            notes.append("the seal is unsigned (no ELESIUM_AUDIT_KEY / ELESIUM_AUDIT_SIGNING_KEY_FILE): a "
                         "rewrite of records, chain and seal together cannot be excluded")
        else:
            signature_ok = seal.key_id == signer.key_id and signer.verify(seal.payload(), seal.signature)
            if not signature_ok:
                why = ("does not verify" if seal.key_id == signer.key_id else
                       f"was made with key {seal.key_id or '?'}, not {signer.key_id or 'none'}")
                seal_findings.append(Finding(seq=None, kind="seal", ref=run_id,
                                             reason=f"the seal's signature {why}"))
        head = entries[-1].hash if entries else GENESIS
        if seal.count != len(entries) or seal.head != head:
            seq = min(seal.count, len(entries))
            past = entries[seq] if seq < len(entries) else None
            seal_findings.append(Finding(
                seq=seq, kind=past.kind if past else "chain", ref=past.ref if past else "",
                reason=f"the seal covers {seal.count} entries ending {seal.head[:12]}; the chain has "
                       f"{len(entries)} ending {head[:12]}"))
    findings.sort(key=lambda f: (f.seq is None, f.seq if f.seq is not None else 0))
    ordered = ([f for f in seal_findings if f.reason.startswith("the seal's signature")] + findings
               + [f for f in seal_findings if not f.reason.startswith("the seal's signature")])
    if not entries and not ordered:
        ordered = [Finding(seq=None, kind="chain", ref=run_id, reason="the run has no audit chain")]
    return AuditVerdict(run_id=run_id, thread_id=thread_id, ok=not ordered, entries_checked=len(entries),
                        records_checked=sum(len(v) for v in by_ref.values()), sealed=sealed, signed=signed,
                        signature_ok=signature_ok, key_id=seal.key_id if seal else "",
                        first_bad=ordered[0] if ordered else None, findings=len(ordered), notes=notes)


def chain_replay_reports(client: Any, *, thread_id: str, run_id: str, store: Any,
                         cp_prefix: str = K.DEFAULT_PREFIX) -> int:
    """Chain the run's replay reports not chained yet and renew its seal; the number chained.

    Only reports: a record of another kind that appeared after the run ended is exactly what
    verification must keep failing, so it is never chained late. A run without a chain (recorded
    before chains existed, or with chaining off) is left alone."""
    audit = open_run_audit(client, thread_id=thread_id, run_id=run_id, store=store, cp_prefix=cp_prefix)
    if audit is None or audit.head is None:
        return 0
    records = [r for r in audit.src.replays() if r.ref not in audit.chained]
    if records:
        audit.head = audit.chain.append(thread_id, run_id, audit.head, records)
        seal = audit.chain.get_seal(run_id)
        if seal is not None:
            audit.chain.seal(thread_id, run_id, seal.status, audit.signer or signer_for())
    return len(records)
