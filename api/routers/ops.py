"""Operations: liveness, readiness (engine loaded, Redis reachable) and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from elesium.api.auth import Principal, principal
from elesium.api.routers.common import services

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process answers (served on the event loop, never behind the engine)."""
    return {"status": "ok"}


@router.get("/info")
def info() -> dict[str, Any]:
    """What the LangGraph Platform's ``GET /info`` answers (LangGraph Studio calls it to connect): the
    server's version, the LangGraph version it runs, and which optional APIs it serves. Public, as on
    the Platform; it names no tenant, key or object."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "version": installed("elesium") or "0.1.0",
        "langgraph_py_version": installed("langgraph"),
        "flags": {"assistants": True, "crons": True, "langsmith": False, "langsmith_tracing_replicas": False},
        "host": {"kind": "self-hosted", "project_id": None, "revision_id": None, "tenant_id": None},
        "metadata": {"server": "elesium"},
    }


@router.get("/readyz")
def readyz(request: Request) -> Any:
    svc = services(request)
    checks = {"engine": svc.engine is not None, "redis": False}
    try:
        checks["redis"] = bool(svc.store.client.ping())
    except Exception:  # noqa: BLE001 - unreachable Redis is exactly what this reports
        checks["redis"] = False
    ok = all(checks.values())
    return JSONResponse(
        {"status": "ready" if ok else "not ready", "checks": checks, "engine_queue_depth": svc.worker.depth},
        status_code=200 if ok else 503,
    )


@router.get("/metrics")
def metrics(request: Request, who: Principal = Depends(principal)) -> Response:
    return Response(generate_latest(services(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
