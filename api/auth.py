"""API keys -> tenants: the ``Principal`` every route but health receives.

Keys are accepted as ``x-api-key`` (what langgraph-sdk sends) and as ``Authorization: Bearer``.
A missing or unknown key answers 401 with the same message either way, so a probe learns nothing
about which keys exist. The principal's ``key_id`` (a short hash, never the key) identifies who
approved an interrupt or ran a replay in the audit records.

Roles (per key, so per tenant: ``key=tenant:operator+approver``, see :mod:`elesium.api.settings`):

* ``reader``: reads (GETs, searches, counts, history, state); every role includes it;
* ``operator``: creates, cancels and deletes threads and runs, updates thread state, chat completions;
* ``approver``: resumes an interrupt (a run request with ``command.resume``);
* ``auditor``: replays, audit verification, purges, legal holds, the audit event stream; an auditor
  key (not admin or full access) also reads deleted threads kept for audit on GET routes;
* ``admin``: everything.

A key configured without roles has all of them (full access, as before roles existed). What each
route needs is declared once, in :data:`ROUTE_ROLES`, and enforced by one dependency
(``elesium.api.routers.common.authorize``) that the app installs on every router; a route missing
from the table is refused (fail closed) and fails ``tests/test_api_retention_roles.py``.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import ClassVar

from fastapi import Request

from elesium.api.errors import ApiError, Unauthorized
from elesium.api.settings import ROLES

ALL_ROLES = frozenset(ROLES)
PUBLIC = "public"
"""A route anyone may call, without a key (health checks)."""


class Forbidden(ApiError):
    """A known key whose roles do not allow this request (checked after ownership: 404 comes first)."""

    status_code: ClassVar[int] = 403


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str
    roles: frozenset[str] = ALL_ROLES
    audit_view: bool = False  # set per request (routers.common.authorize): sees deleted threads

    def allows(self, role: str) -> bool:
        """Whether this caller has ``role`` (admin has every role; every role can read)."""
        if role == PUBLIC or "admin" in self.roles:
            return True
        if role == "reader":
            return bool(self.roles)
        return role in self.roles

    def require(self, role: str, what: str) -> None:
        """403 naming the missing role unless the caller has it."""
        if not self.allows(role):
            raise Forbidden(f"{what} needs the {role!r} role; this API key has "
                            f"{', '.join(sorted(self.roles)) or 'no roles'}")

    @property
    def identity(self) -> str:
        """``tenant/key-id``: recorded as the approver of a resume and the author of a replay."""
        return f"{self.tenant}/{self.key_id}"


def key_id(key: str) -> str:
    """A short hash of the key: names who acted in audit records without storing the secret."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _presented_key(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def principal(request: Request) -> Principal:
    """FastAPI dependency: the caller's tenant and roles, or 401 (once per request: cached on it)."""
    cached = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    found = _authenticate(request)
    request.state.principal = found
    return found


def _authenticate(request: Request) -> Principal:
    settings = request.app.state.settings
    if not settings.auth:
        return Principal(tenant="default", key_id="no-auth")
    key = _presented_key(request)
    if key:
        for known, tenant in settings.api_keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                roles = settings.api_key_roles.get(known, ALL_ROLES)
                return Principal(tenant=tenant, key_id=key_id(known), roles=frozenset(roles))
    raise Unauthorized(
        "missing or invalid API key (send x-api-key or Authorization: Bearer)",
        headers={"WWW-Authenticate": "Bearer"},
    )


# ---------------------------------------------------------------- what each route needs
_RUN_CREATION = "operator|approver"  # operator to start a run, approver to resume an interrupt
ROUTE_ROLES: dict[tuple[str, str], str] = {
    # health: public
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    ("GET", "/info"): PUBLIC,  # as on the LangGraph Platform (Studio connects with it); no tenant data
    # reads
    ("GET", "/metrics"): "reader",
    ("GET", "/v1/models"): "reader",
    ("GET", "/elesium/whoami"): "reader",
    ("POST", "/assistants/search"): "reader",
    ("POST", "/assistants/count"): "reader",
    ("GET", "/assistants/{assistant_id}"): "reader",
    ("GET", "/assistants/{assistant_id}/schemas"): "reader",
    ("GET", "/assistants/{assistant_id}/graph"): "reader",
    ("GET", "/assistants/{assistant_id}/subgraphs"): "reader",
    ("POST", "/assistants/{assistant_id}/versions"): "reader",
    ("GET", "/assistants/{assistant_id}/subgraphs/{namespace}"): "reader",
    ("GET", "/store/items"): "reader",
    ("POST", "/store/items/search"): "reader",
    ("POST", "/store/namespaces"): "reader",
    ("POST", "/runs/crons/search"): "reader",
    ("POST", "/runs/crons/count"): "reader",
    ("POST", "/threads/search"): "reader",
    ("POST", "/threads/count"): "reader",
    ("GET", "/threads/{thread_id}"): "reader",
    ("GET", "/threads/{thread_id}/state"): "reader",
    ("GET", "/threads/{thread_id}/state/{checkpoint_id}"): "reader",
    ("POST", "/threads/{thread_id}/state/checkpoint"): "reader",
    ("POST", "/threads/{thread_id}/history"): "reader",
    ("GET", "/threads/{thread_id}/history"): "reader",
    ("GET", "/threads/{thread_id}/runs"): "reader",
    ("GET", "/threads/{thread_id}/runs/{run_id}"): "reader",
    ("GET", "/threads/{thread_id}/runs/{run_id}/join"): "reader",
    ("GET", "/threads/{thread_id}/runs/{run_id}/stream"): "reader",
    ("GET", "/threads/{thread_id}/runs/{run_id}/acceptance"): "reader",
    ("GET", "/threads/{thread_id}/runs/{run_id}/replays"): "reader",
    # operations
    ("POST", "/threads"): "operator",
    ("PATCH", "/threads/{thread_id}"): "operator",
    ("DELETE", "/threads/{thread_id}"): "operator",
    ("POST", "/threads/{thread_id}/state"): "operator",
    ("POST", "/threads/{thread_id}/runs/{run_id}/cancel"): "operator",
    ("DELETE", "/threads/{thread_id}/runs/{run_id}"): "operator",
    ("POST", "/v1/chat/completions"): "operator",
    ("PUT", "/store/items"): "operator",
    ("DELETE", "/store/items"): "operator",
    ("POST", "/runs/crons"): "operator",  # a cron starts runs: its creator needs what starting one needs
    ("POST", "/threads/{thread_id}/runs/crons"): "operator",
    ("PATCH", "/runs/crons/{cron_id}"): "operator",
    ("DELETE", "/runs/crons/{cron_id}"): "operator",
    # run creation: operator or approver here; the request then needs approver for command.resume,
    # operator otherwise (Services.prepare_run)
    ("POST", "/threads/{thread_id}/runs"): _RUN_CREATION,
    ("POST", "/threads/{thread_id}/runs/wait"): _RUN_CREATION,
    ("POST", "/threads/{thread_id}/runs/stream"): _RUN_CREATION,
    ("POST", "/runs"): _RUN_CREATION,
    ("POST", "/runs/wait"): _RUN_CREATION,
    ("POST", "/runs/stream"): _RUN_CREATION,
    # audit
    ("POST", "/threads/{thread_id}/runs/{run_id}/replay"): "auditor",
    ("GET", "/threads/{thread_id}/runs/{run_id}/audit"): "auditor",  # the run's audit chain (verify)
    ("POST", "/threads/{thread_id}/purge"): "auditor",
    ("GET", "/threads/{thread_id}/retention"): "auditor",
    ("PUT", "/threads/{thread_id}/legal-hold"): "auditor",
    ("DELETE", "/threads/{thread_id}/legal-hold"): "auditor",
    ("GET", "/elesium/audit/events"): "auditor",
    ("POST", "/elesium/audit/purge-expired"): "auditor",
}
"""(method, path template) -> the role it needs: one of :data:`ROLES`, ``a|b`` (either), or PUBLIC."""


def route_role(method: str, path: str) -> str | None:
    """The role a route needs; None when it is not declared (the route is then refused).

    Besides the table, audit routes are auditor's by their path: anything under ``/elesium/audit/``
    and any ``.../verify`` or ``.../audit`` (audit chain verification), so such a route is guarded even
    before it is listed.
    """
    role = ROUTE_ROLES.get((method.upper(), path))
    if role is None and (path.startswith("/elesium/audit/") or path.endswith(("/verify", "/audit"))):
        role = "auditor"
    return role


def allows_any(who: Principal, role: str) -> bool:
    return any(who.allows(r) for r in role.split("|"))
