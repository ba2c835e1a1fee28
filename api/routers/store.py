"""The store API (``/store/...``, langgraph-sdk's ``client.store``): items per tenant, in Redis.

Namespaces are tuples of labels (sent as lists; ``GET /store/items`` takes them dot-joined, as the SDK
sends them, so a label holds no ``.``). A TTL is in minutes and refreshed on read unless
``refresh_ttl`` is false. Search filters on the value's fields (exact, or ``$eq``/``$ne``/``$gt``/
``$gte``/``$lt``/``$lte``) with limit and offset; a natural-language ``query`` needs an embeddings index,
which this server does not have, so it is refused (422) rather than answered unranked.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from elesium.api.auth import Principal, principal
from elesium.api.errors import InvalidRequest, NotFound
from elesium.api.routers.common import services
from elesium.state.store import ItemStore

router = APIRouter(tags=["store"])


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PutItem(_Body):
    namespace: list[str]
    key: str = Field(min_length=1, max_length=1000)
    value: dict[str, Any]
    index: Any = None
    ttl: float | None = Field(default=None, gt=0)


class DeleteItem(_Body):
    namespace: list[str]
    key: str = Field(min_length=1, max_length=1000)


class SearchItems(_Body):
    namespace_prefix: list[str] = Field(default_factory=list)
    filter: dict[str, Any] | None = None
    limit: int = Field(default=10, ge=0, le=1000)
    offset: int = Field(default=0, ge=0)
    query: str | None = None
    refresh_ttl: bool | None = None


class ListNamespaces(_Body):
    prefix: list[str] | None = None
    suffix: list[str] | None = None
    max_depth: int | None = Field(default=None, ge=1)
    limit: int = Field(default=100, ge=0, le=1000)
    offset: int = Field(default=0, ge=0)


def items(request: Request) -> ItemStore:
    """The app's item store (on the services' Redis client; one per services instance)."""
    svc = services(request)
    cached = getattr(request.app.state, "item_store", None)
    if cached is None or cached[0] is not svc:
        cached = (svc, ItemStore(svc.store.client))
        request.app.state.item_store = cached
    return cached[1]


def _namespace(labels: list[str], *, allow_empty: bool = False) -> list[str]:
    if not labels and not allow_empty:
        raise InvalidRequest("namespace must have at least one label")
    for label in labels:
        if not isinstance(label, str) or not label or "." in label:
            raise InvalidRequest(f"invalid namespace label {label!r}: labels are non-empty and hold no '.'")
    return labels


@router.put("/store/items", status_code=204)
def put_item(body: PutItem, request: Request, who: Principal = Depends(principal)) -> Response:
    if body.index not in (None, False):
        raise InvalidRequest(
            "index fields need an embeddings index, which this store does not have; "
            "send index=False or leave it out"
        )
    items(request).put(who.tenant, _namespace(body.namespace), body.key, body.value, body.ttl)
    return Response(status_code=204)


@router.get("/store/items")
def get_item(
    request: Request,
    key: str,
    namespace: str = "",
    refresh_ttl: bool = True,
    who: Principal = Depends(principal),
) -> dict[str, Any]:
    labels = _namespace(namespace.split(".") if namespace else [])
    found = items(request).get(who.tenant, labels, key, refresh_ttl=refresh_ttl)
    if found is None:
        raise NotFound(f"item {key!r} not found in namespace {labels}")
    return found


@router.delete("/store/items", status_code=204)
def delete_item(body: DeleteItem, request: Request, who: Principal = Depends(principal)) -> Response:
    items(request).delete(who.tenant, _namespace(body.namespace), body.key)
    return Response(status_code=204)


@router.post("/store/items/search")
def search_items(body: SearchItems, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    if body.query:
        raise InvalidRequest(
            "semantic search (query) needs an embeddings index, which this store does not "
            "have; search with namespace_prefix and filter"
        )
    found = items(request).search(
        who.tenant,
        _namespace(body.namespace_prefix, allow_empty=True),
        filter=body.filter,
        limit=body.limit,
        offset=body.offset,
        refresh_ttl=body.refresh_ttl is not False,
    )
    return {"items": found}


@router.post("/store/namespaces")
def list_namespaces(
    body: ListNamespaces, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    names = items(request).namespaces(
        who.tenant,
        prefix=_namespace(body.prefix or [], allow_empty=True),
        suffix=_namespace(body.suffix or [], allow_empty=True),
        max_depth=body.max_depth,
        limit=body.limit,
        offset=body.offset,
    )
    return {"namespaces": names}
