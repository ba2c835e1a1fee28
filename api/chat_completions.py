"""OpenAI chat completions as a service: validate, generate on the engine thread, frame the answer.

The route (:mod:`elesium.api.routers.openai`) only translates HTTP: it calls :func:`prepare`, then
either awaits :meth:`ChatCompletion.complete` or starts :meth:`ChatCompletion.start_stream` and
wraps :meth:`ChatCompletion.frames` in an SSE response, passing the channel's events filtered by the
client's disconnect. Nothing here touches Redis: a chat completion is not a run and records nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from elesium.api.errors import BadRequest, NotFound
from elesium.api.events import RunChannel
from elesium.api.execution import Services
from elesium.api.schemas import ChatCompletionRequest
from elesium.inference.types import GenerationRequest, generate


def _finish(reason: str) -> str:
    """OpenAI knows only "length" and "stop"; a stop string or the end token are both "stop"."""
    return "length" if reason == "length" else "stop"


def _usage(gen: Any) -> dict[str, int]:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.new_tokens,
        "total_tokens": gen.prompt_tokens + gen.new_tokens,
    }


@dataclass
class ChatCompletion:
    """One validated request: what the engine generates from, and the ids its answer carries."""

    svc: Services
    messages: list[dict[str, str]]
    params: Any  # elesium.inference.sampling.SamplingParams
    mode: str | None
    prompt_tokens: int
    include_usage: bool = False
    cid: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model(self) -> str:
        return self.svc.settings.model_name

    def _count(self, gen: Any) -> None:
        self.svc.metrics.generated_tokens.inc(gen.new_tokens)
        self.svc.metrics.prompt_tokens.inc(gen.prompt_tokens)
        self.svc.metrics.observe_steps(list(gen.steps))

    async def complete(self) -> dict[str, Any]:
        """The whole answer, generated in turn with runs and replays on the engine thread."""

        def work() -> Any:
            gen = generate(self.svc.engine, GenerationRequest(self.messages, self.params, mode=self.mode))
            self._count(gen)
            return gen

        gen = await self.svc.worker.run(work)
        return {
            "id": self.cid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"seed-{gen.seed}",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": gen.text},
                    "finish_reason": _finish(gen.finish_reason),
                    "logprobs": None,
                }
            ],
            "usage": _usage(gen),
        }

    def start_stream(self) -> RunChannel:
        """Queue the generation on the engine thread; its deltas, then "done" or "error", reach the channel.

        Setting ``channel.cancel`` (the client left) stops the generation at its next token and frees
        the engine at once.
        """
        channel = RunChannel()
        self.svc.worker.submit(lambda: self._stream_work(channel))
        return channel

    def _stream_work(self, channel: RunChannel) -> None:
        stream = None
        finished = False
        try:
            if channel.cancel.is_set():
                return
            stream = self.svc.engine.start(GenerationRequest(self.messages, self.params, mode=self.mode))
            for chunk in stream:
                if channel.cancel.is_set():
                    return
                if chunk.text:
                    channel.publish("delta", chunk.text)
            finished = True
            gen = stream.result
            self._count(gen)
            channel.publish("done", {"finish_reason": _finish(gen.finish_reason), "usage": _usage(gen)})
        except Exception as exc:  # noqa: BLE001
            # Safe: a chat completion records nothing and replays nothing; the headers are already
            # sent, so the failure can only be reported in-stream.
            channel.publish("error", {"message": f"{type(exc).__name__}: {exc}"})
        finally:
            if stream is not None and not finished and hasattr(stream, "close"):
                stream.close()  # releases the engine at once
            channel.close()

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": self.cid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if self.include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data)}\n\n".encode()

    async def frames(self, events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[bytes]:
        """The OpenAI SSE body for the channel's ``events``: role, deltas, finish, usage, ``[DONE]``."""
        yield self._chunk({"role": "assistant", "content": ""})
        async for kind, data in events:
            if kind == "delta":
                yield self._chunk({"content": data})
            elif kind == "done":
                yield self._chunk({}, data["finish_reason"])
                if self.include_usage:
                    usage = {
                        "id": self.cid,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": data["usage"],
                    }
                    yield f"data: {json.dumps(usage)}\n\n".encode()
            elif kind == "error":
                yield f"data: {json.dumps({'error': data})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def prepare(svc: Services, body: ChatCompletionRequest) -> ChatCompletion:
    """Validate everything before the engine sees it (nothing is queued for a refused request).

    Server limits answer 400 (:class:`BadRequest`), an unknown model 404, an unknown decode mode 422
    like a run's (:meth:`Services.decode_mode`).
    """
    from elesium.inference.sampling import SamplingParams

    if body.model not in (svc.settings.model_name, "elesium"):
        raise NotFound(f"model {body.model!r} not found; GET /v1/models lists {svc.settings.model_name!r}")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    if not any(m["content"].strip() for m in messages):
        raise BadRequest("messages are empty")
    max_tokens = body.max_completion_tokens or body.max_tokens or 256
    if max_tokens > svc.settings.max_tokens_cap:
        raise BadRequest(
            f"max_tokens {max_tokens} exceeds this server's cap of {svc.settings.max_tokens_cap}"
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        params = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=tuple(stops),
        )
        n_prompt = len(svc.engine.encode_prompt(messages))
    except ValueError as exc:
        raise BadRequest(str(exc).splitlines()[0]) from None
    if n_prompt > svc.settings.max_prompt_tokens:
        raise BadRequest(
            f"prompt is {n_prompt} tokens; this server accepts up to {svc.settings.max_prompt_tokens}"
        )
    return ChatCompletion(
        svc=svc,
        messages=messages,
        params=params,
        mode=svc.decode_mode(body.mode) if body.mode is not None else None,
        prompt_tokens=n_prompt,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
