"""The tree, step by step, on a live server (issue 43, item 6): the opt-in through the API, the
console's tree page over HTTP, the live decoding stream, and the chain catching an edited node.

A run asks for its trees with ``configurable.record_trees``; its acceptance entries then carry every
drafted node, and the console's call page steps through them (``?step=N``). A run without it shows
its accepted paths only. The browser walk through these pages is in tests/test_console.py.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import httpx
import pytest
from langgraph_sdk import get_sync_client

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]

READER = "key-console-trees-reader-0123456789"


@contextlib.contextmanager
def console(server, key: str = KEY_A) -> Iterator[httpx.Client]:
    """A browser-like client logged in with ``key`` (the session cookie only)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.post("/console/login", data={"api_key": key, "next": "/console"}).status_code == 303
        yield c


def csrf_of(page: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]+)">', page).group(1)


def run_url(tid: str, rid: str) -> str:
    return f"/console/runs/{tid}/{rid}"


def rewrite_stream(r, key: str, edit) -> str | None:
    """Rebuild the stream with the same ids, ``edit(fields)`` applied to the first entry it accepts."""
    rows = r.xrange(key)
    target = next((eid.decode() for eid, fields in rows if edit(fields)), None)
    r.delete(key)
    for eid, fields in rows:
        r.xadd(key, fields, id=eid)
    return target


def summary_run(url: str, seed: int, record: bool) -> tuple[str, str]:
    client = get_sync_client(url=url, api_key=KEY_A)
    tid = client.threads.create()["thread_id"]
    configurable = {"run_seed": seed, "mode": "speculative", **({"record_trees": True} if record else {})}
    client.runs.wait(tid, "summary", input={"topic": "rivers"}, config={"configurable": configurable})
    return tid, client.runs.list(tid)[0]["run_id"]


@pytest.fixture(scope="module")
def recorded(api_server):
    return summary_run(api_server.url, 21, True)


@pytest.fixture(scope="module")
def unrecorded(api_server):
    return summary_run(api_server.url, 21, False)


def steps_of(server, tid: str, rid: str) -> list[dict]:
    with server.http(KEY_A) as http:
        entries = http.get(f"/threads/{tid}/runs/{rid}/acceptance", params={"limit": 1000}).json()["entries"]
    return [e for e in entries if e.get("kind", "step") == "step"]


def test_runs_record_trees_only_when_asked(api_server, recorded, unrecorded):
    on, off = steps_of(api_server, *recorded), steps_of(api_server, *unrecorded)
    assert on and off and len(on) == len(off)
    assert all("tree" not in e["record"] for e in off)
    for e in on:
        rec = e["record"]
        assert len(rec["tree"]["tokens"]) == rec["tree_size"]
        assert [rec["tree"]["tokens"][n] for n in rec["accepted_nodes"][1:]] == rec["tokens"][:-1]
    # The same tokens, recorded or not.
    assert [e["record"]["tokens"] for e in on] == [e["record"]["tokens"] for e in off]
    client = get_sync_client(url=api_server.url, api_key=KEY_A)
    tid = client.threads.create()["thread_id"]
    with api_server.http(KEY_A) as http:
        r = http.post(f"/threads/{tid}/runs", json={"assistant_id": "summary", "input": {"topic": "x"},
                                                   "config": {"configurable": {"record_trees": "yes"}}})
    assert r.status_code == 422 and "record_trees" in r.text


def _nodes(page: str) -> list[tuple[str, str]]:
    """(class, node id) of every tree node on a page, in document order (the bonus has no node id)."""
    return re.findall(r'<span class="tnode (root|accepted|rejected)" data-node="(\d+)"', page)


def test_tree_page_steps_through_a_recorded_call(api_server, recorded):
    tid, rid = recorded
    steps = steps_of(api_server, tid, rid)
    node, call = steps[0]["node_id"], steps[0]["call_index"]
    base = f"{run_url(tid, rid)}/calls/{node}/{call}"
    with console(api_server) as c:
        run_page = c.get(run_url(tid, rid)).text
        assert f'href="{base}"' in run_page  # the run page links each call's tree
        committed = 0
        for i in (0, 1, len(steps) - 1):
            page = c.get(base, params={"step": i})
            assert page.status_code == 200
            rec = steps[i]["record"]
            nodes = _nodes(page.text)
            assert len(nodes) == rec["tree_size"] == len(rec["tree"]["tokens"])
            assert sorted(int(n) for cls, n in nodes if cls in ("root", "accepted")) == rec["accepted_nodes"]
            assert f"step {i + 1} of {len(steps)}" in page.text
            assert f'<span class="tnode bonus" data-token="{rec["tokens"][-1]}"' in page.text
            # the heads' draft probability of each node is on the page (title: four decimals)
            p = rec["tree"]["probs"][1]
            assert f"draft probability {p:.4f}" in page.text
            committed = sum(s["record"]["accepted_length"] for s in steps[:i + 1])
            assert f"τ so far {committed / (i + 1):.2f}" in page.text
            assert ('id="step-prev"' in page.text) == (i > 0)
            assert ('id="step-next"' in page.text) == (i < len(steps) - 1)
            assert "not-recorded" not in page.text
        assert c.get(base, params={"step": 999}).status_code == 200  # clamped to the last step
        assert c.get(f"{run_url(tid, rid)}/calls/{node}/7").status_code == 404
        assert c.get(f"{run_url(tid, rid)}/calls/nope/0").status_code == 404
    with console(api_server, KEY_B) as other:  # another tenant's run is a 404 page
        assert other.get(base).status_code == 404


def test_tree_page_without_recorded_trees_shows_the_accepted_paths(api_server, unrecorded):
    tid, rid = unrecorded
    steps = steps_of(api_server, tid, rid)
    node, call = steps[0]["node_id"], steps[0]["call_index"]
    with console(api_server) as c:
        page = c.get(f"{run_url(tid, rid)}/calls/{node}/{call}", params={"step": 0}).text
    rec = steps[0]["record"]
    assert "not-recorded" in page and "record_trees" in page
    assert [int(n) for _, n in _nodes(page)] == rec["accepted_nodes"]
    assert all(cls != "rejected" for cls, _ in _nodes(page))


def test_an_edited_tree_node_is_named_by_audit_verify(api_server, monkeypatch, capsys):
    """The tree lives inside the acceptance entry, so the run's hash chain covers every node."""
    from elesium.cli import main

    tid, rid = summary_run(api_server.url, 5, True)
    monkeypatch.setenv("REDIS_URL", api_server.redis_url)
    assert main(["audit", "verify", rid]) == 0
    capsys.readouterr()

    def edit(fields):
        if b"kind" in fields:
            return False
        rec = json.loads(fields[b"record"])
        if not rec.get("tree") or len(rec["tree"]["tokens"]) < 2:
            return False
        rec["tree"]["tokens"][-1] += 1  # one drafted node's token
        fields[b"record"] = json.dumps(rec, separators=(",", ":")).encode()
        return True

    eid = rewrite_stream(api_server.redis(), api_server.services.acceptance.key(rid), edit)
    assert eid is not None
    assert main(["audit", "verify", rid, "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["first_bad"]["kind"] == "acceptance"
    assert out["first_bad"]["ref"] == f"acc:{eid}"


def _events(body: str) -> list[tuple[str, dict]]:
    out = []
    for block in body.strip().split("\n\n"):
        kind = re.search(r"^event: (.+)$", block, re.M).group(1)
        out.append((kind, json.loads(re.search(r"^data: (.+)$", block, re.M).group(1))))
    return out


def test_live_decoding_streams_each_step_and_checks_csrf_roles_and_bounds(api_server):
    with console(api_server) as c:
        page = c.get("/console/live")
        assert page.status_code == 200 and 'id="live-form"' in page.text
        token = csrf_of(page.text)
        body = {"prompt": "Say one short sentence about rivers.", "max_tokens": 10}
        assert c.post("/console/api/live", json=body).status_code == 403  # no CSRF token
        too_long = c.post("/console/api/live", json={**body, "max_tokens": 10_000},
                          headers={"x-csrf-token": token})
        assert too_long.status_code == 422 and "max_tokens" in too_long.json()["detail"]
        r = c.post("/console/api/live", json=body, headers={"x-csrf-token": token})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    kinds = [k for k, _ in events]
    assert kinds[0] == "start" and kinds[-1] == "done" and "step" in kinds, kinds
    steps = [d for k, d in events if k == "step"]
    assert [s["index"] for s in steps] == list(range(len(steps)))
    assert all('class="tnode root"' in s["html"] and "tnode bonus" in s["html"] for s in steps)
    done = events[-1][1]
    assert done["steps"] == len(steps) and 1 + sum(len(s["tokens"]) for s in steps) >= done["tokens"]
    assert steps[-1]["tau"] == pytest.approx(done["tau"], abs=0.01) or done["tokens"] == 10
    settings = api_server.app.state.settings
    if hasattr(settings, "api_key_roles"):  # a reader may look, not decode
        keys, roles = dict(settings.api_keys), dict(settings.api_key_roles)
        settings.api_keys = {**keys, READER: "tenant-a"}
        settings.api_key_roles = {**roles, READER: frozenset({"reader"})}
        try:
            with console(api_server, READER) as c:
                page = c.get("/console/live").text
                assert 'id="live-refused"' in page
                r = c.post("/console/api/live", json=body, headers={"x-csrf-token": csrf_of(page)})
                assert r.status_code == 403 and "'operator'" in r.json()["detail"]
        finally:
            settings.api_keys, settings.api_key_roles = keys, roles
