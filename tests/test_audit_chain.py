"""The hash-chained run record: the chain store itself, then live API runs that verify clean (HMAC
signed) and the edits that must be caught both by ``verify`` (naming the entry) and by recorded replay.

Each edit is made directly in Redis, as someone with the credentials would: a step's tokens and a
call's tokens in the acceptance stream, a call's token ids in the calls list, an approval's approver,
a checkpoint's channel value, an extra acceptance entry, a deleted chain entry, a seal rewritten
without the key.
"""

from __future__ import annotations

import json
import os

import pytest
import redis

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]

AUDIT_KEY = "test-audit-key-0123456789"


# ---------------------------------------------------------------- the chain store
def test_compare_and_append_refuses_a_stale_head(redis_url, key_prefix):
    from elesium.state.audit_chain import GENESIS, AuditChain, Head, StaleHeadError

    chain = AuditChain(redis.Redis.from_url(redis_url), prefix=key_prefix)
    head = chain.append("t1", "r1", None, [("run", "run", "a" * 64)])
    assert head.count == 1 and chain.entries("t1", "r1")[0].prev == GENESIS
    more = [("call", "call:n#0", "b" * 64), ("acceptance", "acc:1-0", "c" * 64)]
    head2 = chain.append("t1", "r1", head, more)
    assert head2.count == 3 and chain.runs("t1") == ["r1"]
    with pytest.raises(StaleHeadError):
        chain.append("t1", "r1", head, [("call", "call:n#1", "d" * 64)])  # extends a head no longer current
    with pytest.raises(StaleHeadError):
        chain.append("t1", "r1", None, [("run", "run", "e" * 64)])  # a second genesis would be a fork
    assert chain.head("t1", "r1") == head2 and len(chain.entries("t1", "r1")) == 3
    entries = chain.entries("t1", "r1")
    assert all(e.intact for e in entries) and [e.prev for e in entries[1:]] == [e.hash for e in entries[:-1]]
    # The next run of the thread starts where this one ends.
    assert chain.genesis("t1", "r2") == head2.hash
    assert isinstance(Head.decode(head2.encode()), Head)
    chain.delete("t1", "r1")
    assert chain.entries("t1", "r1") == [] and chain.runs("t1") == [] and chain.head("t1", "r1") is None


def test_canonical_encoding_is_stable():
    from elesium.state.audit_chain import ChainEntry, canonical, digest_json, digest_parts

    a = {"b": [1, 2, {"y": "é", "x": None}], "a": 1.5}
    b = json.loads(json.dumps({"a": 1.5, "b": [1, 2, {"x": None, "y": "é"}]}))
    assert canonical(a) == canonical(b) == '{"a":1.5,"b":[1,2,{"x":null,"y":"é"}]}'.encode()
    assert digest_json(a) == digest_json(b)
    assert digest_parts([b"ab", b"c"]) != digest_parts([b"a", b"bc"])  # length-prefixed: no ambiguity
    e = ChainEntry.make(0, "run", "run", "0" * 64, "1" * 64)
    assert ChainEntry.from_json(e.to_json()) == e and e.intact
    # Pinned: a change of the encoding would orphan every stored chain.
    assert e.hash == ChainEntry.link(0, "run", "run", "0" * 64, "1" * 64)


def test_signers_roundtrip(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from elesium.config import Settings
    from elesium.state.audit_chain import Ed25519Signer, HmacSigner, Unsigned, signer_for

    h = HmacSigner("k1")
    assert h.verify(b"x", h.sign(b"x")) and not h.verify(b"y", h.sign(b"x"))
    assert not HmacSigner("k2").verify(b"x", h.sign(b"x"))
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "k.pem").write_bytes(pem)
    ed = signer_for(Settings(audit_signing_key_file=tmp_path / "k.pem", audit_key="ignored"))
    assert isinstance(ed, Ed25519Signer) and ed.verify(b"x", ed.sign(b"x"))
    assert not ed.verify(b"y", ed.sign(b"x"))
    assert isinstance(signer_for(Settings(audit_key="k1")), HmacSigner)
    assert isinstance(signer_for(Settings()), Unsigned)


# ---------------------------------------------------------------- live runs
@pytest.fixture(scope="module")
def signed():
    """Seals signed with an HMAC key (set in the environment the server's executor reads at each run)."""
    before = os.environ.get("ELESIUM_AUDIT_KEY")
    os.environ["ELESIUM_AUDIT_KEY"] = AUDIT_KEY
    yield
    if before is None:
        os.environ.pop("ELESIUM_AUDIT_KEY", None)
    else:
        os.environ["ELESIUM_AUDIT_KEY"] = before


@pytest.fixture(scope="module")
def client(api_server, signed):
    from langgraph_sdk import get_sync_client

    return get_sync_client(url=api_server.url, api_key=KEY_A)


@pytest.fixture(scope="module")
def http(api_server, signed):
    with api_server.http(KEY_A) as h:
        yield h


def verdict(http, tid, rid):
    r = http.get(f"/threads/{tid}/runs/{rid}/audit")
    assert r.status_code == 200, r.text
    return r.json()


def recorded_replay(http, tid, rid):
    r = http.post(f"/threads/{tid}/runs/{rid}/replay", json={"mode": "recorded"})
    assert r.status_code == 200, r.text
    return r.json()


def test_approval_runs_verify_clean_then_an_edited_approver_is_named(client, http, api_server):
    tid = client.threads.create()["thread_id"]
    client.runs.wait(tid, "approval", input={"topic": "tea"}, config={"configurable": {"run_seed": 3}})
    client.runs.wait(tid, "approval", command={"resume": {"approved": True}})
    first, second = [r["run_id"] for r in reversed(client.runs.list(tid, limit=10))]
    for rid in (first, second):
        v = verdict(http, tid, rid)
        assert v["ok"] and v["sealed"] and v["signed"] and v["signature_ok"], v
        assert v["first_bad"] is None and v["entries_checked"] >= 3
    kinds = {e.kind for e in _chain(api_server, second)}
    assert {"run", "approval", "checkpoint", "writes"} <= kinds
    # The resumed run continues the thread's chain: its genesis is the interrupted run's head.
    assert _chain(api_server, second)[0].prev == _chain(api_server, first)[-1].hash
    assert recorded_replay(http, tid, second)["verdict"] == "identical"
    # Another tenant's run is as missing as an unknown one.
    with api_server.http(KEY_B) as other:
        assert other.get(f"/threads/{tid}/runs/{second}/audit").status_code == 404
    r = api_server.redis()
    r.hset(api_server.services.store._r(second, "run"), "approver", "tenant-a/forged")  # noqa: SLF001
    bad = verdict(http, tid, second)["first_bad"]
    assert (bad["kind"], bad["ref"]) == ("approval", "approval") and "differs" in bad["reason"]
    report = recorded_replay(http, tid, second)
    assert report["verdict"] == "diverged" and report["divergence"]["field"] == "audit.approval"


def _chain(api_server, rid):
    from elesium.state.audit_chain import AuditChain

    row = api_server.services.store.get_run_any(rid)
    return AuditChain(api_server.redis()).entries(row.thread_id, rid)


def _rewrite_stream(r, key, edit):
    """Rebuild the stream with the same ids, ``edit(fields)`` applied to the entry it returns True for."""
    rows = r.xrange(key)
    target = None
    for eid, fields in rows:
        if target is None and edit(fields):
            target = eid.decode()
    r.delete(key)
    for eid, fields in rows:
        r.xadd(key, fields, id=eid)
    return target


def _step_tokens(fields):
    if b"kind" in fields:
        return False
    rec = json.loads(fields[b"record"])
    rec["tokens"] = [t + 1 for t in rec["tokens"]]
    fields[b"record"] = json.dumps(rec, separators=(",", ":")).encode()
    return True


def _call_tokens(fields):
    if fields.get(b"kind") != b"call":
        return False
    tokens = json.loads(fields[b"tokens"])
    tokens[-1] += 1
    fields[b"tokens"] = json.dumps(tokens, separators=(",", ":")).encode()
    return True


def _tamper(case, api_server, tid, rid):
    """Make the edit; return (kind, ref or None, seq or None) that verify must name first."""
    svc, r = api_server.services, api_server.redis()
    if case in ("step_tokens", "call_tokens"):
        edit = _step_tokens if case == "step_tokens" else _call_tokens
        eid = _rewrite_stream(r, svc.acceptance.key(rid), edit)
        assert eid is not None
        return "acceptance", f"acc:{eid}", None
    if case == "calls_list":
        key = svc.store._r(rid, "calls")  # noqa: SLF001
        call = json.loads(r.lindex(key, 0))
        call["token_ids"][1] += 1
        r.lset(key, 0, json.dumps(call))
        return "call", f"call:{call['node']}#{call['call']}", None
    if case == "checkpoint_value":
        from elesium.state import _keys as K

        last = svc.saver.get_tuple({"configurable": {"thread_id": tid, "checkpoint_ns": ""}})
        version = last.checkpoint["channel_versions"]["summary"]
        keys = K.ThreadKeys.of(svc.saver.prefix, tid)
        r.hset(keys.blobs(K.encode_ns("")), K.blob_field("summary", str(version)),
               K.pack_typed(svc.saver.serde.dumps_typed("forged summary")))
        return "checkpoint", None, None
    if case == "extra_acceptance":
        record = {"step": 9, "mode": "vanilla", "tree_size": 1, "tree_depth": 0, "accepted_length": 1,
                  "accepted_nodes": [0], "tokens": [5]}
        fields = {"v": "1", "run_id": rid, "node_id": "summarize", "step_id": "99",
                  "record": json.dumps(record)}
        eid = r.xadd(svc.acceptance.key(rid), fields)
        return "acceptance", f"acc:{eid.decode()}", None
    if case == "deleted_entry":
        from elesium.state.audit_chain import AuditChain

        chain = AuditChain(r)
        key = chain.key(tid, "chain", rid)
        r.lrem(key, 1, r.lindex(key, 2))
        return "chain", None, 2
    if case == "forged_seal":
        from dataclasses import asdict, replace

        from elesium.state.audit_chain import AuditChain, HmacSigner

        chain = AuditChain(r)
        seal = chain.get_seal(rid)
        forged = replace(seal, count=seal.count - 1, signature="")
        forged = replace(forged, signature=HmacSigner("not-the-key").sign(forged.payload()))
        r.hset(chain.seals_key, rid, json.dumps(asdict(forged)))
        return "seal", rid, None
    raise AssertionError(case)


CASES = ["step_tokens", "call_tokens", "calls_list", "checkpoint_value", "extra_acceptance", "deleted_entry",
         "forged_seal"]


@pytest.mark.parametrize("case", CASES)
def test_each_edit_is_named_by_verify_and_fails_recorded_replay(case, client, http, api_server):
    tid = client.threads.create()["thread_id"]
    client.runs.wait(tid, "summary", input={"topic": "rivers"}, config={"configurable": {"run_seed": 11}})
    rid = client.runs.list(tid)[0]["run_id"]
    clean = verdict(http, tid, rid)
    assert clean["ok"] and clean["signature_ok"], clean
    kind, ref, seq = _tamper(case, api_server, tid, rid)
    v = verdict(http, tid, rid)
    bad = v["first_bad"]
    assert not v["ok"] and bad is not None and bad["kind"] == kind, v
    if ref is not None:
        assert bad["ref"] == ref, v
    if seq is not None:
        assert bad["seq"] == seq, v
    if case == "extra_acceptance":
        assert bad["seq"] is None and "not in the chain" in bad["reason"]
    if case == "forged_seal":
        assert v["signature_ok"] is False
    report = recorded_replay(http, tid, rid)
    assert report["verdict"] == "diverged", report
    d = report["divergence"]
    assert d["field"].startswith("audit.") and d["run_id"] == rid, d


def test_cli_verify_exit_codes(client, api_server, capsys, monkeypatch):
    from elesium.cli import main

    monkeypatch.setenv("REDIS_URL", api_server.redis_url)
    tid = client.threads.create()["thread_id"]
    client.runs.wait(tid, "summary", input={"topic": "stones"}, config={"configurable": {"run_seed": 2}})
    rid = client.runs.list(tid)[0]["run_id"]
    assert main(["audit", "verify", rid]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok: run ")
    _tamper("calls_list", api_server, tid, rid)
    assert main(["audit", "verify", rid, "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["first_bad"]["kind"] == "call" and not out["ok"]
    assert main(["audit", "verify", "no-such-run"]) == 1
    assert "no run" in capsys.readouterr().err
