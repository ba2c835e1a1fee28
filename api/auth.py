"""API keys -> tenants: the ``Principal`` every route but health receives.

Keys are accepted as ``x-api-key`` (what langgraph-sdk sends) and as ``Authorization: Bearer``.
A missing or unknown key answers 401 with the same message either way, so a probe learns nothing
about which keys exist. The principal's ``key_id`` (a short hash, never the key) identifies who
approved an interrupt or ran a replay in the audit records.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request

from elesium.api.errors import Unauthorized


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str

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
    """FastAPI dependency: the caller's tenant, or 401."""
    settings = request.app.state.settings
    if not settings.auth:
        return Principal(tenant="default", key_id="no-auth")
    key = _presented_key(request)
    if key:
        for known, tenant in settings.api_keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return Principal(tenant=tenant, key_id=key_id(known))
    raise Unauthorized(
        "missing or invalid API key (send x-api-key or Authorization: Bearer)",
        headers={"WWW-Authenticate": "Bearer"},
    )
