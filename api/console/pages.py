"""What every console page and action shares: templates, security headers, the session and who it is,
the tenant/role check, and the redirects (used by :mod:`.routes` and :mod:`.trees`)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from elesium.api.auth import Principal, principal
from elesium.api.console import sessions
from elesium.api.routers.common import services

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".svg": "image/svg+xml"}
TEMPLATES = Environment(loader=FileSystemLoader(str(HERE / "templates")),
                        autoescape=select_autoescape(["html"], default=True))
SECURITY_HEADERS = {
    # Everything is served from here: no CDN, no inline script, no framing.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
STATUSES = ("pending", "running", "success", "error", "interrupted", "timeout")
MAX_THREADS = 500



# ---------------------------------------------------------------- helpers
def _when(ms: int | None) -> str:
    if not ms:
        return ""
    return dt.datetime.fromtimestamp(int(ms) / 1000, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _page(request: Request, template: str, code: int = 200, **context: Any) -> HTMLResponse:
    session = context.get("session")
    body = TEMPLATES.get_template(template).render(
        csrf=session.csrf if session else "", logged_in=session is not None,
        auth=request.app.state.settings.auth, **context,
    )
    return HTMLResponse(body, status_code=code, headers=SECURITY_HEADERS)


def _client(request: Request) -> Any:
    return services(request).store.client


def _session(request: Request) -> sessions.Session | None:
    settings = request.app.state.settings
    if not settings.auth:
        return sessions.Session(key=None, csrf="no-auth", token=None)
    return sessions.resolve(_client(request), request.cookies.get(sessions.COOKIE), settings.api_keys)


def _principal_of(request: Request, session: sessions.Session) -> Principal:
    """The session key's principal, by the API's own check (so the console can never be looser)."""
    headers = [(b"x-api-key", session.key.encode())] if session.key else []
    return principal(Request({"type": "http", "headers": headers, "app": request.app, "method": "GET",
                              "path": "/console", "query_string": b""}))


def _fields(value: Any) -> list[tuple[str, str]]:
    """An interrupt's payload as (field, text) rows: strings as they are, the rest as JSON."""
    items = value.items() if isinstance(value, dict) else [("value", value)]
    return [(str(k), v if isinstance(v, str) else json.dumps(v, indent=1, ensure_ascii=False, default=str))
            for k, v in items]


def _refused(request: Request, session: sessions.Session, who: Principal) -> Response | None:
    """A 403 page for a key whose roles do not include reading (the API's ``reader`` routes)."""
    allows = getattr(who, "allows", None)
    if allows is None or allows("reader"):
        return None
    return _page(request, "error.html", code=403, session=session, who=who, title="Not allowed",
                 message="This API key may not read runs (it needs the 'reader' role).")


def _to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/console/login?{urlencode({'next': target})}", status_code=303)


def _safe_next(target: str | None) -> str:
    if target and target.startswith("/console/") and "\\" not in target:
        return target
    return "/console/"


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin:
        return True  # non-browser clients send neither; a browser's cross-site post sends Origin
    parts = urlsplit(origin)
    return parts.netloc == request.headers.get("host", "")


def _run_url(thread_id: str, run_id: str) -> str:
    return f"/console/runs/{quote(thread_id, safe='')}/{quote(run_id, safe='')}"


# ---------------------------------------------------------------- static files and login


async def _action_session(request: Request, *, changes_state: bool) -> sessions.Session | JSONResponse:
    session = await run_in_threadpool(_session, request)
    if session is None:
        return JSONResponse({"detail": "not logged in (or the session expired): log in again"},
                            status_code=401)
    if changes_state and not sessions.csrf_ok(session, request.headers.get("x-csrf-token")):
        return JSONResponse({"detail": "missing or wrong CSRF token: reload the page"}, status_code=403)
    return session
