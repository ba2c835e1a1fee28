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
