"""OpenAI-compatible chat completions and model list, on the same engine queue as workflow runs.

Standard fields (``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream`` with ``stream_options.include_usage``) plus ``mode``, the decoding mode
(vanilla | speculative | typical). ``n`` > 1, tools and logprobs are not offered.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from elesium.api import chat_completions as chat_service
from elesium.api.auth import Principal, principal
from elesium.api.routers.common import follow_until_disconnect, services
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
) -> dict[str, Any] | StreamingResponse:
    """Async without blocking: no Redis here, the generation waits on the engine thread."""
    chat = chat_service.prepare(services(request), body)
    if not body.stream:
        return await chat.complete()
    channel = chat.start_stream()
    events = follow_until_disconnect(request, channel, on_disconnect=channel.cancel.set)
    return StreamingResponse(
        chat.frames(events), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
    )
