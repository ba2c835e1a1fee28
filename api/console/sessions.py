"""Browser sessions of the console: an API key typed once into /console/login, then an opaque cookie.

Why an opaque server-side token rather than a signed cookie:

- the cookie holds 32 random bytes and nothing else; the record (Redis, under the token's SHA-256)
  names the key by its SHA-256 only, so neither the browser nor Redis ever stores the API key;
- logout deletes the record, so a copied cookie stops working at once (a signed cookie stays valid
  until it expires), and so does removing the key from the server's keys: every request looks the
  hash up among the keys the server knows now;
- every server sharing the Redis sees the same sessions, with no signing secret to distribute.

The cookie is HttpOnly (scripts cannot read it), SameSite=Strict (no other site's page sends it:
links from elsewhere land logged out, and cross-site form posts arrive without it) and Secure when
the request came over HTTPS. Each session also holds a CSRF token that the pages embed and every
state-changing request must echo (header ``X-CSRF-Token`` from fetch, or the form field ``csrf`` of
the logout form): SameSite=Strict alone would leave older browsers and same-site subdomains open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

COOKIE = "elesium_console"
TTL_S = 8 * 3600
PREFIX = "elesium:console:session:"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Session:
    key: str | None  # the API key the session acts with (None when the server runs without auth)
    csrf: str
    token: str | None


def create(client: Any, key: str) -> tuple[str, str]:
    """A new session for ``key`` (already checked): (cookie token, CSRF token)."""
    token = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(24)
    record = {"key_sha256": _digest(key), "csrf": csrf, "created": int(time.time())}
    client.set(PREFIX + _digest(token), json.dumps(record), ex=TTL_S)
    return token, csrf


def resolve(client: Any, token: str | None, known_keys: dict[str, str]) -> Session | None:
    """The session a cookie names, with the key it acts as; None if unknown, expired or revoked."""
    if not token or len(token) > 100:
        return None
    raw = client.get(PREFIX + _digest(token))
    if raw is None:
        return None
    record = json.loads(raw)
    for known in known_keys:
        if hmac.compare_digest(_digest(known), str(record.get("key_sha256", ""))):
            return Session(key=known, csrf=str(record["csrf"]), token=token)
    return None  # the key was removed from the server since the login


def delete(client: Any, token: str | None) -> None:
    if token:
        client.delete(PREFIX + _digest(token))


def csrf_ok(session: Session, presented: str | None) -> bool:
    return bool(presented) and hmac.compare_digest(session.csrf.encode(), str(presented).encode())
