"""The audit console: server-rendered HTML pages at ``/console`` over the same keys and tenants as the API.

``routes`` holds the pages and the actions, ``sessions`` the browser login (an opaque token in an
HttpOnly, SameSite=Strict cookie; the record, in Redis, names the key by its hash only), ``views``
what a page shows (the graph as inline SVG, checkpoint diffs, tokens shaded by acceptance depth),
``trees`` a call's decoding step by step (recorded trees, and live decoding streamed as it happens).
Templates, scripts and the style sheet ship as package data (no CDN: it works offline).
"""

from __future__ import annotations

from elesium.api.console.routes import mount

__all__ = ["mount"]
