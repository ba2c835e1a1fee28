"""The API's domain errors and the one place that turns exceptions into HTTP answers.

Services (:mod:`elesium.api.execution`, :mod:`elesium.api.chat_completions`, the auth dependency)
raise these instead of ``HTTPException`` so they stay callable outside a request (the queue worker,
tests, the CLI) and so each status code is decided here once. Every answer has the LangGraph
protocol's shape, ``{"detail": "<one line>"}``, which the openai client also reports as the message.
The errors subclass :class:`elesium.errors.UserError`: the caller can fix them, so no traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from elesium.errors import UserError


class ApiError(UserError):
    """A request the API refuses; ``status_code`` is the class's, ``detail`` the one-line reason."""

    status_code: ClassVar[int] = 400

    def __init__(self, detail: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = dict(headers or {})


class BadRequest(ApiError):
    """Well-formed but over a server limit (OpenAI route: max_tokens cap, prompt length, empty messages)."""

    status_code = 400


class Unauthorized(ApiError):
    """No API key, or one this server does not know."""

    status_code = 401


class NotFound(ApiError):
    """A thread, run, checkpoint, assistant or model that does not exist for this tenant."""

    status_code = 404

    @classmethod
    def of(cls, what: str, ident: str) -> NotFound:
        """One wording for every missing object, so clients can match on it."""
        return cls(f"{what} {ident!r} not found")


class Conflict(ApiError):
    """The request is valid but the object's current state refuses it (busy thread, existing id)."""

    status_code = 409


class InvalidRequest(ApiError):
    """A field holds a value this server does not accept (same code as pydantic's validation errors)."""

    status_code = 422


async def _detail(request: Request, exc: Exception) -> JSONResponse:
    """``ApiError`` -> its status; a refused replay -> 409; a full engine queue -> 429; the state layer's
    errors -> 503 (Redis unreachable) or 409, and any other ``UserError`` -> 400, each with its message's
    first line (the rest says what an operator should change, which a client cannot)."""
    from elesium.graphs.replay import ReplayRefused
    from elesium.inference.batcher import EngineBusyError
    from elesium.state.errors import RedisUnavailableError, StateError

    if isinstance(exc, ApiError):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
    if isinstance(exc, ReplayRefused):
        return JSONResponse({"detail": str(exc)}, status_code=409)
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, EngineBusyError):  # the engine's wait queue is full: come back shortly
        return JSONResponse({"detail": line}, status_code=429, headers={"Retry-After": "1"})
    if isinstance(exc, RedisUnavailableError):
        return JSONResponse({"detail": line}, status_code=503)
    if isinstance(exc, StateError):
        return JSONResponse({"detail": line}, status_code=409)
    return JSONResponse({"detail": line}, status_code=400)  # any other UserError


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """Pydantic's errors as one readable ``detail`` line, the full list kept under ``errors``."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return JSONResponse(
        {"detail": f"{where}: {first.get('msg')}", "errors": json.loads(json.dumps(errors, default=str))},
        status_code=422,
    )


def install_handlers(app: FastAPI) -> None:
    """Register every exception -> HTTP mapping of the API (the only place one is registered).

    Starlette picks the handler of the nearest class in the exception's MRO, so ``ApiError`` and the
    state layer's types win over the ``UserError`` fallback. The handlers are coroutines that touch
    nothing but the exception, so they never block the event loop.
    """
    from elesium.graphs.replay import ReplayRefused
    from elesium.state.errors import RedisUnavailableError, StateError

    app.add_exception_handler(RequestValidationError, _invalid)
    for exc_type in (ApiError, RedisUnavailableError, StateError, ReplayRefused, UserError):
        app.add_exception_handler(exc_type, _detail)
