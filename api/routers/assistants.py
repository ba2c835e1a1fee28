"""Assistants: one per registered workflow version (read-only: workflows are registered in code)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from elesium.api.auth import Principal, principal
from elesium.api.execution import assistant_id_of
from elesium.api.routers.common import assistant_json, services
from elesium.api.schemas import AssistantSearch
from elesium.graphs.replay import jsonable

router = APIRouter(tags=["assistants"])


def _matches(wf: Any, body: AssistantSearch) -> bool:
    if body.graph_id and wf.name != body.graph_id:
        return False
    if body.name and body.name.lower() not in wf.name.lower():
        return False
    meta = assistant_json(wf)["metadata"]
    return all(meta.get(k) == v for k, v in (body.metadata or {}).items())


@router.post("/assistants/search")
def search_assistants(
    body: AssistantSearch, request: Request, response: Response, who: Principal = Depends(principal)
) -> list[dict[str, Any]]:
    found = [wf for wf in services(request).workflows() if _matches(wf, body)]
    page = found[body.offset : body.offset + body.limit]
    if body.offset + body.limit < len(found):
        response.headers["X-Pagination-Next"] = str(body.offset + body.limit)
    return [assistant_json(wf) for wf in page]


@router.post("/assistants/count")
def count_assistants(body: AssistantSearch, request: Request, who: Principal = Depends(principal)) -> int:
    return sum(1 for wf in services(request).workflows() if _matches(wf, body))


@router.get("/assistants/{assistant_id}")
def get_assistant(assistant_id: str, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    return assistant_json(services(request).resolve_assistant(assistant_id))


@router.get("/assistants/{assistant_id}/schemas")
def get_schemas(assistant_id: str, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    wf = services(request).resolve_assistant(assistant_id)
    schema = wf.json_schema() if hasattr(wf, "json_schema") else {}
    input_schema = schema.get("input") or schema.get("input_schema") or wf.input_model.model_json_schema()
    state_schema = schema.get("state") or schema.get("state_schema")
    output_schema = schema.get("output") or schema.get("output_schema") or state_schema
    return {
        "graph_id": wf.name,
        "input_schema": input_schema,
        "output_schema": output_schema,
        "state_schema": state_schema,
        "config_schema": None,
        "context_schema": None,
    }


@router.get("/assistants/{assistant_id}/graph")
def get_graph(
    assistant_id: str, request: Request, xray: str = "false", who: Principal = Depends(principal)
) -> dict[str, Any]:
    """The graph as drawn by LangGraph; ``xray`` is a bool or a depth, as langgraph-sdk sends it."""
    svc = services(request)
    wf = svc.resolve_assistant(assistant_id)
    flag = xray.strip().lower()
    depth: bool | int = int(flag) if flag.isdigit() else flag in ("true", "yes", "on")
    drawable = svc.graph(wf).get_graph(xray=depth)
    return jsonable(drawable.to_json())


@router.get("/assistants/{assistant_id}/subgraphs")
def get_subgraphs(assistant_id: str, request: Request, recurse: bool = False,
                  who: Principal = Depends(principal)) -> dict[str, Any]:
    """Registered workflows are flat graphs: no subgraphs."""
    services(request).resolve_assistant(assistant_id)
    return {}


@router.get("/assistants/{assistant_id}/subgraphs/{namespace}")
def get_subgraphs_at(assistant_id: str, namespace: str, request: Request, recurse: bool = False,
                     who: Principal = Depends(principal)) -> dict[str, Any]:
    services(request).resolve_assistant(assistant_id)
    return {}


@router.post("/assistants/{assistant_id}/versions")
def list_versions(
    assistant_id: str, request: Request, who: Principal = Depends(principal)
) -> list[dict[str, Any]]:
    wf = services(request).resolve_assistant(assistant_id)
    return [assistant_json(w) for w in services(request).workflows() if w.name == wf.name]


__all__ = ["router", "assistant_id_of"]
