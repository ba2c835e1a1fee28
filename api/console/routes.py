"""The console's routes: login/logout, the run list, a run's page, and the page's actions.

Pages read the stores directly, through the same tenant checks as the API (``Services.run_or_404``:
another tenant's run is a 404 page). Actions (replay, answering an approval, the audit chain's
verdict) are the API's own routes, called in-process with the session's key: whatever the API
checks (tenant, roles, validation, idempotency) the console gets, and the API's message for a
refusal (a 403 for a key without the approver role) is what the page shows.

CSRF: the session cookie is SameSite=Strict, and every state-changing request must also carry the
session's CSRF token (``X-CSRF-Token`` on fetches, the ``csrf`` field of the logout form); the
login form, which has no session yet, must come from this origin (Origin/Referer checked).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, quote

import httpx
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route

from elesium.api.auth import Principal
from elesium.api.console import sessions, trees, views
from elesium.api.console.pages import (
    MAX_THREADS,
    STATIC,
    STATIC_TYPES,
    STATUSES,
    _action_session,
    _client,
    _fields,
    _page,
    _principal_of,
    _refused,
    _run_url,
    _safe_next,
    _same_origin,
    _session,
    _to_login,
    _when,
)
from elesium.api.errors import NotFound, Unauthorized
from elesium.api.routers.common import services
from elesium.state.threads import public_id


def static(request: Request) -> Response:
    name = request.path_params["name"]
    path = STATIC / name
    if "/" in name or name.startswith(".") or path.suffix not in STATIC_TYPES or not path.is_file():
        return Response("not found", status_code=404, media_type="text/plain")
    return FileResponse(path, media_type=STATIC_TYPES[path.suffix],
                        headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"})


def login_form(request: Request) -> Response:
    return _page(request, "login.html", session=None, next=_safe_next(request.query_params.get("next")),
                 error=None)


async def login(request: Request) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    key = (form.get("api_key") or [""])[0].strip()
    target = _safe_next((form.get("next") or [""])[0])
    if not _same_origin(request):
        return _page(request, "login.html", code=403, session=None, next=target,
                     error="This form must be sent from the console's own page.")
    settings = request.app.state.settings
    if settings.auth:
        try:
            _principal_of(request, sessions.Session(key=key, csrf="", token=None))
        except Unauthorized:
            return _page(request, "login.html", code=401, session=None, next=target,
                         error="That API key is not valid on this server.")
        if not key:
            return _page(request, "login.html", code=401, session=None, next=target,
                         error="That API key is not valid on this server.")
    token, _ = await run_in_threadpool(sessions.create, _client(request), key if settings.auth else "")
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(sessions.COOKIE, token, max_age=sessions.TTL_S, path="/console", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


async def logout(request: Request) -> Response:
    session = await run_in_threadpool(_session, request)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    if session is not None and session.token:
        if not sessions.csrf_ok(session, (form.get("csrf") or [""])[0]):
            return JSONResponse({"detail": "missing or wrong CSRF token"}, status_code=403)
        await run_in_threadpool(sessions.delete, _client(request), session.token)
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(sessions.COOKIE, path="/console", httponly=True, samesite="strict")
    return response


# ---------------------------------------------------------------- the run list
def _runs(request: Request, who: Principal, workflow: str | None, status: str | None) -> dict[str, Any]:
    svc = services(request)
    rows: list[dict[str, Any]] = []
    workflows: set[str] = set()
    for thread in svc.store.list_threads(who.tenant, limit=MAX_THREADS):
        if thread.status in ("deleted", "purging"):
            continue
        runs = svc.store.list_runs(thread.thread_id, who.tenant, limit=1000)
        for i, run in enumerate(runs):
            workflows.add(run.workflow)
            if (workflow and run.workflow != workflow) or (status and run.status != status):
                continue
            replays = svc.store.replays(run.run_id)
            last = replays[-1] if replays else None
            rows.append({
                "run_id": run.run_id,
                "thread_id": public_id(thread.thread_id),
                "workflow": run.workflow,
                "version": run.workflow_version,
                "status": run.status,
                "created_ms": run.created_ms,
                "created": _when(run.created_ms),
                "approver": run.approver,
                "awaiting_approval": (run.status == "interrupted" and i == 0
                                      and thread.status == "interrupted"),
                "replay": last and {"verdict": last.get("verdict"), "mode": last.get("mode"),
                                    "count": len(replays)},
                "url": _run_url(public_id(thread.thread_id), run.run_id),
            })
    rows.sort(key=lambda r: r["created_ms"], reverse=True)
    return {"runs": rows, "workflows": sorted(workflows)}


def run_list(request: Request) -> Response:
    workflow, status = request.query_params.get("workflow"), request.query_params.get("status")
    session = _session(request)
    if session is None:
        return _to_login(request)
    who = _principal_of(request, session)
    if (refused := _refused(request, session, who)) is not None:
        return refused
    data = _runs(request, who, workflow or None, status or None)
    return _page(request, "list.html", session=session, who=who, workflow=workflow or "",
                 status=status or "", statuses=STATUSES, **data)


# ---------------------------------------------------------------- a run's page
def _run_context(request: Request, who: Principal, thread_id: str, run_id: str) -> dict[str, Any]:
    svc = services(request)
    row = svc.run_or_404(thread_id, run_id, who)
    thread = svc.thread_or_404(thread_id, who)
    try:
        wf = svc.registry.get(row.workflow, row.workflow_version)
        version_note = None
    except KeyError:
        wf = svc.registry.get(row.workflow)
        version_note = (f"version {row.workflow_version} is no longer deployed; "
                        f"the graph shown is {wf.version}")
    graph = svc.graph(wf)
    items = views.timeline(graph, thread.thread_id, row.checkpoints)
    next_nodes: list[str] = []
    interrupts: list[Any] = []
    if row.checkpoints:
        cfg = {"configurable": {"thread_id": thread.thread_id, "checkpoint_ns": "",
                                "checkpoint_id": row.checkpoints[-1]}}
        snap = graph.get_state(cfg)
        next_nodes = list(snap.next)
        interrupts = [v for t in snap.tasks for v in (views.jsonable(i.value) for i in t.interrupts)]
    latest = svc.store.list_runs(thread.thread_id, who.tenant, limit=1)
    awaiting = (row.status == "interrupted" and thread.status == "interrupted"
                and bool(latest) and latest[0].run_id == row.run_id)
    path = views.path_of(items, next_nodes)
    entries = list(svc.acceptance.iter_entries(row.run_id))
    stored_calls = svc.store.calls(row.run_id)
    calls = views.llm_calls(entries, stored_calls, getattr(svc.engine, "tokenizer", None))
    nodes = {c["node"] for c in calls} | {e.node_id for e in entries}
    summary = svc.acceptance.summary(row.run_id)
    public = public_id(thread.thread_id)
    return {
        "run": row,
        "thread_id": public,
        "created": _when(row.created_ms),
        "updated": _when(row.updated_ms),
        "mode": row.request.get("mode")
        or (row.request.get("config") or {}).get("configurable", {}).get("mode"),
        "graph_svg": views.graph_svg(graph.get_graph(), path,
                                     next_nodes if row.status == "interrupted" else ()),
        "path": path,
        "version_note": version_note,
        "timeline": items,
        "calls": calls,
        "tau": views.tau_per_node(svc.acceptance, row.run_id, nodes),
        "summary": summary,
        "replays": [{**r, "when": _when(int(float(r.get("at") or 0) * 1000))}
                    for r in svc.store.replays(row.run_id)],
        "awaiting": awaiting,
        "interrupts": interrupts,
        "interrupt_fields": [_fields(v) for v in interrupts],
        "draft": next((v.get("draft") for v in interrupts if isinstance(v, dict) and v.get("draft")), ""),
        "api_base": f"/console/api/runs/{quote(public, safe='')}/{quote(row.run_id, safe='')}",
        "run_path": _run_url(public, row.run_id),
        "max_depth": views.MAX_DEPTH_CLASS,
    }


def run_page(request: Request) -> Response:
    thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
    session = _session(request)
    if session is None:
        return _to_login(request)
    who = _principal_of(request, session)
    if (refused := _refused(request, session, who)) is not None:
        return refused
    try:
        context = _run_context(request, who, thread_id, run_id)
    except NotFound:
        return _page(request, "error.html", code=404, session=session, who=who,
                     title="Run not found", message=f"No run {run_id} on thread {thread_id} for your tenant.")
    return _page(request, "run.html", session=session, who=who, **context)


# ---------------------------------------------------------------- actions: the API's own routes
async def _api(request: Request, session: sessions.Session, method: str, path: str,
               body: Any = None) -> httpx.Response:
    """Call this server's API in-process, as the session's key."""
    headers = {"x-api-key": session.key} if session.key else {}
    transport = httpx.ASGITransport(app=request.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://console.internal", timeout=None) as c:
        return await c.request(method, path, json=body, headers=headers)


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    return detail if isinstance(detail, str) else json.dumps(detail)


def _thread_path(thread_id: str) -> str:
    return f"/threads/{quote(thread_id, safe='')}"


async def replay_action(request: Request) -> Response:
    thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
    session = await _action_session(request, changes_state=True)
    if isinstance(session, JSONResponse):
        return session
    try:
        mode = (await request.json()).get("mode", "reexecute")
    except ValueError:
        mode = "reexecute"
    path = f"{_thread_path(thread_id)}/runs/{quote(run_id, safe='')}/replay"
    r = await _api(request, session, "POST", path, {"mode": mode})
    if r.status_code >= 400:
        return JSONResponse({"detail": _detail(r)}, status_code=r.status_code)
    report = r.json()
    divergence = report.get("divergence")
    return JSONResponse({
        "verdict": report.get("verdict"),
        "mode": report.get("mode", mode),
        "divergence": divergence,
        "divergence_text": _divergence_text(divergence),
        "runs_replayed": report.get("runs_replayed"),
        "tokens_compared": report.get("tokens_compared"),
        "checkpoints_compared": report.get("checkpoints_compared"),
        "fingerprint_match": report.get("fingerprint_match"),
        "notes": report.get("notes") or [],
    })


async def _audit_in_process(request: Request, session: sessions.Session, thread_id: str,
                            run_id: str) -> Response:
    """No ``/audit`` route on this server: :func:`elesium.graphs.audit_chain.verify_run` if it is
    installed (under the role an audit route needs), else "not available"."""
    try:
        from elesium.graphs.audit_chain import verify_run
    except ImportError:
        return JSONResponse({"available": False,
                             "detail": "audit chain verification is not available on this server"})
    who = _principal_of(request, session)
    allows = getattr(who, "allows", None)
    if allows is not None and not allows("auditor"):
        detail = "verifying the audit chain needs the 'auditor' role; this API key does not have it"
        return JSONResponse({"available": True, "detail": detail}, status_code=403)
    svc = services(request)

    def work() -> dict[str, Any]:
        row = svc.run_or_404(thread_id, run_id, who)
        prefix = {"cp_prefix": svc.saver.prefix} if hasattr(svc.saver, "prefix") else {}
        v = verify_run(svc.store.client, row.run_id, store=svc.store, acceptance=svc.acceptance, **prefix)
        return _verdict(v.model_dump(mode="json"))

    try:
        verdict = await run_in_threadpool(work)
    except (NotFound, KeyError):
        return JSONResponse({"available": True, "detail": f"run {run_id!r} not found"}, status_code=404)
    return JSONResponse({"available": True, "verdict": verdict, "source": "in-process"})


def _divergence_text(d: dict[str, Any] | None) -> str | None:
    if not d:
        return None
    where = ", ".join(f"{k} {d[k]}" for k in ("run_id", "node", "call", "step") if d.get(k) is not None)
    return (f"first divergence at {where or 'start'}, field {d.get('field')}: "
            f"recorded {json.dumps(d.get('recorded'), default=str)}, "
            f"replayed {json.dumps(d.get('replayed'), default=str)}")


async def resume_action(request: Request) -> Response:
    thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
    session = await _action_session(request, changes_state=True)
    if isinstance(session, JSONResponse):
        return session
    try:
        body = await request.json()
    except ValueError:
        return JSONResponse({"detail": "send JSON: {approved: true|false, reply?: string}"}, status_code=422)
    if not isinstance(body, dict) or not isinstance(body.get("approved"), bool):
        return JSONResponse({"detail": "approved must be true or false"}, status_code=422)
    who = _principal_of(request, session)

    def check() -> Any:
        return services(request).run_or_404(thread_id, run_id, who)

    try:
        row = await run_in_threadpool(check)
    except NotFound:
        return JSONResponse({"detail": f"run {run_id!r} not found"}, status_code=404)
    answer: dict[str, Any] = {"approved": body["approved"]}
    reply = body.get("reply")
    if isinstance(reply, str) and reply.strip():
        answer["reply"] = reply
    r = await _api(request, session, "POST", f"{_thread_path(thread_id)}/runs/wait",
                   {"assistant_id": row.assistant_id, "command": {"resume": answer}})
    if r.status_code >= 400:
        return JSONResponse({"detail": _detail(r)}, status_code=r.status_code)
    values = r.json() if r.content else {}
    new_run = (r.headers.get("content-location") or "").rsplit("/", 1)[-1] or None
    error = values.get("__error__") if isinstance(values, dict) else None
    return JSONResponse({
        "ok": error is None,
        "detail": error.get("message") if error else None,
        "outcome": values.get("outcome") if isinstance(values, dict) else None,
        "values": values,
        "run_id": new_run,
        "run_url": _run_url(thread_id, new_run) if new_run else None,
    })


async def audit_action(request: Request) -> Response:
    thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
    session = await _action_session(request, changes_state=False)
    if isinstance(session, JSONResponse):
        return session
    r = await _api(request, session, "GET", f"{_thread_path(thread_id)}/runs/{quote(run_id, safe='')}/audit")
    if r.status_code == 404 and _detail(r) == "Not Found":  # FastAPI's own 404: no such route here
        return await _audit_in_process(request, session, thread_id, run_id)
    if r.status_code >= 400:
        return JSONResponse({"available": True, "detail": _detail(r)}, status_code=r.status_code)
    return JSONResponse({"available": True, "verdict": _verdict(r.json())})


def _verdict(v: dict[str, Any]) -> dict[str, Any]:
    """The verdict in the page's terms (the route's ``entries_checked`` is the entries count)."""
    return {"ok": bool(v.get("ok")), "entries": v.get("entries", v.get("entries_checked")),
            "records": v.get("records_checked"), "sealed": v.get("sealed"), "signed": v.get("signed"),
            "signature_ok": v.get("signature_ok"), "first_bad": v.get("first_bad")}


# A Starlette mount, not FastAPI routes: the console authenticates by its session cookie, so it is
# outside the API's OpenAPI document and its per-route role table (every page still checks the
# tenant, and every action goes through the API's own role check).
mount = Mount("/console", routes=[
    Route("/", run_list, methods=["GET"]),
    Route("/runs", run_list, methods=["GET"]),
    Route("/runs/{thread_id}/{run_id}", run_page, methods=["GET"]),
    Route("/runs/{thread_id}/{run_id}/calls/{node}/{call}", trees.tree_page, methods=["GET"]),
    Route("/live", trees.live_page, methods=["GET"]),
    Route("/api/live", trees.live_stream, methods=["POST"]),
    Route("/login", login_form, methods=["GET"]),
    Route("/login", login, methods=["POST"]),
    Route("/logout", logout, methods=["POST"]),
    Route("/static/{name}", static, methods=["GET"]),
    Route("/api/runs/{thread_id}/{run_id}/replay", replay_action, methods=["POST"]),
    Route("/api/runs/{thread_id}/{run_id}/resume", resume_action, methods=["POST"]),
    Route("/api/runs/{thread_id}/{run_id}/audit", audit_action, methods=["GET"]),
])
