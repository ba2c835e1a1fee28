"""The audit chain written by the writers themselves (issue 43's cost goal), on real Redis.

A run's ``ChainCursor`` attached to the checkpointer, the acceptance log and the thread store makes
each of them chain what it writes: a checkpoint, and the pending writes stored since the previous
one, inside the checkpointer's own script; calls and acceptance entries right after their append.
Checked here: every digest a writer
chains is the one ``verify_run`` recomputes from what Redis holds (plain and fenced saver); a stale
head refuses the write itself (nothing half-written); a regular write that was already stored keeps
its old value and is left to the seal, not chained with the new value's digest; a run driven
through ``drive`` is chained as it goes, reads nothing back until its seal, verifies clean, and an
edited checkpoint is still named.
"""

from __future__ import annotations

import hashlib
import operator
import uuid
from typing import Annotated, Any, TypedDict

import pytest
import redis

pytest_plugins = ["state_fixtures"]


def _saver(client: redis.Redis, prefix: str, fenced: bool) -> Any:
    from elesium.state import RedisSaver
    from elesium.state.fenced import FencedSaver

    if not fenced:
        return RedisSaver(client, prefix=prefix + ":cp")
    fence = f"{prefix}:fence:{{t}}"
    client.set(fence, "7")
    return FencedSaver(client, prefix=prefix + ":cp", fence_key=fence, token=7)


def _cursor(client: redis.Redis, prefix: str, thread_id: str, run_id: str) -> Any:
    from elesium.state.audit_chain import AuditChain, ChainCursor

    chain = AuditChain(client, prefix=prefix + ":audit")
    return chain, ChainCursor(chain, thread_id, run_id, chain.head(thread_id, run_id))


def test_fast_entry_encoding_equals_the_reference():
    import random
    import string

    from elesium.state.audit_chain import ChainEntry, digest_parts

    rng = random.Random(43)
    alphabet = string.printable + "éß\u2028\"\\{}\x00\x7f€😀"
    for _ in range(500):
        ref = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        kind = rng.choice(["checkpoint", "writes", "call", "acceptance", "run", "ké\"y"])
        digest = rng.choice(["", "%064x" % rng.getrandbits(256)])
        prev = "%064x" % rng.getrandbits(256)
        seq = rng.randrange(0, 10**9)
        fast = ChainEntry.fast_link(seq, kind, ref, digest, prev)
        assert fast == ChainEntry.link(seq, kind, ref, digest, prev)
        e = ChainEntry.make(seq, kind, ref, digest, prev)
        assert e.intact and e.fast_json() == e.to_json() and ChainEntry.from_json(e.fast_json()) == e
    for _ in range(200):  # digest_parts hashes one joined buffer: the bytes the per-part updates hash
        parts = [rng.randbytes(rng.choice([0, 1, 7, 300, 5000])) for _ in range(rng.randrange(0, 12))]
        h = hashlib.sha256()
        for part in parts:
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        assert digest_parts(parts) == h.hexdigest()


def _checkpoint(cid: str, values: dict[str, Any], versions: dict[str, str]) -> dict[str, Any]:
    from langgraph.checkpoint.base import empty_checkpoint

    cp = empty_checkpoint()
    cp.update(id=cid, channel_values=values, channel_versions=versions)
    return cp


@pytest.mark.parametrize("fenced", [False, True], ids=["plain", "fenced"])
def test_writer_digests_are_what_verification_recomputes(redis_url, key_prefix, fenced):
    from elesium.state import _keys as K
    from elesium.state.audit_records import read_checkpoints

    client = redis.Redis.from_url(redis_url)
    saver = _saver(client, key_prefix, fenced)
    chain, cursor = _cursor(client, key_prefix, "t", "r1")
    saver.chains.attach("t", cursor)
    conf = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    meta = {"run_id": "r1", "source": "loop", "step": 0}
    # The first checkpoint writes both channels; the second changes only "b", so its digest needs
    # "a"'s blob from the first write (held by the cursor, not read back).
    c1 = saver.put(conf, _checkpoint("1", {"a": [1, 2], "b": "x"}, {"a": "1", "b": "1"}), meta,
                   {"a": "1", "b": "1"})
    saver.put_writes(c1, [("a", [3]), ("b", "y")], "task-1")
    c2 = saver.put(c1, _checkpoint("2", {"a": [1, 2], "b": "z"}, {"a": "1", "b": "2"}), {**meta, "step": 1},
                   {"b": "2"})
    saver.put_writes(c2, [("b", "w")], "task-2", "path")
    # A checkpoint another run wrote is not this run's to chain.
    saver.put(c2, _checkpoint("3", {"b": "q"}, {"b": "3"}), {"run_id": "other", "step": 2}, {"b": "3"})
    assert len(cursor.deferred) == 1  # task-2's write waits for the run's next checkpoint, call or seal
    cursor.append()

    entries = chain.entries("t", "r1")
    by_ref = {e.ref: e.digest for e in entries}
    stored = {cp.cid: cp for cp in read_checkpoints(client, key_prefix + ":cp", "t")}
    ns = K.encode_ns("")
    expected = {f"cp:{ns}:1": stored["1"].digest, f"cp:{ns}:2": stored["2"].digest}
    for cid in ("1", "2"):
        expected.update({stored[cid].write_ref(label): d for label, d in stored[cid].writes.items()})
    assert by_ref == expected
    assert len(entries) == 5 and cursor.head.count == 5 and chain.head("t", "r1") == cursor.head
    assert [e.prev for e in entries[1:]] == [e.hash for e in entries[:-1]] and all(e.intact for e in entries)


def test_a_stale_head_refuses_the_write_itself(redis_url, key_prefix):
    from elesium.state.audit_chain import StaleHeadError

    client = redis.Redis.from_url(redis_url)
    saver = _saver(client, key_prefix, False)
    chain, cursor = _cursor(client, key_prefix, "t", "r1")
    saver.chains.attach("t", cursor)
    chain.append("t", "r1", None, [("run", "run", "a" * 64)])  # another process extended the chain
    conf = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    with pytest.raises(StaleHeadError):
        saver.put(conf, _checkpoint("1", {"a": 1}, {"a": "1"}), {"run_id": "r1"}, {"a": "1"})
    assert saver.get_tuple(conf) is None  # nothing of the checkpoint was written
    assert len(chain.entries("t", "r1")) == 1


def test_a_write_already_stored_is_not_chained_with_the_new_value(redis_url, key_prefix):
    from elesium.state.audit_records import read_checkpoints

    client = redis.Redis.from_url(redis_url)
    saver = _saver(client, key_prefix, False)
    conf = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    c1 = saver.put(conf, _checkpoint("1", {"a": 1}, {"a": "1"}), {"run_id": "r0"}, {"a": "1"})
    saver.put_writes(c1, [("a", "first")], "task")  # an earlier attempt, unchained
    chain, cursor = _cursor(client, key_prefix, "t", "r1")
    saver.chains.attach("t", cursor)
    saver.put_writes(c1, [("a", "second")], "task")  # HSETNX keeps "first"
    assert chain.entries("t", "r1") == []
    saver.put_writes(c1, [("a", "new")], "task-2")  # a fresh write is chained, with what is stored
    cursor.append()
    (stored,) = read_checkpoints(client, key_prefix + ":cp", "t")
    (entry,) = chain.entries("t", "r1")
    assert entry.ref.endswith(":task-2:0") and entry.digest == stored.writes["task-2:0"]


class _State(TypedDict):
    items: Annotated[list[str], operator.add]


def test_a_driven_run_is_chained_as_written_and_read_back_only_at_its_seal(redis_url, key_prefix,
                                                                          monkeypatch):
    from langgraph.graph import END, START, StateGraph

    from elesium.graphs import audit_chain as ac
    from elesium.graphs.execution import drive
    from elesium.state import AcceptanceLog
    from elesium.state.acceptance_log import AcceptanceEntry, LoggedStep
    from elesium.state.audit_chain import AuditChain, HmacSigner

    client = redis.Redis.from_url(redis_url)
    saver = _saver(client, key_prefix, False)
    log = AcceptanceLog(client, prefix=key_prefix + ":acc")
    tid, rid = f"t-{uuid.uuid4().hex[:8]}", f"r-{uuid.uuid4().hex[:8]}"

    def node(name: str) -> Any:
        def run(state: _State) -> dict[str, Any]:
            step = LoggedStep(step=0, mode="vanilla", tree_size=1, tree_depth=0, accepted_length=1,
                              accepted_nodes=(0,), tokens=(len(state["items"]),))
            log.append_many([AcceptanceEntry(run_id=rid, node_id=name, step_id=0, record=step)])
            return {"items": [name]}
        return run

    builder = StateGraph(_State)
    for name in ("a", "b", "c"):
        builder.add_node(name, node(name))
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", "c")
    builder.add_edge("c", END)
    graph = builder.compile(checkpointer=saver)
    chain = AuditChain(client, prefix=key_prefix + ":audit")
    signer = HmacSigner("k" * 32)
    sources = ac.RunSources(client, thread_id=tid, run_id=rid, cp_prefix=key_prefix + ":cp", acceptance=log)
    audit = ac.RunAudit(chain, sources, signer=signer)
    reads = []
    monkeypatch.setattr(ac.RunAudit, "pending", lambda self: reads.append(1) or [])
    counts: list[int] = []
    config = {"configurable": {"thread_id": tid}, "metadata": {"run_id": rid}}
    outcome = drive(graph, {"items": []}, config, audit=audit,
                    between_steps=lambda: counts.append(len(chain.entries(tid, rid))))
    assert outcome.status == "success" and outcome.values["items"] == ["a", "b", "c"]
    assert reads == [1]  # the seal's one read-back: nothing left for it, the writers chained all
    assert counts == sorted(counts) and counts[0] > 0 and counts[-1] <= len(chain.entries(tid, rid))
    assert sum(audit.sync_seconds) < 0.05  # no super-step read anything
    assert saver.chains.get(tid) is None and log.chains.get(rid) is None  # detached at the end
    monkeypatch.undo()

    def verify() -> Any:
        return ac.verify_run(client, rid, signer=signer, cp_prefix=key_prefix + ":cp", acceptance=log,
                             chain=chain)

    kinds = [e.kind for e in chain.entries(tid, rid)]
    assert kinds.count("acceptance") == 3 and kinds.count("checkpoint") >= 4 and "writes" in kinds
    clean = verify()
    assert clean.ok and clean.sealed and clean.signature_ok, clean
    # An edited channel value of one of the run's checkpoints is named by its ref.
    from elesium.state import _keys as K

    blobs = K.ThreadKeys.of(key_prefix + ":cp", tid).blobs(K.encode_ns(""))
    field = next(f for f in client.hkeys(blobs) if f.startswith(b"items\x00"))
    client.hset(blobs, field, client.hget(blobs, field)[:-1] + b"\x00")
    bad = verify()
    assert not bad.ok and bad.first_bad is not None and bad.first_bad.kind == "checkpoint", bad
