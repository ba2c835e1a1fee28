"""The audit console (``/console``) on a live server: HTTP-level checks with httpx, then a real browser.

(a) httpx: login (cookie attributes, bad keys), the run list and its filters, a run's page (the
graph's SVG with the path highlighted, every call's answer tokens shaded by acceptance depth, matching
the acceptance log exactly; τ per node), tenants (another tenant's run is a 404 page), escaping of a
ticket that contains ``<script>``, CSRF on actions, the API's 403 for a key without the approver
role passed through, logout revoking the session.

(b) Playwright driving Debian's Chromium (``/usr/bin/chromium``; no ``playwright install``): log in,
open an interrupted ticket-triage run, approve it with an edited reply from the page, see the
outcome, replay it and see ``identical``; step through a call's recorded trees (links and arrow keys)
and decode a prompt live, watching its steps' trees arrive. Screenshots of the list, the run page,
the tree view and the live page go to ``docs/console/`` when ``ELESIUM_CONSOLE_SCREENSHOTS=1``.
Without Chromium or the playwright package the browser test skips, and fails when ``CI`` is set.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from langgraph_sdk import get_sync_client

from api_server import KEY_A, KEY_B

pytest_plugins = ["state_fixtures", "api_server"]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = Path(__file__).resolve().parents[1] / "docs" / "console"
"""Where ``ELESIUM_CONSOLE_SCREENSHOTS=1`` copies the browser test's screenshots (a test run does not
rewrite tracked files unless asked: the committed ones are refreshed on purpose)."""
READER = "key-console-reader-0123456789"
TRIAGE_NODES = ("classify_category", "classify_priority", "extract_product", "extract_problem", "route",
                "escalate", "choose_opening", "draft_reply", "approval", "finalise")
EVIL = "<script>alert('pwned')</script>"


def ticket(subject: str) -> dict[str, str]:
    return {"subject": subject, "customer": "Dana",
            "body": f"Our invoice INV-2231 charged us twice this month. {EVIL} "
                    "Please refund the extra charge."}


def start_triage(url: str, subject: str, seed: int, record_trees: bool = False) -> tuple[str, str]:
    """A ticket-triage run interrupted at its approval (speculative decoding): (thread id, run id)."""
    client = get_sync_client(url=url, api_key=KEY_A)
    tid = client.threads.create()["thread_id"]
    configurable = {"run_seed": seed, "mode": "speculative"}
    if record_trees:
        configurable["record_trees"] = True
    out = client.runs.wait(tid, "ticket-triage", input=ticket(subject), config={"configurable": configurable})
    assert out.get("__interrupt__"), out
    return tid, client.runs.list(tid)[0]["run_id"]


@pytest.fixture(scope="module")
def triage(api_server):
    return start_triage(api_server.url, "Charged twice", 3)


@pytest.fixture(scope="module")
def summary(api_server):
    client = get_sync_client(url=api_server.url, api_key=KEY_A)
    tid = client.threads.create()["thread_id"]
    client.runs.wait(tid, "summary", input={"topic": "rivers"},
                     config={"configurable": {"run_seed": 4, "mode": "speculative"}})
    return tid, client.runs.list(tid)[0]["run_id"]


@contextlib.contextmanager
def console(server, key: str | None = KEY_A) -> Iterator[httpx.Client]:
    """A browser-like client logged in with ``key`` (no API key header: the session cookie only)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        if key is not None:
            r = c.post("/console/login", data={"api_key": key, "next": "/console"})
            assert r.status_code == 303, r.text
        yield c


def csrf_of(page: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]+)">', page).group(1)


def run_url(tid: str, rid: str) -> str:
    return f"/console/runs/{tid}/{rid}"


# ---------------------------------------------------------------- (a) HTTP
def test_login_sets_a_strict_httponly_session_and_refuses_bad_keys(api_server):
    with httpx.Client(base_url=api_server.url, timeout=30) as c:
        r = c.get("/console/")
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login?next=")
        assert c.get("/console/login").status_code == 200
        bad = c.post("/console/login", data={"api_key": "nope"})
        assert bad.status_code == 401 and "not valid" in bad.text and "elesium_console" not in c.cookies
        foreign = c.post("/console/login", data={"api_key": KEY_A}, headers={"origin": "https://evil.example"})
        assert foreign.status_code == 403
        ok = c.post("/console/login", data={"api_key": KEY_A, "next": "//evil.example/x"})
        assert ok.status_code == 303 and ok.headers["location"] == "/console/"
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/console" in cookie
        assert KEY_A not in ok.headers["set-cookie"]  # opaque: the key never goes to the browser
        page = c.get("/console/")
        assert page.status_code == 200 and "tenant <b>tenant-a</b>" in page.text
        assert "content-security-policy" in page.headers
        # No asset from elsewhere: every src/href is the console's own.
        assert not re.search(r'(?:src|href)="(?:https?:)?//', page.text)


def test_run_list_and_filters(api_server, triage, summary):
    tid, rid = triage
    with console(api_server) as c:
        page = c.get("/console/").text
        assert f'data-run="{rid}"' in page and f'data-run="{summary[1]}"' in page
        row = page.split(f'data-run="{rid}"')[1].split("</tr>")[0]
        assert "ticket-triage" in row and "interrupted" in row and "awaiting approval" in row
        only = c.get("/console/", params={"workflow": "summary"}).text
        assert f'data-run="{summary[1]}"' in only and f'data-run="{rid}"' not in only
        done = c.get("/console/", params={"status": "success"}).text
        assert f'data-run="{summary[1]}"' in done and f'data-run="{rid}"' not in done


def _depths_from_log(http: httpx.Client, tid: str, rid: str) -> list[list[int]]:
    """Per call, the expected depth of each answer token, straight from the acceptance API."""
    entries = http.get(f"/threads/{tid}/runs/{rid}/acceptance", params={"limit": 1000}).json()["entries"]
    calls: list[list[int]] = []
    lengths: list[int] = []
    for e in entries:
        rec = e["record"]
        if e.get("kind") == "call":
            calls.append([0])
            lengths.append(len(e["tokens"]))  # the answer (a step may commit past a stop token)
        else:
            n = len(rec["tokens"])
            calls[-1] += [min(j + 1, 5) if j < n - 1 else 0 for j in range(n)]
    return [c[:n] for c, n in zip(calls, lengths)]


def _page_depths(page: str) -> list[list[int]]:
    answers = re.findall(r'<div class="answer">(.*?)</div>', page, re.S)
    return [[int(d) for d in re.findall(r'class="tok d(\d)"', a)] for a in answers]


def test_run_page_graph_calls_tau_and_escaping(api_server, triage, summary):
    tid, rid = triage
    with console(api_server) as c, api_server.http(KEY_A) as api:
        r = c.get(run_url(tid, rid))
        assert r.status_code == 200
        page = r.text
        svg = re.search(r"<svg .*?</svg>", page, re.S).group(0)
        for node in (*TRIAGE_NODES, "__start__", "__end__"):
            assert f'data-node="{node}"' in svg, node
        visited = set(re.findall(r'<g class="node[^"]*visited[^"]*" data-node="([^"]+)"', svg))
        assert {"classify_category", "route", "choose_opening", "draft_reply"} <= visited
        assert "finalise" not in visited and "escalate" not in visited  # a P3 billing ticket: no page
        assert re.search(r'<g class="node[^"]*pending[^"]*" data-node="approval"', svg)
        taken = r'class="edge conditional taken" data-source="route" data-target="choose_opening"'
        assert re.search(taken, svg)
        assert re.search(r'class="edge taken" data-source="choose_opening" data-target="draft_reply"', svg)
        assert not re.search(r'class="edge[^"]*taken[^"]*" data-source="route" data-target="escalate"', svg)
        # Tokens shaded by depth, exactly as the acceptance log says, for both runs.
        assert _page_depths(page) == _depths_from_log(api, tid, rid)
        spage = c.get(run_url(*summary)).text
        assert _page_depths(spage) == _depths_from_log(api, *summary)
        # τ per node, as the acceptance summary gives it.
        acc = api.get(f"/threads/{tid}/runs/{rid}/acceptance").json()
        tau = acc["per_node"]["choose_opening"]["tau"]
        row = re.search(r'<tr data-node="choose_opening">.*?</tr>', page, re.S).group(0)
        assert f'<td class="tau-value">{tau:.2f}</td>' in row
        # The ticket's <script> is text everywhere: in the prompt, the checkpoint diffs, the interrupt.
        assert EVIL not in page and "<script>alert" not in page
        assert page.count("&lt;script&gt;alert(") >= 2  # the prompt, the checkpoint diff of the input
        prompt = re.search(r'<pre class="prompt">(.*?)</pre>', page, re.S).group(1)
        assert "Charged twice" in prompt and "&lt;script&gt;" in prompt
        assert "Pending approval" in page and 'id="approve"' in page
        # The audit chain's verdict, through the console (the API's /audit route where the server has it).
        audit = c.get(f"/console/api/runs/{tid}/{rid}/audit").json()
        if audit["available"]:
            v = audit["verdict"]
            assert isinstance(v["ok"], bool) and isinstance(v["entries"], int) and "first_bad" in v
        else:
            assert "not available" in audit["detail"]


def test_another_tenants_run_is_a_404_page(api_server, triage):
    tid, rid = triage
    with console(api_server, KEY_B) as c:
        r = c.get(run_url(tid, rid))
        assert r.status_code == 404 and "Run not found" in r.text and "ticket-triage" not in r.text
        assert f'data-run="{rid}"' not in c.get("/console/").text
        csrf = csrf_of(c.get("/console/").text)
        act = c.post(f"/console/api/runs/{tid}/{rid}/replay", json={}, headers={"x-csrf-token": csrf})
        assert act.status_code == 404
        assert c.get(f"/console/api/runs/{tid}/{rid}/audit").status_code == 404


def test_actions_need_the_csrf_token_and_pass_the_api_role_check(api_server, triage):
    tid, rid = triage
    settings = api_server.app.state.settings
    keys, roles = dict(settings.api_keys), dict(getattr(settings, "api_key_roles", {}))
    settings.api_keys = {**keys, READER: "tenant-a"}
    if hasattr(settings, "api_key_roles"):
        settings.api_key_roles = {**roles, READER: frozenset({"reader"})}
    try:
        with console(api_server) as c:
            url = f"/console/api/runs/{tid}/{rid}/resume"
            assert c.post(url, json={"approved": True}).status_code == 403  # no token
            assert c.post(url, json={"approved": True}, headers={"x-csrf-token": "x"}).status_code == 403
        if hasattr(settings, "api_key_roles"):
            with console(api_server, READER) as c:
                page = c.get(run_url(tid, rid))
                assert page.status_code == 200
                r = c.post(url, json={"approved": True}, headers={"x-csrf-token": csrf_of(page.text)})
                assert r.status_code == 403 and "'approver'" in r.json()["detail"]
    finally:
        settings.api_keys = keys
        if hasattr(settings, "api_key_roles"):
            settings.api_key_roles = roles
    # Nothing was resumed.
    assert get_sync_client(url=api_server.url, api_key=KEY_A).runs.list(tid)[0]["run_id"] == rid


def test_logout_revokes_the_session(api_server):
    with console(api_server) as c:
        page = c.get("/console/").text
        token = c.cookies["elesium_console"]
        assert c.post("/console/logout", data={"csrf": "wrong"}).status_code == 403
        assert c.post("/console/logout", data={"csrf": csrf_of(page)}).status_code == 303
    with httpx.Client(base_url=api_server.url, timeout=30, cookies={"elesium_console": token}) as stale:
        assert stale.get("/console/").status_code == 303  # the copied cookie no longer works


def test_static_assets_are_served_and_nothing_else(api_server):
    with httpx.Client(base_url=api_server.url, timeout=30) as c:
        assert c.get("/console/static/console.js").status_code == 200
        assert c.get("/console/static/console.css").headers["content-type"].startswith("text/css")
        assert c.get("/console/static/..%2Froutes.py").status_code == 404
        assert c.get("/console/static/routes.py").status_code == 404


# ---------------------------------------------------------------- (b) the browser
def _browser_or_skip():
    missing = None
    if not os.path.exists(CHROMIUM):
        missing = f"Chromium is not installed at {CHROMIUM} (apt-get install -y chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "the playwright package is not installed (pip install -e '.[dev]')"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests need Chromium and playwright in CI: {missing}")
        pytest.skip(missing)


@contextlib.contextmanager
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def _login(page, base: str, key: str) -> None:
    page.goto(f"{base}/console/")
    assert "/console/login" in page.url
    page.fill("#api_key", key)
    page.click("#login")
    page.wait_for_url(f"{base}/console/")


def _recorded_story(url: str) -> tuple[str, str]:
    """A 48-token ``story`` run that records its trees: (thread id, run id)."""
    client = get_sync_client(url=url, api_key=KEY_A)
    tid = client.threads.create()["thread_id"]
    client.runs.wait(tid, "story", input={"topic": "rivers"},
                     config={"configurable": {"run_seed": 7, "mode": "speculative", "record_trees": True}})
    return tid, client.runs.list(tid)[0]["run_id"]


def test_browser_approve_replay_and_screenshots(api_server, summary, tmp_path):
    _browser_or_skip()
    from playwright.sync_api import expect
    tid, rid = start_triage(api_server.url, "Double charge on invoice", 11, record_trees=True)
    base = api_server.url
    settings = api_server.app.state.settings
    keys, roles = dict(settings.api_keys), dict(getattr(settings, "api_key_roles", {}))
    with chromium() as browser:
        # A key without the approver role sees the API's refusal on the page.
        if hasattr(settings, "api_key_roles"):
            settings.api_key_roles = {**roles, READER: frozenset({"reader"})}
            settings.api_keys = {**keys, READER: "tenant-a"}
            try:
                ctx = browser.new_context(viewport={"width": 1280, "height": 900})
                page = ctx.new_page()
                _login(page, base, READER)
                page.goto(base + run_url(tid, rid))
                page.click("#approve")
                expect(page.locator("#approval-result")).to_contain_text("'approver' role", timeout=30_000)
                ctx.close()
            finally:
                settings.api_keys, settings.api_key_roles = keys, roles

        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        page = ctx.new_page()
        requests: list[str] = []
        page.on("request", lambda req: requests.append(req.url))
        _login(page, base, KEY_A)
        assert page.locator(f'tr[data-run="{rid}"] .badge.awaiting').count() == 1
        page.screenshot(path=str(tmp_path / "runs.png"))
        page.click(f'tr[data-run="{rid}"] a')
        page.wait_for_selector("svg.graph")
        expect(page.locator("#audit-status")).not_to_contain_text("checking", timeout=30_000)
        audit = page.text_content("#audit-status")
        assert "undefined" not in audit and ("chain entries" in audit or "not available" in audit), audit
        assert page.locator('svg.graph g.node.visited[data-node="choose_opening"]').count() == 1
        page.screenshot(path=str(tmp_path / "run-top.png"),
                        clip={"x": 0, "y": 0, "width": 1280, "height": 2000}, full_page=True)
        # The tree, step by step: a call's recorded trees, forward and back (links and arrow keys).
        page.locator("article.call a.tree-link").first.click()
        page.wait_for_selector("#tree-view .step")
        count = int(page.get_attribute("#tree-view", "data-count"))
        assert count >= 3 and page.text_content("#step-pos").strip() == f"step 1 of {count}", count
        assert page.locator("#tree-view .step .tnode.root").count() == 1
        assert page.locator("#tree-view .step .tnode.bonus").count() == 1
        page.click("#step-next")
        expect(page.locator("#step-pos")).to_have_text(f"step 2 of {count}")
        page.keyboard.press("ArrowRight")
        expect(page.locator("#step-pos")).to_have_text(f"step 3 of {count}")
        page.keyboard.press("ArrowLeft")
        expect(page.locator("#step-pos")).to_have_text(f"step 2 of {count}")
        assert page.get_attribute("#tree-view .step", "data-recorded") == "yes"
        # The screenshot: a longer answer's step with the largest tree (every drafted node, kept or not).
        story_tid, story_rid = _recorded_story(base)
        story = f"{base}{run_url(story_tid, story_rid)}/calls/write/0"
        page.goto(story)
        sizes = []
        for i in range(int(page.get_attribute("#tree-view", "data-count"))):
            page.goto(f"{story}?step={i}")
            sizes.append(page.locator("#tree-view .tnode[data-node]").count())
        page.goto(f"{story}?step={sizes.index(max(sizes))}")
        assert page.locator("#tree-view .tnode.rejected").count() > 0
        page.screenshot(path=str(tmp_path / "tree.png"), full_page=True)
        page.goto(base + run_url(tid, rid))
        page.wait_for_selector("svg.graph")
        # Approve with an edited reply.
        reply = ("Hello Dana,\n\nWe have refunded the duplicate charge on INV-2231.\n\n"
                 "Best regards,\nNorthwind Support")
        page.fill("#reply", reply)
        page.click("#approve")
        page.wait_for_selector("#resumed-run", timeout=60_000)
        assert "Outcome: sent" in page.text_content("#approval-result")
        state = get_sync_client(url=base, api_key=KEY_A).threads.get_state(tid)["values"]
        assert state["outcome"] == "sent" and state["final_reply"] == reply
        # The resumed run's page: the path ends at finalise; replay it.
        page.click("#resumed-run")
        page.wait_for_selector("svg.graph")
        assert page.locator('svg.graph g.node.visited[data-node="finalise"]').count() == 1
        page.click("#replay")
        expect(page.locator("#replay-result")).to_contain_text("Verdict: identical", timeout=90_000)
        # Live: type a prompt, watch each step's tree arrive, step back through them.
        page.click("#nav-live")
        page.wait_for_selector("#live-form")
        page.fill("#live-prompt", "Write one sentence about rivers.")
        page.fill("#live-max", "24")
        page.click("#live-start")
        expect(page.locator("#live-status")).to_contain_text("done:", timeout=90_000)
        assert page.get_attribute("#live", "data-state") == "done"
        steps = int(re.search(r"in (\d+) steps", page.text_content("#live-status")).group(1))
        assert steps >= 2 and page.text_content("#live-pos") == f"step {steps} of {steps}"
        assert page.locator("#live-step .tnode.root").count() == 1
        assert page.locator("#live-answer .tok").count() >= steps + 1
        page.click("#live-prev")
        expect(page.locator("#live-pos")).to_have_text(f"step {steps - 1} of {steps}")
        page.click("#live-next")
        expect(page.locator("#live-pos")).to_have_text(f"step {steps} of {steps}")
        page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
        assert all(u.startswith(base) for u in requests), [u for u in requests if not u.startswith(base)]
        ctx.close()
    shots = {"runs.png": "runs.png", "run-top.png": "run.png", "tree.png": "tree.png", "live.png": "live.png"}
    assert all((tmp_path / name).stat().st_size > 10_000 for name in shots)
    if os.environ.get("ELESIUM_CONSOLE_SCREENSHOTS") == "1":
        SHOTS.mkdir(parents=True, exist_ok=True)
        for name, committed in shots.items():
            shutil.copy(tmp_path / name, SHOTS / committed)
