"""The FastAPI application: ``create_app(settings, engine=..., registry=...)``.

One router per resource (assistants, threads, runs, elesium extras, openai, ops); the state lives in
Redis (threads/runs in :mod:`elesium.state.threads`, checkpoints in the RedisSaver, the acceptance
log, the run registry); the engine runs on its own thread. A pure ASGI guard in front of the routes
refuses oversized bodies (413, before parsing), keeps the OpenAPI docs behind the API key like
everything but health, and counts requests and latency per route template.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from elesium.api.errors import install_handlers
from elesium.api.execution import Services
from elesium.api.metrics import Metrics
from elesium.api.settings import ApiSettings
from elesium.api.tracing import RequestSpans, Tracing
from elesium.api.worker import EngineWorker
from elesium.graphs.registry import Registry
from elesium.inference.types import TextEngine

log = logging.getLogger("elesium.api")
PUBLIC_PATHS = ("/healthz", "/readyz")
DOC_PATHS = ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect")


class Guard:
    """Body-size limit, auth on the docs, and per-route request metrics (pure ASGI: streams pass through)."""

    def __init__(self, app: Any, settings: ApiSettings, metrics_of: Any) -> None:
        self.app, self.settings, self.metrics_of = app, settings, metrics_of

    async def _reply(self, send: Any, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.settings.max_body_bytes
            except ValueError:
                await self._reply(send, 400, "invalid Content-Length")
                return
            if too_big:
                await self._reply(send, 413, f"request body over {self.settings.max_body_bytes} bytes")
                return
        if scope["path"] in DOC_PATHS and self.settings.auth:
            key = headers.get(b"x-api-key", b"").decode() or headers.get(b"authorization", b"").decode()[7:]
            if key.strip() not in self.settings.api_keys:
                await self._reply(
                    send, 401, "missing or invalid API key (send x-api-key or Authorization: Bearer)"
                )
                return
        status = {"code": 500}
        start = time.perf_counter()

        async def tracked_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            metrics = self.metrics_of()
            if metrics is not None:
                metrics.requests.labels(route=route, method=scope["method"], status=str(status["code"])).inc()
                metrics.latency.labels(route=route, method=scope["method"]).observe(
                    time.perf_counter() - start
                )


def build_services(settings: ApiSettings, engine: TextEngine, registry: Registry) -> Services:
    from elesium.api.events import EventPump
    from elesium.graphs.calibration import NodeCalibrator
    from elesium.state import AcceptanceLog, RedisSaver, Retention, RunRegistry, connect, default_url
    from elesium.state.calibrations import CalibrationStore
    from elesium.state.connection import describe
    from elesium.state.queue import RunQueue
    from elesium.state.run_events import RunEvents
    from elesium.state.threads import ThreadStore

    url = settings.redis_url or default_url()
    client = connect(url)
    target = describe(url)
    # One thread per generation the engine can batch (a TextEngine without a batcher: one).
    batcher = getattr(engine, "batcher", None)
    worker = EngineWorker(threads=batcher.slots if batcher is not None else 1)
    metrics = Metrics(queue_depth=lambda: worker.depth, engine=engine, queued_jobs=lambda: worker.queued)
    saver = metrics.timed_checkpoints(RedisSaver(client, target=target))
    events = RunEvents(client, target=target)
    acceptance = AcceptanceLog(client, target=target, retention=Retention(maxlen=None))
    runs_registry = RunRegistry(client, target=target)
    # Built whether or not self-tuning is on: runs record each node's version either way, and a
    # replay decodes with the versions its run recorded.
    calibrator = NodeCalibrator(CalibrationStore(client, target=target), acceptance, runs=runs_registry,
                                use=settings.self_tuning, learn=settings.self_tuning,
                                cost=engine.step_cost)
    return Services(
        settings=settings,
        engine=engine,
        registry=registry,
        store=ThreadStore(client, target=target),
        saver=saver,
        acceptance=acceptance,
        runs_registry=runs_registry,
        calibrator=calibrator,
        worker=worker,
        metrics=metrics,
        tracing=Tracing(settings.otel_exporter, settings.model_name),
        queue=RunQueue(client, target=target, name=settings.queue_name,
                       lease_ttl_ms=int(settings.lease_ttl_s * 1000)),
        events=events,
        pump=EventPump(events),
    )


def start_queue_worker(svc: Services, concurrency: int) -> Any:
    """This server's in-process queue worker (the single-machine default): it executes API runs and
    runs submitted with :func:`elesium.graphs.background.submit`, like ``elesium worker`` does."""
    from elesium.api.run_executor import ApiRunExecutor, Dispatcher
    from elesium.graphs.background import WorkflowExecutor
    from elesium.graphs.runner import WorkflowRunner
    from elesium.state.queue_worker import QueueWorker

    runner = WorkflowRunner(svc.engine, svc.settings.redis_url, registry=svc.registry)
    execute = Dispatcher(ApiRunExecutor(svc), WorkflowExecutor(runner))
    return QueueWorker(svc.queue, execute, concurrency=concurrency).start()


def _observe(svc: Services, *, on: bool) -> None:
    """Feed (or stop feeding) the engine's per-generation timings into this app's serving metrics.

    Only while the app lives: an engine shared by several apps (tests) must not keep a stopped app's
    metrics alive, nor count into them. An engine without observers (a test double) is skipped.
    """
    engine = svc.engine
    method = getattr(engine, "add_observer" if on else "remove_observer", None)
    if method is not None:
        method(svc.metrics.observe_generation)


def create_app(settings: ApiSettings | None = None, *, engine: TextEngine | None = None,
               registry: Registry | None = None) -> FastAPI:
    """The Elesium API.

    Args:
        settings: keys, limits, state server; default :meth:`ApiSettings.from_env` (auth on).
        engine: a loaded Engine; None loads the default one (bundled model) at startup.
        registry: the workflow registry; None uses ``elesium.graphs.workflows.default_registry()``.
    """
    settings = settings or ApiSettings.from_env()
    holder: dict[str, Services] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if "svc" not in holder:
            _install(app)
        svc = holder["svc"]
        queue_worker = start_queue_worker(svc, settings.workers) if settings.workers > 0 else None
        from elesium.api.retention import RetentionSweep

        sweep = (RetentionSweep(svc, settings.audit_sweep_interval_s).start()
                 if settings.audit_sweep_interval_s > 0 else None)
        try:
            yield
        finally:
            holder.pop("svc", None)
            _observe(svc, on=False)
            if sweep is not None:
                sweep.stop()
            if queue_worker is not None:
                handed = queue_worker.stop(grace_s=settings.shutdown_grace_s)
                if handed:
                    log.info("handed %d run(s) back to the queue: %s", len(handed), ", ".join(handed))
            svc.pump.stop()
            svc.worker.stop()
            svc.tracing.shutdown()

    app = FastAPI(
        title="Elesium",
        version="0.1.0",
        lifespan=lifespan,
        description="LangGraph-compatible agent runs on an exact speculative-decoding engine, "
        "audited in Redis. Auth: x-api-key or Authorization: Bearer.",
    )
    app.state.settings = settings

    def _install(app: FastAPI) -> None:
        eng: TextEngine
        if engine is None:
            from elesium.inference.engine import Engine

            loaded = Engine.load()
            loaded.warm_up()  # before the first request (Engine.warm_up says why)
            eng = loaded
        else:
            eng = engine
        reg = registry
        if reg is None:
            from elesium.graphs.workflows import default_registry

            reg = default_registry()
        svc = build_services(settings, eng, reg)
        if "svc" in holder:
            _observe(holder["svc"], on=False)
        holder["svc"] = svc
        _observe(svc, on=True)
        app.state.services = svc

    app.state.install = lambda: _install(app)

    from fastapi import Depends

    from elesium.api.routers import assistants, audit_admin, crons, elesium, openai, ops, runs, store, threads
    from elesium.api.routers.common import authorize

    # Every route's role (elesium.api.auth.ROUTE_ROLES) is checked by this one dependency.
    for module in (ops, assistants, threads, crons, runs, store, elesium, openai, audit_admin):
        app.include_router(module.router, dependencies=[Depends(authorize)])
    from elesium.api.console import mount as console  # the audit console at /console (its own login)
    app.router.routes.append(console)

    install_handlers(app)

    app.add_middleware(
        Guard, settings=settings, metrics_of=lambda: getattr(holder.get("svc"), "metrics", None)
    )
    if (settings.otel_exporter or "none").strip().lower() != "none":  # a request span (api/tracing.py)
        app.add_middleware(RequestSpans, tracing_of=lambda: getattr(holder.get("svc"), "tracing", None))
    return app
