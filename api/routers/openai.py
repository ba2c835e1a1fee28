"""OpenAI-compatible chat completions and model list, on the same engine queue as workflow runs.

Standard fields (``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream`` with ``stream_options.include_usage``, ``response_format``, ``tools`` and
``tool_choice``, ``logprobs``/``top_logprobs``) plus ``mode``, the decoding mode
(vanilla | speculative | typical) and ``top_k``. Anything else that would change the output answers
400 naming it (:mod:`elesium.api.chat_completions` says what each parameter means here). Refusals
carry OpenAI's error body (``error.message``, ``error.param``) beside this API's ``detail``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from elesium.api import chat_completions as chat_service
from elesium.api.auth import Principal, principal
from elesium.api.errors import ApiError
from elesium.api.routers.common import follow_until_disconnect, services, until_disconnect
from elesium.api.schemas import ChatCompletionRequest

router = APIRouter(tags=["openai"])


@router.get("/v1/models")
def models(request: Request, who: Principal = Depends(principal)) -> dict[str, Any]:
    svc = services(request)
    return {
        "object": "list",
        "data": [
            {
                "id": svc.settings.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "elesium",
                "modes": list(svc.engine.modes),
            }
        ],
    }


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, who: Principal = Depends(principal)
) -> dict[str, Any] | Response:
    """Async without blocking: no Redis here, the generation waits on the engine thread."""
    try:
        chat = chat_service.prepare(services(request), body)
        chat.tenant = who.tenant
    except ApiError as exc:
        # OpenAI clients read ``error.message`` (the openai package puts it in the exception's text).
        error = {"message": exc.detail, "type": "invalid_request_error",
                 "param": getattr(exc, "param", None), "code": None}
        return JSONResponse({"detail": exc.detail, "error": error}, status_code=exc.status_code,
                            headers=exc.headers or None)
    if not body.stream:
        answer = await chat.complete(left=until_disconnect(request))
        if answer is None:
            # The client left; the generation was stopped and nobody reads this (499, as nginx logs it).
            return Response(status_code=499)
        return answer
    channel = chat.start_stream()
    events = follow_until_disconnect(request, channel, on_disconnect=channel.cancel.set)
    return StreamingResponse(
        chat.frames(events), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
    )
