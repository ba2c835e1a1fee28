"""Crons (``/runs/crons``, langgraph-sdk's ``client.crons``): runs started on a schedule.

A cron holds a run request, validated like ``POST /runs`` when the cron is created or updated (the
creator needs the operator role; the input must fit the workflow) and started by the server's
scheduler at each scheduled time: on its thread for ``create_for_thread`` (a thread busy at that time
skips that fire, as ``multitask_strategy=reject`` would), on a new thread per fire otherwise (kept, with
metadata ``cron_id``, so every cron run stays auditable: ``on_run_completed="delete"`` is not honoured).
Schedules are the standard five cron fields (:mod:`elesium.state.crons`), in ``timezone`` (UTC default).
Every server runs a scheduler; each fire is claimed once in Redis, so N servers start one run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elesium.api.auth import Principal, principal
from elesium.api.errors import InvalidRequest, NotFound
from elesium.api.execution import Services, assistant_id_of, iso
from elesium.api.routers.common import services
from elesium.api.schemas import RunCreate
from elesium.state.crons import CronStore, ScheduleError, next_fire_ms, now_ms, zone
from elesium.state.threads import ThreadRow

log = logging.getLogger("elesium.api")
SCHEDULER_INTERVAL_S = 1.0
_RUN_FIELDS = (
    "input",
    "config",
    "context",
    "metadata",
    "stream_mode",
    "interrupt_before",
    "interrupt_after",
    "multitask_strategy",
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CronCreate(_Body):
    assistant_id: str = Field(min_length=1, max_length=200)
    schedule: str = Field(min_length=1, max_length=200)
    input: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    context: dict[str, Any] | None = None
    webhook: str | None = None
    interrupt_before: Any = None
    interrupt_after: Any = None
    multitask_strategy: str | None = None
    end_time: datetime | None = None
    enabled: bool | None = None
    timezone: str | None = None
    stream_mode: Any = None
    on_run_completed: Literal["delete", "keep"] | None = None


class CronPatch(_Body):
    schedule: str | None = Field(default=None, min_length=1, max_length=200)
    timezone: str | None = None
    end_time: datetime | None = None
    input: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    context: dict[str, Any] | None = None
    webhook: str | None = None
    interrupt_before: Any = None
    interrupt_after: Any = None
    on_run_completed: Literal["delete", "keep"] | None = None
    enabled: bool | None = None
    stream_mode: Any = None


class CronSearch(_Body):
    assistant_id: str | None = None
    thread_id: str | None = None
    enabled: bool | None = None
    metadata: dict[str, Any] | None = None
    limit: int = Field(default=10, ge=0, le=1000)
    offset: int = Field(default=0, ge=0)
    sort_by: (
        Literal[
            "cron_id", "assistant_id", "thread_id", "created_at", "updated_at", "next_run_date", "end_time"
        ]
        | None
    ) = None
    sort_order: Literal["asc", "desc"] | None = None
    select: list[str] | None = None


def crons(svc: Services, app_state: Any) -> CronStore:
    cached = getattr(app_state, "cron_store", None)
    if cached is None or cached[0] is not svc:
        cached = (svc, CronStore(svc.store.client))
        app_state.cron_store = cached
    return cached[1]


def _store(request: Request) -> CronStore:
    return crons(services(request), request.app.state)


def cron_json(cron: dict[str, Any]) -> dict[str, Any]:
    return {
        "cron_id": cron["cron_id"],
        "assistant_id": cron["assistant_id"],
        "thread_id": cron.get("thread_id"),
        "on_run_completed": cron.get("on_run_completed"),
        "end_time": iso(cron["end_ms"]) if cron.get("end_ms") is not None else None,
        "schedule": cron["schedule"],
        "timezone": cron.get("timezone"),
        "created_at": iso(cron["created_ms"]),
        "updated_at": iso(cron["updated_ms"]),
        "payload": cron["payload"],
        "user_id": cron.get("user_id"),
        "next_run_date": iso(cron["next_ms"]) if cron.get("next_ms") is not None else None,
        "metadata": cron.get("metadata") or {},
        "enabled": bool(cron.get("enabled", True)),
    }


def _end_ms(end: datetime | None) -> int | None:
    if end is None:
        return None
    if end.tzinfo is None:
        end = end.replace(tzinfo=timezone.utc)
    return int(end.timestamp() * 1000)


def _validate(svc: Services, who: Principal, cron: dict[str, Any]) -> None:
    """The cron's schedule and run request, checked as ``POST /runs`` checks a run (4xx, nothing written)."""
    try:
        zone(cron.get("timezone"))
        cron["next_ms"] = next_fire_ms(cron["schedule"], now_ms(), cron.get("timezone"), cron.get("end_ms"))
    except ScheduleError as exc:
        raise InvalidRequest(f"invalid cron schedule: {exc}") from None
    body = _run_body(cron)
    if cron.get("thread_id"):
        thread = svc.thread_or_404(cron["thread_id"], who)
        thread = thread.model_copy(update={"status": "idle"})  # a busy thread now may be idle at fire time
    else:
        thread = ThreadRow(thread_id=str(uuid.uuid4()), tenant=who.tenant, metadata={})
    wf, _ = svc.prepare_run(who, thread, body)
    cron["assistant_id"] = assistant_id_of(wf)


def _run_body(cron: dict[str, Any]) -> RunCreate:
    payload = cron["payload"]
    try:
        return RunCreate(
            **{**payload, "metadata": {**(payload.get("metadata") or {}), "cron_id": cron["cron_id"]}}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"invalid cron run request: {where}: {first.get('msg')}") from None


def _create(request: Request, who: Principal, body: CronCreate, thread_id: str | None) -> dict[str, Any]:
    svc = services(request)
    if body.webhook:
        raise InvalidRequest("webhooks are not supported")
    now = now_ms()
    payload = {
        "assistant_id": body.assistant_id,
        **{k: v for k in _RUN_FIELDS if (v := getattr(body, k)) is not None},
    }
    cron: dict[str, Any] = {
        "cron_id": str(uuid.uuid4()),
        "tenant": who.tenant,
        "thread_id": thread_id,
        "assistant_id": body.assistant_id,
        "schedule": body.schedule,
        "timezone": body.timezone,
        "end_ms": _end_ms(body.end_time),
        "enabled": body.enabled is not False,
        "payload": payload,
        "metadata": body.metadata or {},
        "on_run_completed": body.on_run_completed or (None if thread_id else "keep"),
        "created_ms": now,
        "updated_ms": now,
        "user_id": who.identity,
        "key_id": who.key_id,
    }
    if thread_id is not None:
        svc.thread_or_404(thread_id, who)  # ownership first: 404 before any other check
    _validate(svc, who, cron)
    return cron_json(_store(request).save(cron))


# ---------------------------------------------------------------- the scheduler
class CronScheduler:
    """Starts the due crons' runs: :meth:`tick` once a second on a daemon thread (one per server)."""

    def __init__(self, svc: Services, app_state: Any, interval_s: float = SCHEDULER_INTERVAL_S) -> None:
        self.svc, self.app_state, self.interval_s = svc, app_state, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elesium-crons", daemon=True)

    def start(self) -> CronScheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - Redis down: retried on the next tick
                log.warning("cron scheduler tick failed", exc_info=True)

    def tick(self, now: int | None = None) -> list[str]:
        """Start every cron due at ``now`` (ms; default: now); the run ids started."""
        now = now_ms() if now is None else now
        store = crons(self.svc, self.app_state)
        started: list[str] = []
        for tenant, cron_id, scheduled in store.due(now):
            cron = store.get(tenant, cron_id)
            if cron is None or not cron.get("enabled", True):
                store.delete(tenant, cron_id) if cron is None else store.save(cron)
                continue
            if not store.claim(cron_id, scheduled):
                continue  # another server (or an earlier tick) started this fire
            try:
                started.append(self.fire(cron))
                cron["last_error"] = None
            except Exception as exc:  # noqa: BLE001 - a fire that fails (thread busy or gone) is skipped
                cron["last_error"] = f"{type(exc).__name__}: {exc}"
                log.info("cron %s skipped its run at %s: %s", cron_id, iso(scheduled), exc)
            fresh = store.get(tenant, cron_id)  # an update or delete since the read wins
            if fresh is None:
                continue
            fresh["last_error"] = cron["last_error"]
            fresh["next_ms"] = next_fire_ms(
                fresh["schedule"], max(now, scheduled), fresh.get("timezone"), fresh.get("end_ms")
            )
            store.save(fresh)
        return started

    def fire(self, cron: dict[str, Any]) -> str:
        """Start the cron's run now, as its creator (operator role only); the run id."""
        svc = self.svc
        who = Principal(
            tenant=cron["tenant"], key_id=cron.get("key_id") or "cron", roles=frozenset({"operator"})
        )
        body = _run_body(cron)
        if cron.get("thread_id"):
            thread = svc.get_thread(cron["thread_id"], who.tenant)
            if thread is None:
                raise NotFound.of("thread", cron["thread_id"])
            wf, row = svc.prepare_run(who, thread, body)
        else:
            tid = str(uuid.uuid4())
            thread = ThreadRow(thread_id=tid, tenant=who.tenant, metadata={"cron_id": cron["cron_id"]})
            wf, row = svc.prepare_run(who, thread, body)
            svc.create_thread(who, tid, thread.metadata)
        svc.start_run(wf, row)
        return row.run_id


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Runs inside the app's lifespan (FastAPI merges router lifespans): the services exist."""
    svc = getattr(app.state, "services", None)
    scheduler = CronScheduler(svc, app.state).start() if svc is not None else None
    app.state.cron_scheduler = scheduler
    try:
        yield
    finally:
        if scheduler is not None:
            scheduler.stop()


router = APIRouter(tags=["crons"], lifespan=_lifespan)


# ---------------------------------------------------------------- routes
@router.post("/runs/crons")
def create_cron(body: CronCreate, request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    return _create(request, who, body, None)


@router.post("/threads/{thread_id}/runs/crons")
def create_thread_cron(
    thread_id: str, body: CronCreate, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    return _create(request, who, body, thread_id)


def _owned(request: Request, who: Principal, cron_id: str) -> dict[str, Any]:
    cron = _store(request).get(who.tenant, cron_id)
    if cron is None:
        raise NotFound.of("cron", cron_id)
    return cron


@router.patch("/runs/crons/{cron_id}")
def update_cron(
    cron_id: str, body: CronPatch, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any]:
    cron = _owned(request, who, cron_id)
    sent = body.model_dump(exclude_unset=True)
    if sent.get("webhook"):
        raise InvalidRequest("webhooks are not supported")
    for field in ("schedule", "timezone", "on_run_completed", "enabled"):
        if field in sent and sent[field] is not None:
            cron[field] = sent[field]
    if "end_time" in sent:
        cron["end_ms"] = _end_ms(body.end_time)
    if "metadata" in sent:
        cron["metadata"] = body.metadata or {}
    for field in _RUN_FIELDS:
        if field in sent:
            cron["payload"][field] = sent[field]
    cron["updated_ms"] = now_ms()
    _validate(services(request), who, cron)
    return cron_json(_store(request).save(cron))


@router.delete("/runs/crons/{cron_id}", status_code=204)
def delete_cron(cron_id: str, request: Request, who: Principal = Depends(principal)) -> Response:
    _owned(request, who, cron_id)
    _store(request).delete(who.tenant, cron_id)
    return Response(status_code=204)


def _found(request: Request, who: Principal, body: CronSearch) -> list[dict[str, Any]]:
    svc = services(request)
    wanted_assistant = None
    if body.assistant_id:
        try:
            wanted_assistant = assistant_id_of(svc.resolve_assistant(body.assistant_id))
        except NotFound:
            return []
    out = []
    for cron in _store(request).of_tenant(who.tenant):
        if wanted_assistant and cron["assistant_id"] != wanted_assistant:
            continue
        if body.thread_id and cron.get("thread_id") != body.thread_id:
            continue
        if body.enabled is not None and bool(cron.get("enabled", True)) != body.enabled:
            continue
        if not all((cron.get("metadata") or {}).get(k) == v for k, v in (body.metadata or {}).items()):
            continue
        out.append(cron_json(cron))
    return out


@router.post("/runs/crons/search")
def search_crons(
    body: CronSearch, request: Request, who: Principal = Depends(principal)
) -> list[dict[str, Any]]:
    found = _found(request, who, body)
    key = body.sort_by or "created_at"
    found.sort(key=lambda c: (c.get(key) is None, c.get(key) or ""), reverse=body.sort_order == "desc")
    page = found[body.offset : body.offset + body.limit]
    if body.select:
        page = [{k: c.get(k) for k in body.select} for c in page]
    return page


@router.post("/runs/crons/count")
def count_crons(body: CronSearch, request: Request, who: Principal = Depends(principal)) -> int:
    return len(_found(request, who, body))
