"""OpenAI-compatible chat completions and model list, on the same engine queue as workflow runs.

Standard fields (``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``stream`` with ``stream_options.include_usage``) plus ``mode``, the decoding mode
(vanilla | speculative | typical). ``n`` > 1, tools and logprobs are not offered.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import StreamingResponse

from elesium.api.auth import Principal, principal
from elesium.api.events import RunChannel
from elesium.api.execution import Services
from elesium.api.routers.common import follow_until_disconnect, services
from elesium.api.schemas import ChatCompletionRequest

router = APIRouter(tags=["openai"])


def _mode(svc: Services, requested: str | None) -> str | None:
    if requested is None:
        return None
    from elesium.inference.records import normalize_mode

    mode = normalize_mode(requested)
    modes = tuple(svc.engine.modes)
    if mode not in modes and mode == "speculative" and "medusa" in modes:
        return "medusa"
    if mode not in modes:
        raise HTTPException(
            status_code=400,
            detail=f"mode {requested!r} is not available on this engine (available: {', '.join(modes)})",
        )
    return mode


def _prepare(svc: Services, body: ChatCompletionRequest) -> tuple[list[dict[str, str]], Any, str | None, int]:
    """Validate everything before the engine sees it: 400 with the reason, nothing queued."""
    from elesium.inference.sampling import SamplingParams

    if body.model not in (svc.settings.model_name, "elesium"):
        raise HTTPException(
            status_code=404,
            detail=f"model {body.model!r} not found; GET /v1/models lists {svc.settings.model_name!r}",
        )
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    if not any(m["content"].strip() for m in messages):
        raise HTTPException(status_code=400, detail="messages are empty")
    max_tokens = body.max_completion_tokens or body.max_tokens or 256
    if max_tokens > svc.settings.max_tokens_cap:
        raise HTTPException(
            status_code=400,
            detail=f"max_tokens {max_tokens} exceeds this server's cap of {svc.settings.max_tokens_cap}",
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=tuple(stops),
        )
        n_prompt = len(svc.engine.encode_prompt(messages))
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=str(exc).splitlines()[0]) from None
    if n_prompt > svc.settings.max_prompt_tokens:
        raise HTTPException(
            status_code=400,
            detail=f"prompt is {n_prompt} tokens; this server accepts up to {svc.settings.max_prompt_tokens}",
        )
    return messages, params, _mode(svc, body.mode), n_prompt


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


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
) -> Any:
    svc = services(request)
    messages, params, mode, _ = _prepare(svc, body)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    model = svc.settings.model_name
    if not body.stream:

        def work() -> Any:
            gen = svc.engine.generate(messages, params, mode=mode)
            svc.metrics.generated_tokens.inc(gen.new_tokens)
            svc.metrics.prompt_tokens.inc(gen.prompt_tokens)
            svc.metrics.observe_steps(list(gen.steps))
            return gen

        gen = await svc.worker.run(work)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": f"seed-{gen.seed}",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": gen.text},
                    "finish_reason": _finish(gen.finish_reason),
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": gen.prompt_tokens,
                "completion_tokens": gen.new_tokens,
                "total_tokens": gen.prompt_tokens + gen.new_tokens,
            },
        }

    channel = RunChannel()

    def stream_work() -> None:
        stream = None
        finished = False
        try:
            if channel.cancel.is_set():
                return
            stream = svc.engine.stream(messages, params, mode=mode)
            for chunk in stream:
                if channel.cancel.is_set():
                    return
                if chunk.text:
                    channel.publish("delta", chunk.text)
            finished = True
            gen = stream.result
            svc.metrics.generated_tokens.inc(gen.new_tokens)
            svc.metrics.prompt_tokens.inc(gen.prompt_tokens)
            svc.metrics.observe_steps(list(gen.steps))
            channel.publish(
                "done",
                {
                    "finish_reason": _finish(gen.finish_reason),
                    "usage": {
                        "prompt_tokens": gen.prompt_tokens,
                        "completion_tokens": gen.new_tokens,
                        "total_tokens": gen.prompt_tokens + gen.new_tokens,
                    },
                },
            )
        except Exception as exc:  # noqa: BLE001 - reported in-stream: the headers are already sent
            channel.publish("error", {"message": f"{type(exc).__name__}: {exc}"})
        finally:
            if stream is not None and not finished and hasattr(stream, "close"):
                stream.close()  # releases the engine at once (contract C2)
            channel.close()

    svc.worker.submit(stream_work)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def frame(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data)}\n\n".encode()

    async def events() -> AsyncIterator[bytes]:
        yield frame({"role": "assistant", "content": ""})
        async for kind, data in follow_until_disconnect(request, channel, on_disconnect=channel.cancel.set):
            if kind == "delta":
                yield frame({"content": data})
            elif kind == "done":
                yield frame({}, data["finish_reason"])
                if include_usage:
                    usage = {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": data["usage"],
                    }
                    yield f"data: {json.dumps(usage)}\n\n".encode()
            elif kind == "error":
                yield f"data: {json.dumps({'error': data})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})
