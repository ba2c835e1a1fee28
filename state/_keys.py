"""Key layout, value codec and Lua scripts of the Redis checkpointer.

Why this layout: only plain hashes, sorted sets and strings exist on every managed Redis (no
RedisJSON, no RediSearch), and a cluster only runs a multi-key script or transaction when all keys
hash to one slot. So every key of a thread embeds the thread id as the hash tag ``{thread}``, and
each mutation is one Lua script over that thread's keys (atomic, one round trip, slot-local).

For a thread ``T`` and namespace ``N`` (both %-encoded, so braces and colons in ids cannot break
the tag or the key structure), with ``P = <prefix>:{T}:``::

    P nss                 zset   namespaces of the thread (members: encoded N)
    P i:N                 zset   checkpoint ids, all score 0: lexicographic order = uuid6 time order
    P c:N:<id>            hash   checkpoint (typed bytes), metadata (typed bytes), parent id,
                                 run_id, and b:<channel> -> version for every channel it references
    P b:N                 hash   channel blobs: "<channel>\\0<version>" -> typed bytes
    P w:N:<id>            hash   pending writes: "<task_id>\\0<idx>" -> (task_path, channel, value)

Channel values are stored once per (channel, version) in ``b:N``, not per checkpoint, so a
super-step that changes one channel writes one blob. Retention therefore has to garbage-collect
blobs that no surviving checkpoint references; the ``b:`` fields in each checkpoint hash are what
makes that possible inside the script.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from urllib.parse import quote, unquote

from elesium.state.audit_chain import chained_script

DEFAULT_PREFIX = "elesium:cp"


_EMPTY_TAG = "%"  # quote() never emits a lone '%', so this cannot collide with a real id


def _enc(part: str) -> str:
    return quote(part, safe="")


@dataclass(frozen=True)
class ThreadKeys:
    """The keys of one thread. ``prefix`` ends with ':' and is what the scripts extend."""

    prefix: str

    @classmethod
    def of(cls, root: str, thread_id: str) -> ThreadKeys:
        # An empty tag "{}" would hash the whole key, scattering the thread over slots.
        return cls(f"{root}:{{{_enc(str(thread_id)) or _EMPTY_TAG}}}:")

    @property
    def nss(self) -> str:
        return self.prefix + "nss"

    def idx(self, ns_enc: str) -> str:
        return f"{self.prefix}i:{ns_enc}"

    def checkpoint(self, ns_enc: str, checkpoint_id: str) -> str:
        return f"{self.prefix}c:{ns_enc}:{checkpoint_id}"

    def blobs(self, ns_enc: str) -> str:
        return f"{self.prefix}b:{ns_enc}"

    def writes(self, ns_enc: str, checkpoint_id: str) -> str:
        return f"{self.prefix}w:{ns_enc}:{checkpoint_id}"


def encode_ns(checkpoint_ns: str) -> str:
    return _enc(checkpoint_ns)


def decode_ns(ns_enc: bytes | str) -> str:
    return unquote(ns_enc.decode() if isinstance(ns_enc, bytes) else ns_enc)


def thread_from_nss_key(root: str, key: bytes | str) -> str:
    """Invert :attr:`ThreadKeys.nss` (used when listing every thread)."""
    text = key.decode() if isinstance(key, bytes) else key
    inner = text[len(root) + 2 : -len("}:nss")]
    return "" if inner == _EMPTY_TAG else unquote(inner)


def nss_pattern(root: str) -> str:
    return f"{root}:{{*}}:nss"


# ---------------------------------------------------------------- value codec
def pack_typed(typed: tuple[str, bytes]) -> bytes:
    """(serde type, payload) -> one bytes value: the type name, NUL, the payload."""
    return typed[0].encode() + b"\x00" + typed[1]


def unpack_typed(raw: bytes) -> tuple[str, bytes]:
    kind, _, payload = raw.partition(b"\x00")
    return kind.decode(), payload


def pack_write(task_path: str, channel: str, typed: tuple[str, bytes]) -> bytes:
    """Length-prefixed, so any byte may appear in a path or channel name."""
    path_b, chan_b = task_path.encode(), channel.encode()
    return struct.pack(">II", len(path_b), len(chan_b)) + path_b + chan_b + pack_typed(typed)


def unpack_write(raw: bytes) -> tuple[str, str, tuple[str, bytes]]:
    n_path, n_chan = struct.unpack_from(">II", raw)
    start = 8
    path = raw[start : start + n_path].decode()
    chan = raw[start + n_path : start + n_path + n_chan].decode()
    return path, chan, unpack_typed(raw[start + n_path + n_chan :])


def write_field(task_id: str, idx: int) -> bytes:
    return f"{task_id}\x00{idx}".encode()


def parse_write_field(raw: bytes) -> tuple[str, int]:
    task_id, _, idx = raw.decode().rpartition("\x00")
    return task_id, int(idx)


def blob_field(channel: str, version: str) -> bytes:
    return f"{channel}\x00{version}".encode()


# ---------------------------------------------------------------- Lua
# Scripts touch keys derived from ARGV prefixes besides their declared KEYS; all of them carry
# the same {thread} tag, so they live in the declared keys' slot and cluster mode accepts them.
_LUA_HELPERS = r"""
local function drop_ns(prefix, ns)
  local idx = prefix .. 'i:' .. ns
  for _, cid in ipairs(redis.call('ZRANGE', idx, 0, -1)) do
    redis.call('DEL', prefix .. 'c:' .. ns .. ':' .. cid, prefix .. 'w:' .. ns .. ':' .. cid)
  end
  redis.call('DEL', idx, prefix .. 'b:' .. ns)
end

local function trim_ns(prefix, ns, keep)
  local idx = prefix .. 'i:' .. ns
  local n = redis.call('ZCARD', idx)
  if n <= keep then return 0 end
  local old = redis.call('ZRANGE', idx, 0, n - keep - 1)
  for _, cid in ipairs(old) do
    redis.call('DEL', prefix .. 'c:' .. ns .. ':' .. cid, prefix .. 'w:' .. ns .. ':' .. cid)
  end
  redis.call('ZREMRANGEBYRANK', idx, 0, n - keep - 1)
  local live = {}
  for _, cid in ipairs(redis.call('ZRANGE', idx, 0, -1)) do
    local h = redis.call('HGETALL', prefix .. 'c:' .. ns .. ':' .. cid)
    for i = 1, #h, 2 do
      if string.sub(h[i], 1, 2) == 'b:' then live[string.sub(h[i], 3) .. '\0' .. h[i + 1]] = true end
    end
  end
  local blobs = prefix .. 'b:' .. ns
  local dead = {}
  for _, f in ipairs(redis.call('HKEYS', blobs)) do
    if not live[f] then dead[#dead + 1] = f end
  end
  for i = 1, #dead, 500 do
    redis.call('HDEL', blobs, unpack(dead, i, math.min(i + 499, #dead)))
  end
  return #old
end
"""

# KEYS: nss, idx, checkpoint hash, blobs.
# ARGV: ns, checkpoint id, ttl_s, keep_last, thread prefix, n (#checkpoint-hash args), the n
# checkpoint-hash field/value args, then blob field/value pairs.
PUT_BODY = r"""
local ttl, keep, n = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6])
redis.call('ZADD', KEYS[1], 0, ARGV[1])
redis.call('ZADD', KEYS[2], 0, ARGV[2])
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], unpack(ARGV, 7, 6 + n))
if #ARGV > 6 + n then redis.call('HSET', KEYS[4], unpack(ARGV, 7 + n, #ARGV)) end
if ttl > 0 then
  for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ttl) end
end
if keep > 0 then trim_ns(ARGV[5], ARGV[1], keep) end
return 1
"""
PUT = _LUA_HELPERS + PUT_BODY

# KEYS: writes hash. ARGV: ttl_s, then (mode, field, value) triples; mode 'n' keeps an existing
# field (regular writes are idempotent per (task, idx)), 's' overwrites (special channels).
# Returns, per triple, 1 if its value is now stored, 0 if an earlier one was kept (the audit chain
# digests only what is stored).
PUT_WRITES = r"""
local stored = {}
for i = 2, #ARGV, 3 do
  if ARGV[i] == 'n' then stored[#stored + 1] = redis.call('HSETNX', KEYS[1], ARGV[i + 1], ARGV[i + 2])
  else redis.call('HSET', KEYS[1], ARGV[i + 1], ARGV[i + 2]); stored[#stored + 1] = 1 end
end
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return stored
"""

# KEYS: idx, blobs. ARGV: thread prefix, ns, mode ('id' | 'page'), id-or-before, count.
# Returns {scanned, last_scanned_id, entries}; entry = {id, checkpoint hash, writes hash, blobs}.
READ = r"""
local prefix, ns, ids = ARGV[1], ARGV[2], nil
if ARGV[3] == 'id' then
  if ARGV[4] == '' then ids = redis.call('ZREVRANGE', KEYS[1], 0, 0) else ids = {ARGV[4]} end
else
  local max = '+'
  if ARGV[4] ~= '' then max = '(' .. ARGV[4] end
  ids = redis.call('ZREVRANGEBYLEX', KEYS[1], max, '-', 'LIMIT', 0, tonumber(ARGV[5]))
end
local out = {}
for _, cid in ipairs(ids) do
  local h = redis.call('HGETALL', prefix .. 'c:' .. ns .. ':' .. cid)
  if #h > 0 then
    local fields, vals = {}, {}
    for i = 1, #h, 2 do
      if string.sub(h[i], 1, 2) == 'b:' then fields[#fields + 1] = string.sub(h[i], 3) .. '\0' .. h[i + 1] end
    end
    if #fields > 0 then
      local got = redis.call('HMGET', KEYS[2], unpack(fields))
      for i = 1, #fields do
        if got[i] then vals[#vals + 1] = fields[i]; vals[#vals + 1] = got[i] end
      end
    end
    out[#out + 1] = {cid, h, redis.call('HGETALL', prefix .. 'w:' .. ns .. ':' .. cid), vals}
  end
end
return {#ids, ids[#ids] or '', out}
"""

# KEYS: nss. ARGV: thread prefix, keep (0 = delete everything of the thread).
PRUNE = _LUA_HELPERS + r"""
local keep = tonumber(ARGV[2])
for _, ns in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if keep == 0 then drop_ns(ARGV[1], ns) else trim_ns(ARGV[1], ns, keep) end
end
if keep == 0 then redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS: nss. ARGV: thread prefix. Returns {ns, blobs hash, {{id, checkpoint hash, writes}...}}...
DUMP = r"""
local out = {}
for _, ns in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local cps = {}
  for _, cid in ipairs(redis.call('ZRANGE', ARGV[1] .. 'i:' .. ns, 0, -1)) do
    cps[#cps + 1] = {cid, redis.call('HGETALL', ARGV[1] .. 'c:' .. ns .. ':' .. cid),
                     redis.call('HGETALL', ARGV[1] .. 'w:' .. ns .. ':' .. cid)}
  end
  out[#out + 1] = {ns, redis.call('HGETALL', ARGV[1] .. 'b:' .. ns), cps}
end
return out
"""

# KEYS: nss. ARGV: thread prefix, then run ids. Deletes the thread's checkpoints of those runs.
DELETE_RUNS = r"""
local runs = {}
for i = 2, #ARGV do runs[ARGV[i]] = true end
local deleted = 0
for _, ns in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local idx = ARGV[1] .. 'i:' .. ns
  for _, cid in ipairs(redis.call('ZRANGE', idx, 0, -1)) do
    local key = ARGV[1] .. 'c:' .. ns .. ':' .. cid
    local run = redis.call('HGET', key, 'run_id')
    if run and runs[run] then
      redis.call('DEL', key, ARGV[1] .. 'w:' .. ns .. ':' .. cid)
      redis.call('ZREM', idx, cid)
      deleted = deleted + 1
    end
  end
end
return deleted
"""

SCRIPTS: dict[str, str] = {
    "put": PUT,
    "put_writes": PUT_WRITES,
    # The same write with the run's audit-chain entries pushed in the same call: the checkpoint's
    # and those of the pending writes stored since the last one (state/audit_chain.py).
    "put_chained": chained_script(PUT_BODY, helpers=_LUA_HELPERS),
    "read": READ,
    "prune": PRUNE,
    "dump": DUMP,
    "delete_runs": DELETE_RUNS,
}
