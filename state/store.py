"""The LangGraph Platform store API's items (``/store/...``), per tenant, in Redis.

An item is ``(namespace: tuple[str, ...], key) -> value`` (a JSON object), with created/updated times
and an optional TTL in minutes (LangGraph's unit), refreshed on read unless the reader says not to.

Keys (``P = <prefix>:{<tenant>}:``, one hash tag per tenant so a search is slot-local on a Cluster)::

    P idx          zset    item ids (JSON ``[*namespace, key]``), score = updated ms
    P item:<sha>   string  the item (JSON), with PEXPIRE when it has a TTL

An item that expired leaves its id in ``idx`` until a read finds it gone and removes it. No semantic
index: a search with ``query`` is refused by the API (no embeddings configured).
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from elesium.state.errors import translate_errors

DEFAULT_PREFIX = "elesium:store"
_OPS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte")


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat()


def _matches(value: dict[str, Any], flt: dict[str, Any]) -> bool:
    """LangGraph's store filter: exact match per field, or ``{"$gt": x, ...}`` comparisons."""
    for field, want in flt.items():
        have = value.get(field)
        if isinstance(want, dict) and want and all(k in _OPS for k in want):
            for op, arg in want.items():
                try:
                    ok = {"$eq": have == arg, "$ne": have != arg}.get(op)
                    if ok is None:
                        if have is None:
                            return False
                        ok = {"$gt": have > arg, "$gte": have >= arg, "$lt": have < arg, "$lte": have <= arg}[
                            op
                        ]
                except TypeError:
                    return False
                if not ok:
                    return False
        elif have != want:
            return False
    return True


class ItemStore:
    """CRUD and search of a tenant's store items (see the module docstring)."""

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, target: str = "the configured server"
    ) -> None:
        self.client = client
        self._p = prefix
        self._target = target

    def _base(self, tenant: str) -> str:
        return f"{self._p}:{{{quote(tenant, safe='') or '%'}}}:"

    def _idx(self, tenant: str) -> str:
        return self._base(tenant) + "idx"

    @staticmethod
    def _ident(namespace: list[str], key: str) -> str:
        return json.dumps([*namespace, key], separators=(",", ":"))

    def _item_key(self, tenant: str, ident: str) -> str:
        return self._base(tenant) + "item:" + hashlib.sha256(ident.encode()).hexdigest()

    def _guard(self) -> Any:
        return translate_errors(f"the store keys {self._p}:*", self._target)

    # ---------------------------------------------------------------- items
    def put(
        self,
        tenant: str,
        namespace: list[str],
        key: str,
        value: dict[str, Any],
        ttl_minutes: float | None = None,
    ) -> dict[str, Any]:
        ident = self._ident(namespace, key)
        item_key = self._item_key(tenant, ident)
        now = int(time.time() * 1000)
        with self._guard():
            old = self.client.get(item_key)
            created = json.loads(old)["created_ms"] if old else now
            ttl_ms = int(ttl_minutes * 60_000) if ttl_minutes else None
            record = {
                "namespace": list(namespace),
                "key": key,
                "value": value,
                "created_ms": created,
                "updated_ms": now,
                "ttl_ms": ttl_ms,
            }
            self.client.zadd(self._idx(tenant), {ident: now})  # the index first: a crash leaves a stale id
            self.client.set(item_key, json.dumps(record), px=ttl_ms)
        return self._public(record)

    def get(
        self, tenant: str, namespace: list[str], key: str, *, refresh_ttl: bool = True
    ) -> dict[str, Any] | None:
        item_key = self._item_key(tenant, self._ident(namespace, key))
        with self._guard():
            raw = self.client.get(item_key)
            if raw is None:
                return None
            record = json.loads(raw)
            if refresh_ttl and record.get("ttl_ms"):
                self.client.pexpire(item_key, record["ttl_ms"])
        return self._public(record)

    def delete(self, tenant: str, namespace: list[str], key: str) -> bool:
        ident = self._ident(namespace, key)
        with self._guard():
            gone = bool(self.client.delete(self._item_key(tenant, ident)))
            self.client.zrem(self._idx(tenant), ident)
        return gone

    def _records(self, tenant: str, prefix: list[str]) -> list[tuple[str, dict[str, Any]]]:
        """The tenant's live items under ``prefix`` (ident, record), most recently updated first."""
        with self._guard():
            idents = [
                m.decode() if isinstance(m, bytes) else m
                for m in self.client.zrevrange(self._idx(tenant), 0, -1)
            ]
            wanted = [i for i in idents if json.loads(i)[:-1][: len(prefix)] == list(prefix)]
            if not wanted:
                return []
            raws = self.client.mget([self._item_key(tenant, i) for i in wanted])
            stale = [i for i, raw in zip(wanted, raws, strict=True) if raw is None]
            if stale:
                self.client.zrem(self._idx(tenant), *stale)
        return [(i, json.loads(raw)) for i, raw in zip(wanted, raws, strict=True) if raw is not None]

    def search(
        self,
        tenant: str,
        prefix: list[str],
        *,
        filter: dict[str, Any] | None = None,
        limit: int = 10,
        offset: int = 0,
        refresh_ttl: bool = True,
    ) -> list[dict[str, Any]]:
        found = [(i, r) for i, r in self._records(tenant, prefix) if _matches(r["value"], filter or {})]
        page = found[offset : offset + limit]
        if refresh_ttl:
            with self._guard():
                for ident, record in page:
                    if record.get("ttl_ms"):
                        self.client.pexpire(self._item_key(tenant, ident), record["ttl_ms"])
        return [self._public(r) for _, r in page]

    def namespaces(
        self,
        tenant: str,
        *,
        prefix: list[str] | None = None,
        suffix: list[str] | None = None,
        max_depth: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[list[str]]:
        seen: set[tuple[str, ...]] = set()
        for _, record in self._records(tenant, list(prefix or [])):
            ns = tuple(record["namespace"])
            if suffix and list(ns[len(ns) - len(suffix) :]) != list(suffix):
                continue
            seen.add(ns[:max_depth] if max_depth is not None else ns)
        return [list(ns) for ns in sorted(seen)][offset : offset + limit]

    @staticmethod
    def _public(record: dict[str, Any]) -> dict[str, Any]:
        return {
            "namespace": record["namespace"],
            "key": record["key"],
            "value": record["value"],
            "created_at": _iso(record["created_ms"]),
            "updated_at": _iso(record["updated_ms"]),
        }
