"""The hash chain over everything a run writes, and the signed seal of its head.

Why a chain: the run's records (checkpoints and their pending writes, LLM call records, acceptance
entries, the run row's approval, replay reports) are plain Redis values that anyone with the
credentials can rewrite, and replay compares a run with those same values: a consistent rewrite
replays "identical". Each record is therefore chained when it is written: a chain entry holds
(seq, kind, ref, digest, prev, hash), where ``ref`` locates the record, ``digest`` is the SHA-256 of
its canonical content (:func:`digest_json` / :func:`digest_parts`), ``prev`` the previous entry's
hash and ``hash`` the SHA-256 of the canonical JSON of the five others. Rewriting a record changes
its digest; rewriting the entry too changes every later hash; rewriting the whole chain changes
the head, which the seal signs with a key the writer of Redis does not hold.

Scope: one chain per run, whose first entry's ``prev`` is the head of the thread's previous run's
chain (its sealed head) or 64 zeros. A run is the unit the API, retention, replay and the seal deal
in; a thread-wide chain would make a run's verdict depend on later runs and make deleting one run
break every later one. A run retried after a crash keeps its run id and so continues its own chain
(the appender reads the stored head); a resume after an interrupt is a new run, linked to the
interrupted run's head through its genesis, so a thread's runs still form one hash-linked sequence.

Keys (``P = <prefix>:{T}:``, ``{T}`` the thread's tag, the checkpointer's and the thread store's)::

    P chain:<rid>   list    the entries (JSON), seq order
    P head:<rid>    string  "<count>:<hash>" of the last entry: what compare-and-append compares
    P runs          list    the thread's chained run ids, in chain-creation order (genesis lookup)
    <prefix>:seals  hash    run id -> the seal (JSON), outside the runs' keys and slots

Appending is one Lua script over the run's three keys: the caller states the head it extends and a
mismatch is :class:`StaleHeadError`, never a fork. This module stores and signs; what a run's records
are and how they are read back is decided in ``graphs/audit_chain.py``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import redis.exceptions

from elesium.config import Settings
from elesium.state.errors import StateError, translate_errors

DEFAULT_PREFIX = "elesium:audit"
GENESIS = "0" * 64
_BATCH = 500  # entries per script call (Lua's unpack has a stack limit)


class StaleHeadError(StateError):
    """The chain's head is not the one the appender extends (another writer appended first)."""


# ---------------------------------------------------------------- canonical content
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def canonical(value: Any) -> bytes:
    """Sorted-key, compact, UTF-8 JSON: one byte string per JSON value, whoever encodes it."""
    return _CANONICAL.encode(value).encode()  # what json.dumps(value, <the same options>) returns


def digest_json(value: Any) -> str:
    """SHA-256 of a decoded record's canonical JSON (records stored as JSON text)."""
    return hashlib.sha256(canonical(value)).hexdigest()


def digest_parts(parts: Iterable[bytes]) -> str:
    """SHA-256 over byte strings, each length-prefixed so no two sequences collide (stored bytes)."""
    framed = [x for part in parts for x in (len(part).to_bytes(8, "big"), part)]
    return hashlib.sha256(b"".join(framed)).hexdigest()  # one update: what update() per part hashes


@dataclass(frozen=True)
class ChainEntry:
    """One link: which record (``kind``, ``ref``), its content digest, and the links around it."""

    seq: int
    kind: str
    ref: str
    digest: str
    prev: str
    hash: str

    @staticmethod
    def link(seq: int, kind: str, ref: str, digest: str, prev: str) -> str:
        return digest_json([seq, kind, ref, digest, prev])

    @staticmethod
    def fast_link(seq: int, kind: str, ref: str, digest: str, prev: str) -> str:
        """:meth:`link` for an int ``seq`` and hex ``digest``/``prev`` (every appender's case), without
        the general encoder: the writers chain inside the checkpoint write, where microseconds count.
        Equal to :meth:`link` (tested on random input)."""
        text = f'[{seq},{_CANONICAL.encode(kind)},{_CANONICAL.encode(ref)},"{digest}","{prev}"]'
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def make(cls, seq: int, kind: str, ref: str, digest: str, prev: str) -> ChainEntry:
        return cls(seq, kind, ref, digest, prev, cls.fast_link(seq, kind, ref, digest, prev))

    @property
    def intact(self) -> bool:
        """Whether ``hash`` is the hash of the other fields (the entry itself was not edited)."""
        return self.hash == self.link(self.seq, self.kind, self.ref, self.digest, self.prev)

    def to_json(self) -> str:
        return _COMPACT.encode({"seq": self.seq, "kind": self.kind, "ref": self.ref, "digest": self.digest,
                                "prev": self.prev, "hash": self.hash})

    def fast_json(self) -> str:
        """:meth:`to_json` for hex ``digest``/``prev``/``hash`` (equal to it: tested on random input)."""
        return (f'{{"seq":{self.seq},"kind":{_COMPACT.encode(self.kind)},"ref":{_COMPACT.encode(self.ref)},'
                f'"digest":"{self.digest}","prev":"{self.prev}","hash":"{self.hash}"}}')

    @classmethod
    def from_json(cls, raw: bytes | str) -> ChainEntry:
        d = json.loads(raw)
        return cls(int(d["seq"]), str(d["kind"]), str(d["ref"]), str(d["digest"]), str(d["prev"]),
                   str(d["hash"]))


@dataclass(frozen=True)
class Head:
    count: int
    hash: str

    def encode(self) -> str:
        return f"{self.count}:{self.hash}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Head:
        text = raw.decode() if isinstance(raw, bytes) else raw
        count, _, digest = text.partition(":")
        return cls(int(count), digest)


# ---------------------------------------------------------------- seals and signers
@dataclass(frozen=True)
class Seal:
    """A finished run's head, signed (``alg`` "none": unsigned, ``signature`` empty)."""

    run_id: str
    thread_id: str
    head: str
    count: int
    status: str
    sealed_at: float
    key_id: str
    alg: str
    signature: str

    def payload(self) -> bytes:
        """What is signed: every field but the signature, canonically."""
        d = asdict(self)
        d.pop("signature")
        return canonical(d)


class Signer(Protocol):
    alg: str
    key_id: str

    def sign(self, payload: bytes) -> str: ...

    def verify(self, payload: bytes, signature: str) -> bool: ...


class Unsigned:
    """No key configured: seals carry no signature, and a verdict says a rewrite cannot be excluded."""

    alg, key_id = "none", ""

    def sign(self, payload: bytes) -> str:
        return ""

    def verify(self, payload: bytes, signature: str) -> bool:
        return False


class HmacSigner:
    """HMAC-SHA256 with a shared secret; ``key_id`` names the key without revealing it."""

    alg = "hmac-sha256"

    def __init__(self, key: str | bytes) -> None:
        self._key = key.encode() if isinstance(key, str) else key
        self.key_id = "hmac:" + hashlib.sha256(b"elesium-audit-key-id\0" + self._key).hexdigest()[:16]

    def sign(self, payload: bytes) -> str:
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()

    def verify(self, payload: bytes, signature: str) -> bool:
        return hmac.compare_digest(self.sign(payload), signature)


class Ed25519Signer:
    """Ed25519 from a PEM private key (``cryptography``): verifying needs only the public half."""

    alg = "ed25519"

    def __init__(self, pem: bytes) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise StateError("ELESIUM_AUDIT_SIGNING_KEY_FILE must hold an Ed25519 private key (PEM, "
                             "e.g. `openssl genpkey -algorithm ed25519`)")
        self._key = key
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_id = "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]

    def sign(self, payload: bytes) -> str:
        return base64.b64encode(self._key.sign(payload)).decode()

    def verify(self, payload: bytes, signature: str) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.public_key().verify(base64.b64decode(signature), payload)
        except (InvalidSignature, ValueError):
            return False
        return True


def signer_for(settings: Settings | None = None) -> Signer:
    """The configured signer: the Ed25519 key file, else the HMAC key, else :class:`Unsigned`."""
    settings = settings or Settings.from_env()
    if settings.audit_signing_key_file is not None:
        try:
            pem = Path(settings.audit_signing_key_file).read_bytes()
        except OSError as exc:
            raise StateError(f"cannot read ELESIUM_AUDIT_SIGNING_KEY_FILE: {exc}") from None
        return Ed25519Signer(pem)
    if settings.audit_key:
        return HmacSigner(settings.audit_key)
    return Unsigned()


# ---------------------------------------------------------------- the store
# KEYS: chain list, head, thread run index. ARGV: expected head ('' = no chain yet), new head, run id,
# entries (JSON). One script: the head compared and moved, the entries pushed, atomically.
_APPEND = r"""
local cur = redis.call('GET', KEYS[2]) or ''
if cur ~= ARGV[1] then
  return redis.error_reply('STALEHEAD the chain head is ' .. (cur == '' and 'absent' or cur))
end
if cur == '' then redis.call('RPUSH', KEYS[3], ARGV[3]) end
if #ARGV > 3 then redis.call('RPUSH', KEYS[1], unpack(ARGV, 4)) end
redis.call('SET', KEYS[2], ARGV[2])
return #ARGV - 3
"""


# A writer's own script, chained: the writer's KEYS and ARGV, then the chain's three keys and
# (expected head, new head, run id, entries..., entry count) appended; :func:`chained_script` wraps
# the writer's Lua so the head is compared before anything is written and the entries are pushed
# after it, in the same atomic call. ``chain_ok`` (a precheck may clear it) says whether they are.
_CHAINED_PRELUDE = r"""
local n_entries = tonumber(ARGV[#ARGV])
local base_n = #ARGV - n_entries - 4
local chain_keys = {KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]}
local stated, new_head, chain_run = ARGV[base_n + 1], ARGV[base_n + 2], ARGV[base_n + 3]
local cur = redis.call('GET', chain_keys[2]) or ''
if cur ~= stated then
  return redis.error_reply('STALEHEAD the chain head is ' .. (cur == '' and 'absent' or cur))
end
local chain_entries = {unpack(ARGV, base_n + 4, base_n + 3 + n_entries)}
local KEYS = {unpack(KEYS, 1, #KEYS - 3)}
local ARGV = {unpack(ARGV, 1, base_n)}
local chain_ok = true
"""

_CHAINED_TAIL = r"""
if not chain_ok then return 0 end
if cur == '' then redis.call('RPUSH', chain_keys[3], chain_run) end
redis.call('RPUSH', chain_keys[1], unpack(chain_entries))
redis.call('SET', chain_keys[2], new_head)
return 1
"""
MAX_CHAINED = 200
"""Entries one writer's script chains at most (Lua's unpack); a bigger write chains them apart."""


def chained_script(body: str, *, helpers: str = "", precheck: str = "") -> str:
    """``body`` (a writer's script, which may ``return``) run between the head check and the append.

    ``helpers``: Lua defined before it (local functions the body calls); ``precheck``: Lua run after
    the head check and before the body, which may set ``chain_ok = false`` (the writer writes, the
    entries are not pushed, the script returns 0 and the caller leaves those records unchained)."""
    return (helpers + _CHAINED_PRELUDE + precheck + "\nlocal function body()\n" + body + "\nend\nbody()\n"
            + _CHAINED_TAIL)


class ChainCursor:
    """One run's chain head, held by the process running the run and shared by its writers.

    Why: chaining after the fact means reading back what was just written (round trips that cost
    as much as the checkpoint write itself). A writer that holds the cursor digests the bytes it is
    about to write and pushes their entries in the same script as the write (:func:`chained_script`,
    the keys share the thread's hash tag), or right after it for records in another slot (the
    acceptance stream). The lock orders the run's writers (parallel tasks write at once); the script
    still compares the stored head, so a second process extending the chain is
    :class:`StaleHeadError`, never a fork.

    ``chained``: ref -> digest of every entry of the chain (shared with ``RunAudit``, which chains at
    the seal whatever no writer did); ``foreign``: refs other runs of the thread chained (writes on
    their checkpoints stay theirs); ``blobs``: the newest stored bytes of each (namespace, channel),
    which every later checkpoint's digest includes until the channel changes.
    """

    def __init__(self, chain: AuditChain, thread_id: str, run_id: str, head: Head | None, *,
                 genesis: str = GENESIS, chained: dict[str, str] | None = None,
                 foreign: set[str] | None = None) -> None:
        self.chain, self.thread_id, self.run_id = chain, thread_id, run_id
        self.head, self.genesis = head, genesis
        self.chained: dict[str, str] = chained if chained is not None else {}
        self.foreign: set[str] = foreign if foreign is not None else set()
        self.blobs: dict[tuple[str, str], tuple[bytes, bytes | None]] = {}  # (ns, channel) -> (field, bytes)
        self.lock = threading.Lock()
        self.keys = [chain.key(thread_id, "chain", run_id), chain.key(thread_id, "head", run_id),
                     chain.key(thread_id, "runs")]
        self.deferred: list[tuple[str, str, str]] = []  # stored, chained with the next append

    def defer(self, records: Sequence[tuple[str, str, str]]) -> None:
        """Chain ``records`` (already stored) with the next append: the next checkpoint's script, a
        call's or the seal's. Pending writes take this way: one chain push a super-step, not one per
        task (a crash in between leaves them to the retried attempt's seal, which reads them back)."""
        if records:
            with self.lock:
                self.deferred.extend(records)

    def wanted(self, records: Sequence[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
        """The records not chained yet (by this run or, for writes, by another)."""
        seen: set[str] = set()
        out = []
        for rec in records:
            ref = rec[1]
            if ref in self.chained or ref in seen or (rec[0] == "writes" and ref in self.foreign):
                continue
            seen.add(ref)
            out.append(rec)
        return out

    def _tail(self, records: Sequence[tuple[str, str, str]]) -> tuple[list[Any], Head]:
        head = self.head or Head(0, self.genesis)
        prev, seq, entries = head.hash, head.count, []
        for kind, ref, digest in records:
            entry = ChainEntry.make(seq, kind, ref, digest, prev)
            entries.append(entry.fast_json())
            prev, seq = entry.hash, seq + 1
        new = Head(seq, prev)
        stated = "" if self.head is None else self.head.encode()
        return [stated, new.encode(), self.run_id, *entries, len(entries)], new

    def _stale(self, exc: redis.exceptions.ResponseError) -> Exception:
        if "STALEHEAD" in str(exc):
            stated = self.head.encode() if self.head else "absent"
            return StaleHeadError(f"run {self.run_id}: {str(exc).partition(' ')[2]}, not {stated}; "
                                  "another writer extended it")
        return exc

    def run_chained(self, plain: Any, chained: Any, keys: list[Any], args: list[Any],
                    records: Sequence[tuple[str, str, str]]) -> Any:
        """Run a writer's script with ``records`` chained in the same call (``plain``: the script
        without the chain, when nothing is left to chain). Returns the plain script's reply, or
        whether the records were chained (1 / 0) for the chained one."""
        with self.lock:
            todo = self.wanted([*self.deferred, *records])
            if not todo or len(todo) > MAX_CHAINED:
                reply = plain(keys=keys, args=args)
                if todo:
                    self._append_locked(todo)
                self.deferred = []
                return reply
            tail, new = self._tail(todo)
            try:
                reply = chained(keys=[*keys, *self.keys], args=[*args, *tail])
            except redis.exceptions.ResponseError as exc:
                raise self._stale(exc) from None
            if reply:
                self.head = new
                self.chained.update((ref, digest) for _, ref, digest in todo)
                self.deferred = []
            return reply

    def append(self, records: Sequence[tuple[str, str, str]] = ()) -> int:
        """Chain records written elsewhere (another slot), after the deferred ones; the number chained."""
        with self.lock:
            n = self._append_locked(self.wanted([*self.deferred, *records]))
            self.deferred = []
            return n

    def _append_locked(self, todo: list[tuple[str, str, str]]) -> int:
        if todo:
            self.head = self.chain.append(self.thread_id, self.run_id, self.head, todo, genesis=self.genesis)
            self.chained.update((ref, digest) for _, ref, digest in todo)
        return len(todo)


class ChainHooks:
    """The cursors attached to one writer (a checkpointer, a store, a log), by the id it is keyed on
    (a thread id for the checkpointer, a run id for the others). A writer with no cursor for an id
    writes as before; the run's ``RunAudit`` chains its records at the seal."""

    def __init__(self) -> None:
        self._cursors: dict[str, ChainCursor] = {}

    def attach(self, key: str, cursor: ChainCursor) -> None:
        self._cursors[key] = cursor

    def detach(self, key: str, cursor: ChainCursor) -> None:
        if self._cursors.get(key) is cursor:
            del self._cursors[key]

    def get(self, key: str) -> ChainCursor | None:
        return self._cursors.get(key) if self._cursors else None


class AuditChain:
    """Per-run hash chains and their seals (module docstring).

    Args:
        client: a synchronous ``redis.Redis`` / ``RedisCluster`` (bytes replies).
        prefix: key root.
    """

    def __init__(self, client: Any, *, prefix: str = DEFAULT_PREFIX, target: str = "the configured server"):
        self.client = client
        self.prefix = prefix
        self._target = target
        self._append = client.register_script(_APPEND)

    def key(self, thread_id: str, kind: str, run_id: str | None = None) -> str:
        tail = "" if run_id is None else ":" + quote(run_id, safe="")
        return f"{self.prefix}:{{{quote(thread_id, safe='') or '%'}}}:{kind}{tail}"

    @property
    def seals_key(self) -> str:
        return f"{self.prefix}:seals"

    def _guard(self) -> Any:
        return translate_errors(f"the audit chain keys {self.prefix}:*", self._target)

    # -- reading
    def head(self, thread_id: str, run_id: str) -> Head | None:
        with self._guard():
            raw = self.client.get(self.key(thread_id, "head", run_id))
        return Head.decode(raw) if raw else None

    def entries(self, thread_id: str, run_id: str) -> list[ChainEntry]:
        with self._guard():
            rows = self.client.lrange(self.key(thread_id, "chain", run_id), 0, -1)
        return [ChainEntry.from_json(r) for r in rows]

    def runs(self, thread_id: str) -> list[str]:
        """The thread's chained runs, in the order their chains began."""
        with self._guard():
            return [r.decode() for r in self.client.lrange(self.key(thread_id, "runs"), 0, -1)]

    def genesis(self, thread_id: str, run_id: str) -> str:
        """Where a new chain of ``run_id`` starts: the head of the thread's latest other chained run."""
        for other in reversed(self.runs(thread_id)):
            if other != run_id:
                head = self.head(thread_id, other)
                return head.hash if head else GENESIS
        return GENESIS

    # -- writing
    def append(self, thread_id: str, run_id: str, expected: Head | None,
               records: Sequence[tuple[str, str, str]], *, genesis: str = GENESIS) -> Head:
        """Chain ``records`` ((kind, ref, digest) each) after ``expected`` (None: the chain must not
        exist yet; its first entry links to ``genesis``). Returns the new head.

        Raises:
            StaleHeadError: the stored head is not ``expected``.
        """
        head = expected or Head(0, genesis)
        if not records:
            return head
        for start in range(0, len(records), _BATCH):
            batch, entries = records[start : start + _BATCH], []
            prev, seq = head.hash, head.count
            for kind, ref, digest in batch:
                entry = ChainEntry.make(seq, kind, ref, digest, prev)
                entries.append(entry.to_json())
                prev, seq = entry.hash, seq + 1
            new = Head(seq, prev)
            keys = [self.key(thread_id, "chain", run_id), self.key(thread_id, "head", run_id),
                    self.key(thread_id, "runs")]
            stated = "" if expected is None and start == 0 else head.encode()
            try:
                with self._guard():
                    self._append(keys=keys, args=[stated, new.encode(), run_id, *entries])
            except redis.exceptions.ResponseError as exc:
                if "STALEHEAD" in str(exc):
                    raise StaleHeadError(f"run {run_id}: {str(exc).partition(' ')[2]}, not "
                                         f"{stated or 'absent'}; another writer extended it") from None
                raise
            head = new
        return head

    def seal(self, thread_id: str, run_id: str, status: str, signer: Signer) -> Seal:
        """Sign the run's current head and store it in the seals hash (a later seal replaces it)."""
        head = self.head(thread_id, run_id) or Head(0, GENESIS)
        unsigned = Seal(run_id, thread_id, head.hash, head.count, status, round(time.time(), 3),
                        signer.key_id, signer.alg, "")
        seal = Seal(**{**asdict(unsigned), "signature": signer.sign(unsigned.payload())})
        with self._guard():
            self.client.hset(self.seals_key, run_id, json.dumps(asdict(seal), separators=(",", ":")))
        return seal

    def get_seal(self, run_id: str) -> Seal | None:
        with self._guard():
            raw = self.client.hget(self.seals_key, run_id)
        if raw is None:
            return None
        d = json.loads(raw)
        return Seal(str(d["run_id"]), str(d["thread_id"]), str(d["head"]), int(d["count"]), str(d["status"]),
                    float(d["sealed_at"]), str(d["key_id"]), str(d["alg"]), str(d["signature"]))

    # -- retention
    def delete(self, thread_id: str, run_id: str) -> None:
        """Remove one run's chain, head, index entry and seal (retention's purge)."""
        with self._guard():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.key(thread_id, "chain", run_id), self.key(thread_id, "head", run_id))
            pipe.lrem(self.key(thread_id, "runs"), 0, run_id)
            pipe.execute()
            self.client.hdel(self.seals_key, run_id)

    def delete_thread(self, thread_id: str) -> list[str]:
        """Remove every chain of the thread and their seals; returns the run ids removed."""
        run_ids = self.runs(thread_id)
        with self._guard():
            pipe = self.client.pipeline(transaction=True)
            for rid in run_ids:
                pipe.delete(self.key(thread_id, "chain", rid), self.key(thread_id, "head", rid))
            pipe.delete(self.key(thread_id, "runs"))
            pipe.execute()
            if run_ids:
                self.client.hdel(self.seals_key, *run_ids)
        return run_ids
